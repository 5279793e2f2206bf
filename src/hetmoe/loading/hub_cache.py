"""What hetmoe keeps of Hub models: their converted layouts (made once per repo + commit + quant
+ expert format, mapped at every later start), and the listing and removal behind `hetmoe ls`
and `hetmoe rm`.

    <cache dir>/converted/hub/<org>--<name>/<commit>/<safetensors|QUANT>-<format>[-g<group>]/

A new commit (after `hetmoe pull` finds one) converts again into its own directory; the layouts
of commits no record names any more are removed then.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from hetmoe import env
from hetmoe.loading.convert import ConvertOptions
from hetmoe.loading.convert_source import checkpoint_format, convert_source, default_format
from hetmoe.loading.converted import MANIFEST
from hetmoe.loading.hub import HubModel, cached_model, record_path, records_dir
from hetmoe.loading.hub_names import HubName, parse_hub_name


@dataclass(frozen=True)
class CachedEntry:
    """One row of `hetmoe ls`: a downloaded model or one of its converted layouts."""

    name: str
    """The name it is used by (`org/name[@rev][:QUANT]`)."""
    commit: str
    """The commit its files are from."""
    layout: str
    """`safetensors`, `GGUF <QUANT>` or `converted <format>[ g<group>]`."""
    size: int
    """Bytes on disk."""
    path: Path
    """Where it lies."""


def conversions_dir(repo_id: str) -> Path:
    """Converted layouts of `repo_id`, one folder per commit."""
    return env.cache_dir() / "converted" / "hub" / repo_id.replace("/", "--")


def hub_conversion(model: HubModel, fmt: str | None = None, group: int | None = None,
                   progress: bool = True) -> Path:
    """The converted layout of `model` in `fmt` (None: the one made last for this commit, else
    the format of the one made last for an older commit, else the format a local load would
    pick), converted on first use."""
    base = conversions_dir(model.name.repo_id) / model.commit
    source = model.quant or "safetensors"
    if fmt is None:
        made = sorted(base.parent.glob(f"*/{source}-*/{MANIFEST}"),
                      key=lambda p: (p.parent.parent == base, p.stat().st_mtime))
        if made and made[-1].parent.parent == base:
            return made[-1].parent
        if made:  # a new commit: the format pulled for the old one
            fmt, _, size = made[-1].parent.name.removeprefix(f"{source}-").partition("-g")
            group, why = int(size) if size else None, "as made for the previous commit"
        elif model.quant is not None:
            fmt, group, why = default_format(model.path)
        else:
            fmt, group, why = checkpoint_format(model.snapshot, group)
    else:
        why = "as asked"
    out = base / f"{source}-{fmt}{f'-g{group}' if group else ''}"
    if (out / MANIFEST).is_file():
        return out
    print(f"hetmoe: converting {model.name} ({model.commit[:12]}) into {out} with {fmt} "
          f"experts{f', group {group}' if group else ''} ({why}); first use only",
          file=sys.stderr, flush=True)
    convert_source(model.path, out, ConvertOptions(fmt, group, progress))
    prune(model.name.repo_id)
    return out


def records() -> list[HubModel]:
    """Every Hub model recorded in this cache (complete or not)."""
    found = []
    for path in sorted(records_dir().glob("*/*.json")):
        ref, _, tag = path.stem.partition("@")
        repo_id = path.parent.name.replace("--", "/", 1)
        adapter = tag == "lora"
        name = HubName(repo_id, None if ref == "main" else unquote(ref),
                       None if adapter else tag or None)
        model = cached_model(name, adapter)
        if model is not None:
            found.append(model)
    return found


def entries() -> list[CachedEntry]:
    """Downloaded models and their converted layouts, with their bytes on disk."""
    rows = []
    for model in records():
        size = sum(_file_bytes(model.snapshot / f) for f in model.files)
        layout = "LoRA adapter" if model.adapter else (
            f"GGUF {model.quant}" if model.quant else "safetensors")
        rows.append(CachedEntry(str(model.name), model.commit, layout, size, model.snapshot))
        source = model.quant or "safetensors"
        base = conversions_dir(model.name.repo_id) / model.commit
        for out in sorted(base.glob(f"{source}-*")):
            fmt = out.name.removeprefix(f"{source}-").replace("-g", " g")
            done = "" if (out / MANIFEST).is_file() else " (unfinished)"
            rows.append(CachedEntry(str(model.name), model.commit, f"converted {fmt}{done}",
                                    _tree_bytes(out), out))
    return rows


def remove(text: str) -> list[str]:
    """Removes the models named `text` (`org/name`: every revision and quant of the repo;
    `@rev` or `:QUANT` narrow it): records, converted layouts, and the downloaded files no
    other record uses. Returns what was removed; a name with nothing cached is refused."""
    name = parse_hub_name(text)
    if name is None:
        raise ValueError(f"{text!r} is not a Hub model name (org/name[@revision][:QUANT])")
    every = records()
    gone = [m for m in every if m.name.repo_id == name.repo_id
            and (name.revision is None or m.name.ref == name.ref)
            and (name.quant is None or (m.quant or "").upper() == name.quant.upper())]
    if not gone:
        cached = ", ".join(sorted({str(m.name) for m in every})) or "none"
        raise FileNotFoundError(f"{text}: not in the cache (cached: {cached})")
    kept = [m for m in every if m not in gone]
    for model in gone:
        record_path(model.name, model.adapter).unlink()
        used = {(m.commit, f) for m in kept if m.name.repo_id == model.name.repo_id
                for f in m.files}
        for f in model.files:
            if (model.commit, f) not in used:
                _unlink_cached(model.snapshot / f)
        if not any(m.commit == model.commit and m.quant == model.quant for m in kept):
            for out in (conversions_dir(model.name.repo_id) / model.commit).glob(
                    f"{model.quant or 'safetensors'}-*"):
                shutil.rmtree(out)
    prune(name.repo_id)
    return [str(m.name) for m in gone]


def prune(repo_id: str) -> None:
    """Removes `repo_id`'s converted layouts of commits no record names, and its HF cache
    folder once no record of it is left."""
    live = {m.commit for m in records() if m.name.repo_id == repo_id}
    base = conversions_dir(repo_id)
    if base.is_dir():
        for commit in base.iterdir():
            if commit.name not in live:
                shutil.rmtree(commit)
        if not any(base.iterdir()):
            base.rmdir()
    if not live:
        shutil.rmtree(env.hf_hub_cache() / f"models--{repo_id.replace('/', '--')}",
                      ignore_errors=True)


def _unlink_cached(path: Path) -> None:
    """A snapshot file and the blob it links to (huggingface_hub's cache layout)."""
    if path.is_symlink():
        blob = path.resolve()
        path.unlink()
        blob.unlink(missing_ok=True)
    elif path.exists():
        path.unlink()


def _file_bytes(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
