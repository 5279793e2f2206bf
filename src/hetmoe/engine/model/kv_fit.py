"""How many KV slots of a window fit the memory a model leaves, known before its weights load
(`hetmoe batch --max-batch auto`; `LLM(max_batch="auto")` and `hetmoe serve --max-batch auto`,
which have no job to count: the slots that fit, at most `MAX_AUTO_SLOTS`).

The KV cache lives where attention runs: on the GPU with a GPU device, else in host memory. On
the GPU its room is the one `--gpu-expert-gib auto` would take (`placement_plan.auto_room`: the
free bytes after the other weights, less prefill staging, the graphs' reserve and a margin),
less an explicit expert budget, so KV slots and resident experts never claim the same bytes.
With an `auto` expert budget the KV cache is sized first and the experts take what it leaves
(the runner places them after allocating it): in a batch job the rows decoded together are what
raise throughput (each decode step reads the experts its rows route to once, for all of them),
while a resident expert saves only its share of the CPU's reads. On the host the room is
MemAvailable less the plan's host rows (packed experts, other weights) and the same margin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetmoe.engine.model.model_setup import read_config
from hetmoe.engine.model.model_source import skeleton_plan
from hetmoe.engine.placement.placement_plan import (
    GIB,
    GRAPH_RESERVE,
    MARGIN_SHARE,
    MIN_MARGIN,
    auto_room,
    planned_staging,
)
from hetmoe.inject.apply import apply_rules
from hetmoe.inject.registry import OpContext
from hetmoe.inject.rules import load_rules, shipped_rules_path
from hetmoe.loading.checkpoint import Checkpoint
from hetmoe.loading.converted import ConvertedModel
from hetmoe.loading.fp8 import config_fp8_scheme
from hetmoe.loading.memory_plan import MemoryPlan, kv_bytes_per_token
from hetmoe.loading.skeleton import build_skeleton

MAX_AUTO_SLOTS = 256
"""Slots `auto` gives a job at most: the batch `benchmarks/serving/bench_batch.py` measures (the
throughput the docs report). At 256 rows a top-8-of-128 layer (Qwen3-30B-A3B) routes 16 tokens
per expert on average, a full AMX tile: each expert's weights, read once per step, already serve
a full tile, so more rows add compute about in proportion and little throughput, while every
decode batch size is one more CUDA graph and the host link's pinned buffers grow with it. An
explicit `--max-batch` goes beyond."""


@dataclass(frozen=True)
class KvRoom:
    """The bytes the KV cache may take, where, and how they were reached."""

    place: str
    """"GPU" or "host"."""
    device: str
    """The torch device attention runs on (cuda:0, cpu)."""
    bytes: int
    """Room for the KV cache (>= 0)."""
    parts: tuple[tuple[str, int], ...]
    """(what, bytes): the free memory first, then each claim taken from it."""
    shared: bool = False
    """`--gpu-expert-gib auto` experts take what the KV cache leaves of it (GPU, auto only)."""

    def explain(self) -> str:
        """The room as its parts: "F free, less W of other weights, ..."."""
        (what, free), *claims = self.parts
        less = ", ".join(f"{b} of {name}" for name, b in claims)
        return f"{free} bytes {what}" + (f", less {less}" if less else "")


def kv_room(mem: MemoryPlan, device: torch.device, experts: int | str) -> KvRoom:
    """The KV cache's room under `mem` (a plan without a KV row) on `device`, with the GPU expert
    budget `experts` ("auto" or bytes: bytes are claimed first, auto takes what KV leaves). On
    the CPU device a budget in bytes is claimed from the host: the runner still places up to
    that many bytes of resident expert copies there (engine/placement/slots.py, no GPU room to
    clamp them to)."""
    claimed = experts if isinstance(experts, int) else 0
    if device.type == "cuda" and mem.gpu_free is not None:
        margin = max(MIN_MARGIN, int(MARGIN_SHARE * mem.gpu_total))
        staging = planned_staging(mem)
        parts = [("free", mem.gpu_free), ("other weights", mem.total("gpu")),
                 ("prefill staging", staging.bytes if staging else 0),
                 ("CUDA graphs", GRAPH_RESERVE), ("margin", margin)]
        room, place = auto_room(mem), "GPU"
    else:
        margin = max(MIN_MARGIN, int(MARGIN_SHARE * mem.host_free))
        parts = [("available", mem.host_free), ("routed experts and other weights",
                                                mem.total("host")), ("margin", margin)]
        room, place = max(0, mem.host_free - mem.total("host") - margin), "host"
    if claimed:
        parts.append(("--gpu-expert-gib", claimed))
    return KvRoom(place, str(device), max(0, room - claimed), tuple(parts),
                  place == "GPU" and experts == "auto")


@dataclass(frozen=True)
class KvFit:
    """A job's KV cache: slots x window, where it lives and what set the slots."""

    slots: int
    window: int
    token_bytes: int
    """KV bytes of one token over all layers (`memory_plan.kv_bytes_per_token`)."""
    room: KvRoom
    limit: str
    """What set `slots`: the job's sequences, the memory, the cap or --max-batch."""

    @property
    def kv_bytes(self) -> int:
        """Bytes of the whole cache."""
        return self.slots * self.window * self.token_bytes

    def describe(self) -> str:
        """"S slots x W tokens = X GiB of KV on the GPU (cuda:0); slots: why"."""
        return (f"{self.slots} slots x {self.window} tokens = {self.kv_bytes / GIB:.2f} GiB of KV "
                f"({self.kv_bytes} bytes) on the {self.room.place} ({self.room.device}); "
                f"slots: {self.limit}")

    def auto_line(self) -> str:
        """The line `max_batch="auto"` logs at load: "KV slots: N (auto: F GiB free for KV on
        the host, S MiB per slot of W tokens; why)"."""
        one = self.window * self.token_bytes
        return (f"KV slots: {self.slots} (auto: {self.room.bytes / GIB:.2f} GiB free for KV on "
                f"the {self.room.place}, {one / 2**20:.2f} MiB per slot of {self.window} tokens; "
                f"slots: {self.limit})")


def fit_slots(room: KvRoom, token_bytes: int, window: int, wanted: int | None,
              asked: int | None = None, cap: int = MAX_AUTO_SLOTS) -> KvFit:
    """`asked` slots, or (None) min(`wanted`, the most of `window` tokens that fit `room`,
    `cap`); `wanted` None: no job to count (`LLM`), the cap stands for it. ValueError naming
    the bytes when not even one slot fits."""
    if asked is not None:
        return KvFit(asked, window, token_bytes, room, f"--max-batch {asked}")
    one = window * token_bytes
    fits = room.bytes // one
    if fits < 1:
        lower = "max_seq_len" if wanted is None else "--max-seq-len or the lines' max_tokens"
        raise ValueError(
            f"not even one KV slot fits: one slot of {window} tokens takes {one} bytes "
            f"({token_bytes} bytes per token), and the {room.place} ({room.device}) has "
            f"{room.bytes} bytes for the KV cache ({room.explain()}); lower {lower}, or free "
            "memory")
    slots = min(fits, cap) if wanted is None else min(max(1, wanted), fits, cap)
    return KvFit(slots, window, token_bytes, room, _limit(room, slots, fits, wanted, cap))


def _limit(room: KvRoom, slots: int, fits: int, wanted: int | None, cap: int) -> str:
    """What set `slots` of `fits`: the job's `wanted` sequences (None: no job), the room or
    the cap."""
    of_job = "" if wanted is None else f", of the job's {wanted} sequences"
    if wanted is not None and wanted < 1:  # every line is refused by its route: one slot
        return "one: no line of the job holds a slot (their routes refuse them)"
    if slots == wanted:
        return f"the job's {wanted} sequences"
    if slots == fits:
        shared = "; GPU experts --gpu-expert-gib auto take what KV leaves" if room.shared else ""
        return (f"the most that fit the {room.bytes / GIB:.2f} GiB the {room.place} has for "
                f"KV{of_job} ({room.explain()}{shared})")
    more = "--max-batch N" if wanted is not None else "max_batch N"
    return f"the cap of {cap} ({more} for more){of_job}"


def engine_fit(model: nn.Module, device: torch.device, dtype: torch.dtype, window: int,
               experts: int | str, converted: ConvertedModel | None) -> KvFit:
    """The KV slots `LLM(max_batch="auto")` gets from its injected meta skeleton `model`: the
    most slots of `window` tokens that fit the room its plan leaves (`kv_room`, GPU expert
    budget `experts`), at most `MAX_AUTO_SLOTS`."""
    mem = skeleton_plan(model, device, dtype, converted)
    return fit_slots(kv_room(mem, device, experts), kv_bytes_per_token(model.config, dtype),
                     window, None)



def planned_memory(path: Path, device: torch.device, dtype: torch.dtype,
                   rules: str | os.PathLike[str] | None, experts: str | None,
                   converted: ConvertedModel | None) -> tuple[MemoryPlan, Any]:
    """The memory plan (no KV row) and config of the model at `path` as `LLM` will load it: its
    meta skeleton injected with the same rules, expert backend and FP8 scheme."""
    raw = read_config(path)
    checkpoint = Checkpoint.open(path)
    model = build_skeleton(checkpoint.config, dtype)
    chosen = load_rules(rules if rules is not None
                        else shipped_rules_path(str(raw.get("model_type"))))
    apply_rules(model, chosen, OpContext(device, dtype, model.config, experts,
                                         config_fp8_scheme(raw, str(path / "config.json"))))
    return skeleton_plan(model, device, dtype, converted), model.config
