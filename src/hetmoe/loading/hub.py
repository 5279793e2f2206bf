"""Hub models fetched once into the Hugging Face cache (shared with transformers) and found there
again without a request.

The first use of a name asks the Hub for the repo's files at the revision (`model_info` with
sizes), picks the model's files (`hub_names`), checks the disk for the bytes still missing and
downloads them (`hub_download`: resumable after a kill, a Range request fetches the rest). A
record in the hetmoe cache dir then maps the name to its commit and files, so the next start
makes no request; `hetmoe pull` asks again for a newer revision. Offline (HF_HUB_OFFLINE=1,
or the Hub unreachable) a name resolves from the record alone, and a miss names the files that
are not in the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from huggingface_hub import HfApi
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hetmoe import env
from hetmoe.loading import memory_plan
from hetmoe.loading.hub_download import download
from hetmoe.loading.hub_names import (
    HubName,
    RepoFile,
    adapter_files,
    model_files,
    parse_hub_name,
)

LOGIN = "log in with `hf auth login`, or set HF_TOKEN (or pass --token)"


class OfflineError(Exception):
    """The Hub is not to be asked (HF_HUB_OFFLINE)."""


@dataclass(frozen=True)
class HubModel:
    """A Hub model whose files are all in the local cache."""

    name: HubName
    """The name it was asked by."""
    commit: str
    """The commit its files are from."""
    files: tuple[str, ...]
    """Its files, paths inside the repo (GGUF parts in order)."""
    snapshot: Path
    """The HF cache's snapshot directory of `commit`."""
    quant: str | None = None
    """The GGUF quant label, None for a safetensors repo."""
    adapter: bool = False
    """A PEFT LoRA adapter repo, not a model."""

    @property
    def path(self) -> Path:
        """What the loader opens: the snapshot directory, or a GGUF's first file."""
        return self.snapshot / self.files[0] if self.quant is not None else self.snapshot

    def missing(self) -> list[str]:
        """Files not (or not completely) in the cache."""
        return [f for f in self.files if not (self.snapshot / f).is_file()]


def records_dir() -> Path:
    """Where the name -> commit records live (in the hetmoe cache dir)."""
    return env.cache_dir() / "hub"


def record_path(name: HubName, adapter: bool = False) -> Path:
    """The record of `name` (repo, revision asked for and quant, or `lora`, in the file name)."""
    quant = "@lora" if adapter else f"@{name.quant.upper()}" if name.quant else ""
    return (records_dir() / name.repo_id.replace("/", "--")
            / f"{quote(name.ref, safe='')}{quant}.json")


def cached_model(name: HubName, adapter: bool = False) -> HubModel | None:
    """The model the record of `name` maps to (complete or not), None without a record."""
    path = record_path(name, adapter)
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return HubModel(name, raw["commit"], tuple(raw["files"]), Path(raw["snapshot"]),
                    raw.get("quant"), adapter)


def fetch_named(model: str | os.PathLike[str], token: str | None = None,
                progress: bool = True, adapter: bool = False) -> HubModel | None:
    """The Hub model (`adapter`: LoRA adapter) `model` names, fetched when not cached; None for
    an existing path or a text that cannot be a Hub name (the preset lookup or the adapter
    loader then refuses it). Presets are the caller's to look up first (`presets.presets`)."""
    text = str(model)
    if Path(text).expanduser().exists():
        return None
    name = parse_hub_name(text)
    return None if name is None else fetch_model(name, token, progress, adapter=adapter)


def fetch_model(name: HubName, token: str | None = None, progress: bool = True,
                refresh: bool = False, adapter: bool = False) -> HubModel:
    """The Hub model `name` (`adapter`: a PEFT LoRA adapter repo) in the local cache: from its
    record without a request when complete (unless `refresh`), else downloaded (see module
    doc). Errors name the repo and the fix."""
    known = cached_model(name, adapter)
    if known is not None and not known.missing() and not refresh:
        return known
    try:
        if env.hf_offline():
            raise OfflineError("HF_HUB_OFFLINE is set")
        info = _api(token).model_info(name.repo_id, revision=name.ref, files_metadata=True)
    except Exception as exc:  # translated below; re-raised unchanged if not a Hub error
        if not isinstance(exc, OfflineError) and not _is_unreachable(exc):
            raise _hub_error(name, exc, token) from None
        why = str(exc) if isinstance(exc, OfflineError) else \
            f"the Hub is unreachable ({type(exc).__name__})"
        if known is not None and not known.missing():
            print(f"hetmoe: {name}: {why}; using the cached commit {known.commit[:12]}",
                  file=sys.stderr, flush=True)
            return known
        raise FileNotFoundError(_offline_miss(name, known, why)) from None

    files = [RepoFile(s.rfilename, int(s.size or 0)) for s in info.siblings or []]
    if adapter:
        chosen, quant, note = adapter_files(name, files), None, None
    else:
        chosen, quant, note = model_files(name, files, memory_plan.host_available())
    if note:
        print(f"hetmoe: {note}", file=sys.stderr, flush=True)
    snapshot = _repo_folder(name.repo_id) / "snapshots" / str(info.sha)
    model = HubModel(name, str(info.sha), tuple(f.path for f in chosen), snapshot, quant,
                     adapter)
    sizes = {f.path: f.size for f in chosen}
    check_disk(model, sizes)
    try:
        _download(model, sizes, token, progress)
    except Exception as exc:  # the same translation
        if _is_unreachable(exc) or type(exc).__name__ in ("RemoteProtocolError", "ReadError"):
            raise RuntimeError(f"{name}: the download stopped ({type(exc).__name__}: {exc}); "
                               "run the command again to continue where it stopped") from None
        raise _hub_error(name, exc, token) from None
    if model.missing():
        raise FileNotFoundError(f"{name}: after the download, still missing from {snapshot}: "
                                f"{', '.join(model.missing())}")
    ref = _repo_folder(name.repo_id) / "refs" / name.ref
    if name.ref != model.commit:  # as huggingface_hub writes it: transformers finds the
        ref.parent.mkdir(parents=True, exist_ok=True)  # snapshot by the revision too
        ref.write_text(model.commit)
    _write_record(model)
    return model


def check_disk(model: HubModel, sizes: dict[str, int]) -> None:
    """Refuses, before any byte is fetched, a download the cache's disk has no room for."""
    need = sum(sizes[f] for f in model.missing())
    cache = env.hf_hub_cache()
    probe = next(p for p in (cache, *cache.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    if need > free:
        raise ValueError(
            f"{model.name}: downloading {len(model.missing())} files needs {need} bytes "
            f"({need / 1e9:.2f} GB) in {cache}; only {free} bytes ({free / 1e9:.2f} GB) are "
            "free there (free some space or set HF_HOME to a larger disk)")


def _api(token: str | None) -> Any:
    return HfApi(endpoint=env.hf_endpoint(), token=token)


def _repo_folder(repo_id: str) -> Path:
    return env.hf_hub_cache() / f"models--{repo_id.replace('/', '--')}"


def _download(model: HubModel, sizes: dict[str, int], token: str | None,
              progress: bool) -> None:
    if model.missing():
        print(f"hetmoe: fetching {model.name} ({model.commit[:12]}): "
              f"{', '.join(model.missing())}", file=sys.stderr, flush=True)
    download(model.name.repo_id, model.commit, sizes, token, progress)


def _write_record(model: HubModel) -> None:
    path = record_path(model.name, model.adapter)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "repo": model.name.repo_id, "revision": model.name.ref, "commit": model.commit,
        "quant": model.quant, "files": list(model.files), "snapshot": str(model.snapshot),
    }, indent=1) + "\n")
    tmp.replace(path)


def _is_unreachable(exc: Exception) -> bool:
    # By class name: huggingface_hub's HTTP client (httpx, or its fork httpx2) varies by version.
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    return isinstance(exc, OfflineModeIsEnabled) or bool(
        names & {"ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException"})


def _offline_miss(name: HubName, known: HubModel | None, why: str) -> str:
    if known is None:
        return (f"{name}: not in the cache ({env.hf_hub_cache()}) and {why}; run "
                f"`hetmoe pull {name}` where the Hub is reachable")
    return (f"{name}: {why} and the cache lacks {len(known.missing())} of its files "
            f"(commit {known.commit[:12]}): {', '.join(known.missing())}")


def _hub_error(name: HubName, exc: Exception, token: str | None) -> Exception:
    """A Hub failure as a message naming the repo and what to do; other errors unchanged."""
    where = env.hf_endpoint() or "https://huggingface.co"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, GatedRepoError):
        return ValueError(
            f"{name.repo_id} is a gated repo ({status}): accept its terms at "
            f"{where}/{name.repo_id} with your account, then {LOGIN}")
    if isinstance(exc, RevisionNotFoundError):
        return ValueError(f"{name.repo_id} has no revision {name.ref!r} on {where}")
    if isinstance(exc, RepositoryNotFoundError):
        return FileNotFoundError(
            f"{name.repo_id}: no such model repo on {where} ({status}), or it is private: "
            f"check the name; if it is yours, {LOGIN}")
    if isinstance(exc, HfHubHTTPError) and status in (401, 403):
        given = "the token given" if token else "no token"
        return ValueError(f"{name.repo_id}: {where} refused access ({status}) with "
                               f"{given}; {LOGIN}")
    return exc
