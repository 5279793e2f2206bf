"""Whether a model's experts can stream to the GPU for prefill, decided before any GPU work."""

from __future__ import annotations

import torch

from hetmoe.engine.placement.layer_stream import streaming_refusal
from hetmoe.engine.placement.stream_memory import streaming_bytes
from hetmoe.experts.cpu_moe import CpuMoE


def layers(fmt: str) -> list[CpuMoE]:
    out = []
    for _ in range(2):
        moe = CpuMoE(4, 64, 96, fmt)
        moe.load(torch.randn(4, 96, 64), torch.randn(4, 96, 64), torch.randn(4, 64, 96))
        out.append(moe)
    return out


def test_room_counts_two_staged_layers_and_one_unpacked() -> None:
    cpu = layers("int8")
    staged = sum(p.bytes for p in cpu[0].packed_groups())
    assert streaming_bytes(cpu) == 2 * staged + 4 * 3 * 64 * 96 * 2
    assert streaming_refusal(cpu, 10 * streaming_bytes(cpu)) == ""


def test_too_little_gpu_memory_is_named() -> None:
    cpu = layers("bf16")
    need = streaming_bytes(cpu)
    reason = streaming_refusal(cpu, need)  # 80 % of it is usable: not enough
    assert reason == (f"GPU prefill needs {need / 2**30:.1f} GiB of GPU memory for one layer's "
                      f"experts (staged twice and unpacked), {need / 2**30:.1f} GiB are free")
