"""A pinned host tensor seen by the GPU in place: GPU prefill reads the CPU experts' sums through
it (engine/placement/layer_stream.py) and calibration times such reads (calibration.py)."""

from __future__ import annotations

import torch


class _CudaArray:
    """`__cuda_array_interface__` of device memory at `address` (torch.as_tensor reads it)."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (address, False), "version": 3}


def gpu_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned, contiguous host tensor `host` (bf16 or fp32) as a tensor on `device` over the
    same memory (unified addressing: a pinned page's device address is its host address);
    GPU kernels read it over PCIe with no copy. Keep `host` alive while the view is used."""
    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("gpu_view needs a pinned, contiguous host tensor")
    bits = {torch.bfloat16: (torch.int16, "<i2"), torch.float32: (torch.float32, "<f4")}
    if host.dtype not in bits:
        raise ValueError(f"gpu_view: {host.dtype} is not bf16 or fp32")
    as_dtype, typestr = bits[host.dtype]
    with torch.cuda.device(device):
        raw = torch.as_tensor(_CudaArray(host.data_ptr(), tuple(host.shape), typestr),
                              device=device)
    return raw.view(host.dtype) if as_dtype != host.dtype else raw
