"""Hugging Face Hub model names as users type them, and which of a repo's files make the model.

    org/name              a safetensors repo (config, tokenizer, index and shards), branch main
    org/name@revision     the same at a branch, tag or commit
    org/name-GGUF:Q4_K_M  one quant of a GGUF repo (all its `-0000N-of-0000M` parts)

Pure functions over names and file lists: no network here (`hub.py` downloads).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from huggingface_hub.utils import HFValidationError, validate_repo_id

_NAME = re.compile(
    r"^(?P<repo>[^/@:\s]+/[^/@:\s]+)(?:@(?P<rev>[^@:\s]+))?(?::(?P<quant>[^@:\s]+))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
_QUANT_TOKEN = re.compile(r"^(?:I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)
_TOKEN_SEP = re.compile(r"[-.]")

CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "model.safetensors.index.json",
)
"""What a safetensors repo's model needs besides its weight shards (those present are fetched)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""A PEFT LoRA adapter repo's files (both needed)."""


@dataclass(frozen=True)
class HubName:
    """A model on the Hub as named by the user."""

    repo_id: str
    """`org/name`."""
    revision: str | None = None
    """Branch, tag or commit after `@` (None: main)."""
    quant: str | None = None
    """GGUF quant after `:` (None: a safetensors repo, or the largest GGUF quant that fits)."""

    @property
    def ref(self) -> str:
        """The revision asked for, `main` when none was."""
        return self.revision or "main"

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{rev}{f':{self.quant}' if self.quant else ''}"


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo at a commit."""

    path: str
    """Path inside the repo."""
    size: int
    """Bytes."""


def parse_hub_name(text: str) -> HubName | None:
    """`text` as a Hub name, or None when it cannot be one (a path, a preset, a bad repo id)."""
    if text.startswith((".", "/", "~")) or text.endswith(".gguf"):
        return None
    match = _NAME.match(text)
    if match is None:
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    return HubName(match["repo"], match["rev"], match["quant"])


def gguf_quant(path: str) -> str:
    """The quant label of a GGUF file name (`Qwen3-30B-A3B-UD-Q4_K_XL-00001-of-00002.gguf` ->
    `UD-Q4_K_XL`): its last quant-like token, else the whole stem."""
    stem = _SPLIT.sub("", path.rsplit("/", 1)[-1].removesuffix(".gguf"))
    tokens = _TOKEN_SEP.split(stem)
    for i in range(len(tokens) - 1, -1, -1):
        if _QUANT_TOKEN.match(tokens[i]):
            label = tokens[i].upper()
            return f"UD-{label}" if i > 0 and tokens[i - 1].upper() == "UD" else label
    return stem


def gguf_quants(files: list[RepoFile]) -> dict[str, list[RepoFile]]:
    """The repo's GGUF model files grouped by quant label, split parts in order (projector
    `mmproj` files are not models); a quant with missing parts is refused by name."""
    quants: dict[str, list[RepoFile]] = {}
    for f in files:
        name = f.path.rsplit("/", 1)[-1]
        if name.endswith(".gguf") and not name.lower().startswith("mmproj"):
            quants.setdefault(gguf_quant(f.path), []).append(f)
    for label, group in quants.items():
        group.sort(key=lambda f: f.path)
        parts = [_SPLIT.search(f.path.removesuffix(".gguf")) for f in group]
        if len(group) == 1 and parts[0] is None:
            continue
        counts = {int(p[2]) for p in parts if p is not None}
        numbers = [int(p[1]) for p in parts if p is not None]
        if None in parts or len(counts) != 1 or numbers != list(range(1, len(group) + 1)) \
                or counts != {len(group)}:
            names = ", ".join(f.path for f in group)
            raise ValueError(f"GGUF quant {label}: its files are not one complete split "
                             f"(-0000N-of-0000M parts 1..M): {names}")
    return quants


def checkpoint_files(files: list[RepoFile]) -> list[RepoFile]:
    """The files of a safetensors repo's model: config, tokenizer, generation config, chat
    template, index and the top-level `model*.safetensors` shards (no other copies)."""
    wanted = set(CHECKPOINT_FILES)
    return [f for f in files if f.path in wanted
            or ("/" not in f.path and f.path.startswith("model")
                and f.path.endswith(".safetensors"))]


def pick_quant(repo_id: str, quants: dict[str, list[RepoFile]], free: int) -> tuple[str, str]:
    """(label, why) of the largest quant whose files fit in `free` bytes of memory."""
    sizes = {label: sum(f.size for f in group) for label, group in quants.items()}
    listing = ", ".join(f"{label} {size / 1e9:.1f} GB" for label, size in
                        sorted(sizes.items(), key=lambda item: item[1]))
    fitting = [label for label, size in sizes.items() if size <= free]
    if not fitting:
        raise ValueError(f"{repo_id}: no GGUF quant fits in the {free / 1e9:.1f} GB of free "
                         f"memory (quants: {listing}); name one as {repo_id}:QUANT to load it "
                         "anyway")
    label = max(fitting, key=lambda q: sizes[q])
    return label, (f"{repo_id}: picked {label}, the largest quant that fits in "
                   f"{free / 1e9:.1f} GB of free memory (quants: {listing}; name another as "
                   f"{repo_id}:QUANT)")


def model_files(name: HubName, files: list[RepoFile], free: int
                ) -> tuple[list[RepoFile], str | None, str | None]:
    """(files to fetch, GGUF quant label or None, a note for the user or None) of the model
    `name` names in a repo holding `files`; a repo with neither kind of weights, or a quant it
    lacks, is refused with what it has."""
    quants = gguf_quants(files)
    shards = [f for f in checkpoint_files(files) if f.path.endswith(".safetensors")]
    if name.quant is None and shards and any(f.path == "config.json" for f in files):
        return checkpoint_files(files), None, None
    if not quants:
        if name.quant is not None:
            raise ValueError(f"{name}: `:{name.quant}` picks a GGUF quant; {name.repo_id} has "
                             "no GGUF files")
        found = ", ".join(f.path for f in files[:12]) or "no files"
        raise ValueError(f"{name}: neither safetensors weights (config.json and "
                         f"model*.safetensors) nor GGUF files in the repo (found: {found})")
    if name.quant is None:
        label, note = pick_quant(name.repo_id, quants, free)
        return quants[label], label, note
    chosen = {q.upper(): q for q in quants}.get(name.quant.upper())
    if chosen is None:
        raise ValueError(f"{name}: no quant {name.quant!r} in {name.repo_id} (quants: "
                         f"{', '.join(sorted(quants))})")
    return quants[chosen], chosen, None


def adapter_files(name: HubName, files: list[RepoFile]) -> list[RepoFile]:
    """The files of a PEFT LoRA adapter repo; one lacking either is refused with what it has."""
    chosen = [f for f in files if f.path in ADAPTER_FILES]
    if len(chosen) != len(ADAPTER_FILES):
        found = ", ".join(f.path for f in files[:12]) or "no files"
        raise ValueError(f"{name}: not a PEFT LoRA adapter repo (needs "
                         f"{' and '.join(ADAPTER_FILES)}; found: {found})")
    return chosen
