"""`packed_moe`'s checks of its call's tensors: shapes, dtypes and one device, named in the error
(no host sync)."""

from __future__ import annotations

import importlib.util

import torch

from hetmoe.experts.packed_layout import PackedGroup


def check_call(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               packed: torch.Tensor, part: PackedGroup, hidden: int) -> None:
    """ValueError naming the tensor whose shape, dtype or device is wrong (no host sync)."""
    if x.dim() != 2 or x.shape[1] != hidden or not x.is_floating_point():
        raise ValueError(f"packed_moe: x must be a float [T, {hidden}] tensor, got "
                         f"{x.dtype} {list(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.is_floating_point():
        raise ValueError(f"packed_moe: ids must be an integer [{x.shape[0]}, K] tensor, got "
                         f"{ids.dtype} {list(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(f"packed_moe: weights must be {list(ids.shape)} like ids, got "
                         f"{list(weights.shape)}")
    if packed.dtype != torch.uint8 or packed.dim() != 1 or not packed.is_contiguous():
        raise ValueError(f"packed_moe: packed must be a contiguous 1-D uint8 tensor, got "
                         f"{packed.dtype} {list(packed.shape)}")
    if packed.numel() == 0 or packed.numel() % part.expert_bytes:
        raise ValueError(f"packed_moe: packed holds {packed.numel()} bytes, not a whole "
                         f"number of experts of {part.expert_bytes} bytes")
    devices = {t.device for t in (x, ids, weights, packed)}
    if len(devices) != 1 or x.device.type != ("cpu" if _interpreting() else "cuda"):
        raise ValueError(f"packed_moe: x, ids, weights and packed must be on one CUDA device, "
                         f"got {', '.join(sorted(map(str, devices)))}")


def _interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels on CPU tensors (TRITON_INTERPRET=1, as
    the kernel tests set on machines without a GPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton  # optional (found above): imported only where it is installed

    return bool(triton.knobs.runtime.interpret)
