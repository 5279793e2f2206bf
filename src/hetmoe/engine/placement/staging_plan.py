"""How many experts of a layer a streamed prefill stages on the GPU: the cap k and its bytes.

A streamed pass copies each MoE layer's misses into one of two staging buffers (layer i + 2's
copy into layer i's buffer once layer i is computed: engine/placement/layer_stream.py), so a
staged expert takes twice its packed bytes on the GPU, plus once its bf16 bytes where prefill
unpacks (kernels/prefill_path.py: no such copy when the packed kernels run). The buffers hold
at most k experts; a pass streams at most k misses per layer and the CPU computes the others at
the same time (the split that `LayerStreamer.begin(tokens, top_k, gpu_experts)` already makes).

The trade-off. Staging and resident experts share the GPU's room for experts (what is free after
the other weights, the KV cache, graphs and the margin: placement_plan.auto_budget). A resident
byte serves decode and prefill, but only one expert of one layer: of L MoE layers of E experts
of b bytes, x resident bytes put x / (L E b) of the routed work on the GPU. A staged expert
serves every layer in turn: s staging bytes stream s / (2 b E) of each layer's misses, L / 2
times the share per byte (29x for DeepSeek-V3's 58 layers), but only for prompts long enough to
pay for the copies; decode never uses the staging. So staging comes first, bounded so that it
never takes most of a card from decode:

    k = E (a whole layer)        when 2 whole layers fit in STAGING_SHARE of the GPU's memory
                                 and the room (Qwen3-30B-A3B: 2 x 0.6 GB on any card)
    k = min(STAGING_SHARE x GPU memory, room) // staged bytes per expert    otherwise
    k = 0                        when every expert is resident (nothing to stream)

An explicit budget (`--gpu-expert-gib N`) leaves staging what the budget does not ask for, up to
a whole layer (budget 0: the whole room). A share of the GPU's memory, not of the room, keeps k
the same before and after the KV cache is allocated (`hetmoe batch` sizes the KV cache by it).
"""

from __future__ import annotations

from dataclasses import dataclass

STAGING_SHARE = 0.3
"""Most of the GPU's memory the prefill staging takes: an 80 GB card stages a whole INT8
DeepSeek-V3 layer (2 x 11.3 GB), a 24 GB card ~7 GB of one (~80 of its 256 experts)."""


@dataclass(frozen=True)
class StagingPlan:
    """The prefill staging of a model's MoE layers (see the module docstring)."""

    experts: int
    """k: experts of a layer the staging buffers hold, the most misses a pass streams per layer
    (0: prefill does not stream)."""
    num_experts: int
    """Experts of the largest MoE layer."""
    expert_bytes: int
    """GPU bytes one staged expert takes: twice its packed bytes (two buffers), plus its bf16
    bytes when prefill unpacks."""
    why: str = ""
    """Why k is 0 ("" otherwise)."""

    @property
    def bytes(self) -> int:
        """GPU bytes the staging takes."""
        return self.experts * self.expert_bytes

    @property
    def whole(self) -> bool:
        """Whether a whole layer streams (every miss of every layer)."""
        return self.experts >= self.num_experts

    def describe(self) -> str:
        """One line for `hetmoe info` and the streamer's log line."""
        if not self.experts:
            return f"prefill staging: none ({self.why})"
        share = "a whole layer" if self.whole else "the CPU computes the other misses"
        return (f"prefill staging: {self.experts} of {self.num_experts} experts per layer, "
                f"{self.bytes / 2**30:.2f} GiB ({self.bytes} bytes; {self.expert_bytes} per "
                f"expert); a pass streams at most {self.experts} misses per layer ({share})")


def plan_staging(num_experts: int, expert_bytes: int, room: int, gpu_total: int,
                 asked: int | str = "auto", all_experts: int | None = None) -> StagingPlan:
    """The staging of layers of at most `num_experts` experts taking `expert_bytes` GPU bytes
    each when staged, given `room` GPU bytes for experts and staging (free memory less the
    reserves), a GPU of `gpu_total` bytes, the resident budget `asked` ("auto" or bytes) and
    the packed bytes of every routed expert `all_experts` (None: not known; then never all
    resident)."""
    if num_experts <= 0 or expert_bytes <= 0:
        raise ValueError(f"plan_staging: layers of {num_experts} experts of {expert_bytes} "
                         "bytes; both must be > 0")
    if not isinstance(asked, int) and asked != "auto":
        raise ValueError(f"plan_staging: asked must be 'auto' or bytes, got {asked!r}")
    wanted = all_experts if asked == "auto" or all_experts is None else min(asked, all_experts)
    if all_experts is not None and wanted == all_experts <= room:
        return StagingPlan(0, num_experts, expert_bytes, "every routed expert is resident")
    cap = int(STAGING_SHARE * gpu_total)
    if isinstance(asked, int):
        cap = max(cap, room - asked)  # what the explicit budget leaves
    k = min(num_experts, max(0, min(cap, room)) // expert_bytes)
    why = "" if k else (f"{max(0, room)} bytes of room for experts, one staged expert takes "
                        f"{expert_bytes}")
    return StagingPlan(k, num_experts, expert_bytes, why)


def streamer_cap(planned: int | None, num_experts: int, expert_bytes: int, free: int,
                 room: int) -> int:
    """k for a streamer made now, with `free` GPU bytes free and `room` of them for experts
    (less the reserves): a placement's `planned` k (its bytes left free by the placement) while
    `free` holds it; without one, a whole layer within `room` (budget 0: the room is staging's)."""
    if planned is not None:
        return min(planned, free // expert_bytes)
    return min(num_experts, max(0, room) // expert_bytes)
