"""The routed experts' backward on the CPU backend's packed weights (csrc/moe/backward_job.h).

Experts are frozen: only the input and the routing weights get gradients. For out[q, H] =
sum_j w_j * expert_{ids_j}(x), given dY = d loss / d out:
    dx[t]          = sum_j w_j * J_{e_j}(x_t)^T dY_t   (down, SiLU gate, gate/up transposed)
    dweights[t, j] = <dY_t, expert_{e_j}(x_t)>
Math "fp32": the C++ job recomputes each expert's activations from x in fp32 on the exactly
dequantized weights (no activation rounding, unlike the int forward kernels), so both gradients
are those of the dequantized model. Math "bf16" (bf16 training; the default for bf16 x): the
inference kernels' GEMMs, AMX tiles where an expert has enough rows, with x, dY and the SiLU's
gradient rounded to bf16 (x to u8 per group for the int formats' recompute, as their forward
rounds it); below AVX-512 it is the fp32 math. Runs on the process-wide pool.
"""

from __future__ import annotations

import torch

from hetmoe.experts.cpu_moe import CpuMoE

_X_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
MATHS = ("fp32", "bf16")


def expert_backward(moe: CpuMoE, x: torch.Tensor, expert_ids: torch.Tensor,
                    expert_weights: torch.Tensor, grad_out: torch.Tensor,
                    math: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [q, H] float32, dweights [q, k] float32) of `moe.forward(x, ids, weights)` for
    grad_out [q, H] (any float dtype). Ids of -1 and GPU-marked experts get dweights 0.
    `math`: "fp32" or "bf16" (module docstring); None: bf16 for bf16 x, else fp32."""
    _check(moe, "expert_backward", x, expert_ids, expert_weights, grad_out)
    if math is None:
        math = "bf16" if x.dtype == torch.bfloat16 else "fp32"
    if math not in MATHS:
        raise ValueError(f"expert_backward: math must be one of {MATHS}, found {math!r}")
    q, k = expert_ids.shape
    dx = torch.empty(q, moe.hidden, dtype=torch.float32)
    dweights = torch.empty(q, k, dtype=torch.float32)
    _run(moe, x, expert_ids, expert_weights, grad_out.to(torch.float32).contiguous(), dx,
         dweights, None, bf16_math=math == "bf16")
    return dx, dweights


def expert_forward_fp32(moe: CpuMoE, x: torch.Tensor, expert_ids: torch.Tensor,
                        expert_weights: torch.Tensor) -> torch.Tensor:
    """`moe.forward` in fp32 throughout ([q, H] float32): the activations are not rounded to
    bf16 / u8 as the inference kernels round them (fp32 training; slower, no AMX)."""
    _check(moe, "expert_forward_fp32", x, expert_ids, expert_weights, None)
    out = torch.empty(x.shape[0], moe.hidden, dtype=torch.float32)
    _run(moe, x, expert_ids, expert_weights, None, None, None, out)
    return out


def _check(moe: CpuMoE, where: str, x: torch.Tensor, expert_ids: torch.Tensor,
           expert_weights: torch.Tensor, grad_out: torch.Tensor | None) -> None:
    tensors = [("x", x), ("expert_ids", expert_ids), ("expert_weights", expert_weights)]
    if grad_out is not None:
        tensors.append(("grad_out", grad_out))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_cpu or t.ndim != 2:
            found = (f"{tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                     else type(t).__name__)
            raise ValueError(f"{where}: {name} must be a 2-D CPU tensor, found {found}")
    q, h = x.shape
    if x.dtype not in _X_DTYPES or h != moe.hidden:
        raise ValueError(f"{where}: x must be [q, {moe.hidden}] bfloat16 or float32, found "
                         f"{list(x.shape)} {x.dtype}")
    if expert_ids.dtype != torch.int64 or expert_ids.shape[0] != q or expert_ids.shape[1] < 1:
        raise ValueError(f"{where}: expert_ids must be [{q}, k] int64 with k >= 1, found "
                         f"{list(expert_ids.shape)} {expert_ids.dtype}")
    if expert_weights.shape != expert_ids.shape or not expert_weights.is_floating_point():
        raise ValueError(f"{where}: expert_weights must be float of the shape of expert_ids "
                         f"{list(expert_ids.shape)}, found {list(expert_weights.shape)} "
                         f"{expert_weights.dtype}")
    if grad_out is not None and (grad_out.shape != x.shape or not grad_out.is_floating_point()):
        raise ValueError(f"{where}: grad_out must be float {list(x.shape)}, found "
                         f"{list(grad_out.shape)} {grad_out.dtype}")


def _run(moe: CpuMoE, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
         dy: torch.Tensor | None, dx: torch.Tensor | None, dweights: torch.Tensor | None,
         out: torch.Tensor | None, bf16_math: bool = False) -> None:
    q, k = expert_ids.shape
    if q == 0:
        return
    x, ids = x.contiguous(), expert_ids.contiguous()
    weights = expert_weights.to(torch.float32).contiguous()
    loaded = moe._loaded.to(torch.uint8)
    mask = moe._gpu_mask

    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    try:
        moe._layer.backward(x.data_ptr(), _X_DTYPES[x.dtype], ids.data_ptr(),
                            weights.data_ptr(), q, k, ptr(dy), ptr(dx), ptr(dweights), ptr(out),
                            ptr(mask), loaded.data_ptr(), 0, bf16_math)
    except IndexError:
        moe._check_ids(ids)  # names the first bad id as CpuMoE.forward does
        raise
