"""The bytes of a Hub model's files into the Hugging Face cache, resumable after a kill.

huggingface_hub (since 1.31, HTTP and Xet alike) writes a download to a process-unique
temporary file and drops it on failure, so a killed download starts over. Each missing file is
therefore first filled into the cache's own blob, `blobs/<etag>`, through `<etag>.incomplete`,
which a later run continues with huggingface_hub's `http_get(resume_size=...)` (a Range request
to the file's resolved URL, which the Hub serves for Xet-stored files too: hf_xet's parallel
transfer is given up for resumability); `snapshot_download` then links the snapshot to those
blobs without fetching them again.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from huggingface_hub import get_hf_file_metadata, hf_hub_url, snapshot_download
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import WeakFileLock, build_hf_headers
from huggingface_hub.utils import tqdm as hf_tqdm

from hetmoe import env

WORKERS = 8
"""Files fetched at once (snapshot_download's default too)."""


def download(repo_id: str, commit: str, sizes: dict[str, int], token: str | None,
             progress: bool) -> None:
    """Fetches the files of `sizes` ({path: bytes}) of `repo_id` at `commit` into the HF
    cache (see module doc), up to `WORKERS` at once, under one bar: bytes, rate, ETA."""
    silent = _silent()
    folder = env.hf_hub_cache() / f"models--{repo_id.replace('/', '--')}"
    todo = [f for f in sizes if not (folder / "snapshots" / commit / f).is_file()]
    with hf_tqdm(total=sum(sizes[f] for f in todo), unit="B", unit_scale=True,
                 desc=f"fetching {repo_id}", disable=None if progress and todo else True
                 ) as bar:  # None: a bar on a terminal only
        into = _into(bar)
        with ThreadPoolExecutor(max_workers=min(WORKERS, max(len(todo), 1))) as pool:
            list(pool.map(lambda f: _fill_blob(folder, repo_id, commit, f, token, into), todo))
    snapshot_download(repo_id, revision=commit, cache_dir=env.hf_hub_cache(),
                      allow_patterns=list(sizes), endpoint=env.hf_endpoint(), token=token,
                      tqdm_class=silent)  # links the filled blobs: nothing left to show


def _fill_blob(folder: Path, repo_id: str, commit: str, name: str, token: str | None,
               tqdm_class: Any) -> None:
    """`blobs/<etag>` of one file, continued from `<etag>.incomplete` when a run was cut."""
    endpoint = env.hf_endpoint()
    url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    if meta.etag is None:
        return  # not a Hub file server's answer: snapshot_download names the problem
    blob = folder / "blobs" / meta.etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    # huggingface_hub's own lock of this blob: another process fetching it waits, never appends.
    lock = env.hf_hub_cache() / ".locks" / folder.name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if not blob.is_file():
            _fill(blob, meta, url, name, token, tqdm_class)


def _fill(blob: Path, meta: Any, url: str, name: str, token: str | None,
          tqdm_class: Any) -> None:
    """Appends the rest of `blob`'s bytes to `<etag>.incomplete`, then renames it `blob`."""
    partial = blob.with_name(f"{blob.name}.incomplete")
    headers = build_hf_headers(token=token)
    if urlparse(meta.location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a CDN's signed URL: the token stays with the Hub
    with open(partial, "ab") as out:
        if out.tell():
            print(f"\nhetmoe: {name}: resuming after {out.tell()} bytes", file=sys.stderr,
                  flush=True)
        http_get(meta.location, out, resume_size=out.tell(), headers=headers,
                 expected_size=meta.size, displayed_filename=name, tqdm_class=tqdm_class)
    if meta.size is not None and partial.stat().st_size != meta.size:
        raise RuntimeError(f"{name}: got {partial.stat().st_size} bytes, the Hub says "
                           f"{meta.size}; run the command again to fetch the rest")
    os.replace(partial, blob)


def _silent() -> Any:
    class Silent(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    return Silent


def _into(bar: Any) -> Any:
    """A tqdm class for `http_get` whose bars all add to `bar` (initial: resumed bytes)."""

    class Into:
        def __init__(self, *args: Any, initial: int = 0, **kwargs: Any) -> None:
            bar.update(initial)

        def __enter__(self) -> Into:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: int | float | None = 1) -> None:
            bar.update(n)

    return Into
