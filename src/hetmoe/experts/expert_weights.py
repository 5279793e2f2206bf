"""Checks and converts expert weight tensors for `CpuMoE` before they are packed in C++."""

from __future__ import annotations

import torch

from hetmoe.experts.fp8_weight import FP8_DTYPES, Fp8Scheme

WEIGHT_FORMATS = {"bf16": 0, "int8": 1, "int4": 2, "fp8": 3}
"""Packed formats and their codes in `hetmoe._cpu` (fp8: a checkpoint's e4m3 codes and block
scales as they are, packed only from FP8 weights)."""

DEFAULT_GROUP_SIZE = {"int8": 128, "int4": 32, "fp8": 128}
"""Groups that keep the layer error under the targets (int8 <= 2e-2: 0.0176 with 128 on a
Gaussian Qwen3-30B-A3B layer, 0.0153 with 64, 0.0199 with 256; int4 <= 0.15). Int8 takes 128 for
prefill speed (AMX: one fp32 fix-up per 128 inputs instead of 64) and 6 % fewer bytes per expert;
where it does not divide hidden and intermediate (each rounded up to a multiple of 32), the
largest of 64 and 32 that does. Fp8 groups carry the checkpoint's block scales: 128 as
DeepSeek-V3's blocks (a smaller group repeats a block's scale, exact); it must divide the block."""

_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, *FP8_DTYPES)


def check_group_size(weight_format: str, group_size: int | None, hidden: int,
                     intermediate: int) -> int | None:
    """The group size to use, or ValueError saying which value is wrong and why.

    Groups are of the zero-padded dims; a group must divide H and I rounded up to a multiple of
    32, so padding never grows a dim past that by more than the 64-wide blocks already do."""
    if weight_format == "bf16":
        if group_size is not None:
            raise ValueError(f"CpuMoE: group_size applies to int8/int4/fp8 only, got "
                             f"{group_size} with weight_format='bf16'")
        return None
    h32, i32 = -(-hidden // 32) * 32, -(-intermediate // 32) * 32
    size = DEFAULT_GROUP_SIZE[weight_format] if group_size is None else group_size
    while group_size is None and size > 32 and (h32 % size or i32 % size):
        size //= 2
    if size not in (32, 64, 128, 256) or h32 % size or i32 % size:
        padded = "" if (h32, i32) == (hidden, intermediate) else f" (padded: {h32}, {i32})"
        raise ValueError(
            f"CpuMoE: group_size must be 32, 64, 128 or 256 and divide hidden ({hidden}) and "
            f"intermediate ({intermediate}) rounded up to multiples of 32{padded}, got {size}"
        )
    return size


class ExpertWeights:
    """Shape/dtype rules of one layer's expert weights and their conversion for the packer."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate

    def _shapes(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden, self.intermediate
        return {"gate": (i, h), "up": (i, h), "down": (h, i)}

    def check_stacked(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                      *scales: torch.Tensor | None) -> None:
        """gate/up [E, I, H], down [E, H, I]; FP8 needs one scale tensor per weight."""
        for (name, shape), t in zip(self._shapes().items(), (gate, up, down), strict=True):
            _check_tensor(f"CpuMoE.load: {name}", t, (self.num_experts, *shape))
        for name, s in zip(self._shapes(), scales, strict=True):
            if s is not None and (not isinstance(s, torch.Tensor) or s.dim() != 3
                                  or s.shape[0] != self.num_experts):
                raise ValueError(f"CpuMoE.load: {name}_scale must be [{self.num_experts}, rows, "
                                 f"cols], found {_describe(s)}")

    def prepare_fp8(self, expert: int, weights: tuple[torch.Tensor, ...],
                    scales: tuple[torch.Tensor | None, ...], fp8_block: tuple[int, int],
                    group_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The fp8 format's inputs: the e4m3 codes of `expert`'s three weights as contiguous
        uint8 and their block scales as contiguous float32, each checked and named when wrong
        (dtype, scale shape, block vs group, NaN codes, non-finite scales)."""
        where = f"CpuMoE.load_expert(expert={expert})"
        block_rows, block_cols = fp8_block
        if block_rows < 1 or block_cols % group_size:
            raise ValueError(f"{where}: fp8 blocks {list(fp8_block)} must have rows >= 1 and "
                             f"columns a multiple of group_size {group_size}")
        scheme = Fp8Scheme(block_rows, block_cols)
        codes, out_scales = [], []
        for (name, shape), t, s in zip(self._shapes().items(), weights, scales, strict=True):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{where}: {name} must be float8_e4m3fn (with {name}_scale) for "
                                 f"weight_format='fp8', found {_describe(t)}")
            _check_tensor(f"{where}: {name}", t, shape)
            want = scheme.scale_shape(shape)
            if (not isinstance(s, torch.Tensor) or tuple(s.shape) != want
                    or not s.dtype.is_floating_point):
                raise ValueError(f"{where}: FP8 {name} needs a float {name}_scale of shape "
                                 f"{list(want)} (blocks {list(fp8_block)}), found {_describe(s)}")
            raw = t.detach().cpu().contiguous().view(torch.uint8)
            if bool(((raw & 0x7F) == 0x7F).any()):
                raise ValueError(f"{where}: {name} holds NaN codes (e4m3 0x7F/0xFF)")
            scale = s.detach().cpu().float().contiguous()
            if not bool(scale.isfinite().all()):
                raise ValueError(f"{where}: {name}_scale holds non-finite values")
            codes.append(raw)
            out_scales.append(scale)
        return codes, out_scales

    def prepare(self, expert: int, weights: tuple[torch.Tensor, ...],
                scales: tuple[torch.Tensor | None, ...],
                fp8_block: tuple[int, int]) -> list[torch.Tensor]:
        """The three weights of `expert` as contiguous bf16 or float32 tensors (one dtype)."""
        where = f"CpuMoE.load_expert(expert={expert})"
        out = []
        scheme = Fp8Scheme(*fp8_block)
        for (name, shape), t, s in zip(self._shapes().items(), weights, scales, strict=True):
            _check_tensor(f"{where}: {name}", t, shape)
            if t.dtype in FP8_DTYPES:
                want = scheme.scale_shape(shape)
                if s is None or not isinstance(s, torch.Tensor) or tuple(s.shape) != want:
                    raise ValueError(
                        f"{where}: FP8 {name} needs {name}_scale of shape {list(want)} "
                        f"(blocks {list(fp8_block)}), found {_describe(s)}"
                    )
                t = scheme.dequantize(t.cpu(), s.cpu())
            elif s is not None:
                raise ValueError(f"{where}: {name}_scale is only for FP8 weights, {name} is "
                                 f"{t.dtype}")
            out.append(t.cpu())
        dtype = torch.bfloat16 if all(t.dtype == torch.bfloat16 for t in out) else torch.float32
        return [t.to(dtype).contiguous() for t in out]


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{list(t.shape)} {t.dtype}"
    return "None" if t is None else type(t).__name__


def _check_tensor(where: str, t: object, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype not in _SOURCE_DTYPES:
        raise ValueError(
            f"{where} must be {list(shape)} bf16/fp16/fp32/fp8, found {list(t.shape)} {t.dtype}"
        )
