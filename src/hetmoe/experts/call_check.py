"""The checks of a `CpuMoE` call's tensors, before the C++ layer reads their pointers."""

from __future__ import annotations

import torch

_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1}
"""Activation dtypes the C++ layer takes, by its code."""


def check_call(hidden: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               out: torch.Tensor | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Checks a `CpuMoE` call's tensors against a layer of width `hidden`; returns out (made
    when None) and the C++ layer's arguments (x, dtype, ids, weights, q, k, out, dtype)."""
    # Runs on every decode call of every layer: plain attribute reads only (is_cpu, ndim,
    # dtype, shape), each read once, no device objects or tensor ops. The id range is checked
    # by the C++ routing pass, which reads every id anyway; when it refuses one, check_ids
    # names it.
    where = "CpuMoE.forward"
    for name, t in (("x", x), ("expert_ids", ids), ("expert_weights", weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cpu or t.ndim != 2 or not t.is_contiguous():
            raise ValueError(
                f"{where}: {name} must be a contiguous 2-D CPU tensor, found shape "
                f"{tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}"
            )
    x_shape, ids_shape, x_dtype = x.shape, ids.shape, x.dtype
    code = _DTYPE_CODES.get(x_dtype)
    if code is None or x_shape[1] != hidden:
        raise ValueError(
            f"{where}: x must be [q, {hidden}] bfloat16 or float32, found "
            f"{list(x_shape)} {x_dtype}"
        )
    q = x_shape[0]
    if ids.dtype != torch.int64 or ids_shape[0] != q or ids_shape[1] < 1:
        raise ValueError(
            f"{where}: expert_ids must be [{q}, k] int64 with k >= 1, found "
            f"{list(ids_shape)} {ids.dtype}"
        )
    if weights.dtype != torch.float32 or weights.shape != ids_shape:
        raise ValueError(
            f"{where}: expert_weights must be float32 of the shape of expert_ids "
            f"{list(ids_shape)}, found {list(weights.shape)} {weights.dtype}"
        )
    if out is None:
        out = torch.empty_like(x)
    elif (not isinstance(out, torch.Tensor) or out.shape != x_shape or out.dtype != x_dtype
            or not out.is_cpu or not out.is_contiguous()):
        found = (f"{list(out.shape)} {out.dtype} on {out.device}"
                 if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(
            f"{where}: out must be a contiguous CPU tensor {list(x_shape)} {x_dtype}, "
            f"found {found}"
        )
    return out, (x.data_ptr(), code, ids.data_ptr(), weights.data_ptr(), q, ids_shape[1],
                 out.data_ptr(), code)

def check_ids(num_experts: int, ids: torch.Tensor) -> None:
    """ValueError naming the first id outside [-1, num_experts) (called after the C++ routing
    pass refused one)."""
    lo, hi = torch.aminmax(ids)
    if int(lo) < -1 or int(hi) >= num_experts:
        bad = ((ids < -1) | (ids >= num_experts)).nonzero()[0].tolist()
        raise ValueError(
            f"CpuMoE.forward: expert_ids{bad} = {int(ids[bad[0], bad[1]])} is outside "
            f"[-1, {num_experts})"
        )
