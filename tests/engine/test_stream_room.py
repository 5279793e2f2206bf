"""What a streamed prefill reserves on the GPU, decided before any GPU work: twice each staged
expert's packed bytes, plus its bf16 copy only where prefill unpacks (the rule the streamer
itself follows, kernels/prefill_path.py), and the refusal that names the bytes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hetmoe.engine.placement.layer_stream import LayerStreamer, streaming_refusal
from hetmoe.engine.placement.stream_memory import staged_expert_bytes
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.kernels import prefill_path

CPU = torch.device("cpu")


def layers(fmt: str) -> list[CpuMoE]:
    out = []
    for _ in range(2):
        moe = CpuMoE(4, 64, 96, fmt)
        moe.load(torch.randn(4, 96, 64), torch.randn(4, 96, 64), torch.randn(4, 64, 96))
        out.append(moe)
    return out


def packed(moe: CpuMoE) -> int:
    return sum(p.expert_bytes for p in moe.packed_groups())


def test_the_unpack_adds_bf16_bytes_and_the_packed_kernels_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = layers("int8")
    bf16 = 3 * 64 * 96 * 2  # gate, up and down of one expert
    # The packed kernels do not run on the CPU device: the streamer unpacks, and so counts.
    assert prefill_path.unpack_reason(CPU, "int8") == ("the packed expert kernels run on CUDA "
                                                       "GPUs, not cpu")
    assert staged_expert_bytes(cpu, CPU) == 2 * packed(cpu[0]) + bf16
    assert not LayerStreamer(cpu, CPU).packed_kernel
    # Where they run (a GPU with Triton: faked here), a staged expert is its packed bytes twice.
    monkeypatch.setattr(prefill_path, "unsupported", lambda device, fmt: "")
    assert staged_expert_bytes(cpu, CPU) == 2 * packed(cpu[0])
    assert LayerStreamer(cpu, CPU).packed_kernel
    # HETMOE_GPU_EXPERTS=unpack asks for the unpack: both see it.
    monkeypatch.setenv("HETMOE_GPU_EXPERTS", "unpack")
    assert prefill_path.unpack_reason(CPU, "int8") == "HETMOE_GPU_EXPERTS=unpack"
    assert staged_expert_bytes(cpu, CPU) == 2 * packed(cpu[0]) + bf16
    assert not LayerStreamer(cpu, CPU).packed_kernel


def test_the_staging_buffers_hold_cap_experts_of_the_largest() -> None:
    cpu = layers("int8")
    assert [b.numel() for b in LayerStreamer(cpu, CPU).staging] == [4 * packed(cpu[0])] * 2
    assert [b.numel() for b in LayerStreamer(cpu, CPU, cap=3).staging] == [3 * packed(cpu[0])] * 2
    assert LayerStreamer(cpu, CPU, cap=9).cap == 4  # more than a layer: a layer


def test_no_room_for_one_expert_is_named() -> None:
    cpu = layers("bf16")
    staged = staged_expert_bytes(cpu, CPU)
    assert streaming_refusal(cpu, 1, staged, staged) == ""
    reason = streaming_refusal(cpu, 0, staged, staged - 1)
    assert reason == (f"GPU prefill has no room to stage one expert per layer: one takes {staged} "
                      f"bytes ({staged / 2**30:.2f} GiB: its packed bytes twice, plus bf16 where "
                      f"prefill unpacks), {staged - 1} bytes are free for experts")
    with pytest.raises(ValueError, match="no room to stage one expert per layer"):
        LayerStreamer(cpu, CPU, cap=0)


def test_a_dropped_streamer_is_freed_at_once() -> None:
    """Its links hold it weakly, so no cycle keeps its staging (and a placement's slots) alive
    until the next garbage collection: a re-placement must find that memory free."""
    streamer = LayerStreamer(layers("int8"), CPU)
    link, gone = streamer.links[0], weakref.ref(streamer)
    gc.disable()
    try:
        del streamer
        assert gone() is None
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="streamer was dropped"):
        link.start(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2))
