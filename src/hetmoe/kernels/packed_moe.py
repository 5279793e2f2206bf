"""Routed experts of one NUMA group computed on the GPU straight from the CPU backend's packed
bytes (experts/packed_layout.py): no bf16 copy of the weights is ever made.

`packed_moe` = sum_k w_k * down_e(silu(gate_e x) * up_e x) over the group's slice of the
intermediate dimension (a model of several groups sums the groups' results), as
`packed_layout.unpack_group` + `routed_mlp.routed_mlp` compute it: bf16 inputs and dequantized
bf16 weights, fp32 accumulation and SiLU, one rounding of the intermediate to bf16. The pairs
are grouped by expert on the GPU (`routing_tiles`) and two Triton kernels run over the tiles:
`moe_gate_up` then `moe_down`. Few rows per expert (decode) take narrow 16-row tiles, many
(prefill) wider ones (`tile_config`); either way no host sync and a grid fixed by T and K, so
decode steps can be captured in a CUDA graph. Few pairs (`path="pairs"`, or T K <=
`DECODE_MAX_PAIRS` under "auto": decode, small batches) skip the grouping: `pair_gate_up` and
`pair_down` take each pair straight from `ids` (two launches instead of ~10 small routing ops
and two kernels), in the launch shape `pair_config_for` picks (kernels/pair_config.py).
`act_quant=True` (int8, fp8; opt-in) runs the sorted tiles on int8 / fp8 tensor cores instead,
activations quantized per (row, group) (`act_quant`).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch

# Kernel modules import Triton: the launching functions import them (this loads without it).
from hetmoe.experts.packed_layout import PackedGroup, padded_hidden
from hetmoe.kernels.act_quant import check_act_quant, sorted_act_quant
from hetmoe.kernels.call_checks import check_call
from hetmoe.kernels.pair_config import PairConfig, pair_config_for

FORMATS = ("bf16", "int8", "int4", "fp8")
"""Packed formats the kernels read."""

GROUPS = (32, 64, 128, 256)
"""Quantization groups of the int and fp8 formats."""


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch settings of the two expert kernels."""

    block_m: int
    """Sorted (token, slot) rows per tile (all of one expert)."""
    block_n_gate_up: int
    """Gate rows (and as many up rows) per gate/up program; divides 64."""
    block_n_down: int
    """Output columns per down program."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software pipeline depth of the k loop."""


# Chosen from a sweep of 7 shapes on an H100 at the Qwen3-30B-A3B layer (int4 and int8,
# docs/benchmarks/gpu_kernels.md): 128-row tiles at 256 rows per expert, 8 warps and 4 stages,
# ran 2.4-2.5x faster than the first 64-row shape.
SMALL_M = TileConfig(block_m=16, block_n_gate_up=32, block_n_down=64, num_warps=4, num_stages=3)
"""Under 16 rows per expert (decode, short prompts): narrow tiles, many programs."""

MEDIUM_M = TileConfig(block_m=64, block_n_gate_up=32, block_n_down=64, num_warps=4,
                      num_stages=4)
"""16 to 128 rows per expert (prompts of hundreds of tokens)."""

LARGE_M = TileConfig(block_m=128, block_n_gate_up=64, block_n_down=64, num_warps=8,
                     num_stages=4)
"""128 rows per expert and more (long prompts): each dequantized weight tile serves 128 rows."""


DECODE_MAX_PAIRS = 64
"""Up to this many (token, slot) pairs `path="auto"` runs the unsorted pair kernels (decode and
batches of up to 8 at top-8). Measured on an H100 at the Qwen3-30B-A3B layer, graph replays
(docs/benchmarks/gpu_kernels.md, round 2): the pairs win or tie the sorted path at 8 and 64
pairs for every format (int8, 8 pairs: 0.049 vs 0.103 ms) and lose at 128 (0.340 vs 0.254)."""

PATHS = ("auto", "sorted", "pairs")
"""`packed_moe` paths: by pair count, grouped by expert, or one pair per program."""


def tile_config(pairs: int, num_experts: int) -> TileConfig:
    """The tile shape for `pairs` (token, slot) pairs over `num_experts` experts."""
    rows = pairs / num_experts
    return SMALL_M if rows < 16 else MEDIUM_M if rows < 128 else LARGE_M


def check_packed(part: PackedGroup, fmt: str, hidden: int, group: int | None) -> None:
    """ValueError naming the field when `part`'s geometry does not fit the format."""
    if fmt not in FORMATS:
        raise ValueError(f"packed_moe: format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt != "bf16" and group not in GROUPS:
        raise ValueError(f"packed_moe: {fmt} needs a group in {GROUPS}, got {group}")
    slice_ = part.end - part.begin
    unit = 64 if fmt == "bf16" else max(64, group or 0)
    if slice_ <= 0 or slice_ % unit:
        raise ValueError(f"packed_moe: the group's slice [{part.begin}, {part.end}) is not a "
                         f"positive multiple of {unit}")
    q = None if fmt == "bf16" else group
    hp, hn = padded_hidden(hidden, q), -(-hidden // 16) * 16
    gate_up, down = _matrix_bytes(fmt, 2 * slice_, hp, q), _matrix_bytes(fmt, hn, slice_, q)
    if part.down_offset < gate_up or part.down_offset + down > part.expert_bytes:
        raise ValueError(f"packed_moe: PackedGroup(down_offset={part.down_offset}, "
                         f"expert_bytes={part.expert_bytes}) does not hold {fmt} experts of "
                         f"hidden {hidden}, slice {slice_}, group {group}")


def _matrix_bytes(fmt: str, n: int, k: int, group: int | None) -> int:
    """Bytes a packed [n, k] matrix needs at least: its blocks (and its fp32 scales)."""
    nb_bytes, scales = matrix_geometry(fmt, n, k, group)
    return scales + 4 * n * (k // group) if scales and group else (n // 16) * nb_bytes


def matrix_geometry(fmt: str, n: int, k: int, group: int | None) -> tuple[int, int]:
    """(bytes of one n-block, byte offset of the fp32 scale array) of a packed [n, k] matrix
    (scale offset 0 for formats without one)."""
    if fmt == "bf16":
        return (k // 32) * 1024, 0
    assert group is not None
    if fmt == "int4":
        run_k = max(64, group)
        run_bytes = (run_k // 64) * 512 + -(-96 * (run_k // group) // 64) * 64
        return (k // run_k) * run_bytes, 0
    nb_bytes = (k // 64) * 1024
    return nb_bytes, -(-(n // 16) * nb_bytes // 64) * 64


def packed_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, packed: torch.Tensor,
               part: PackedGroup, fmt: str, hidden: int, group: int | None,
               path: str = "auto", pair_config: PairConfig | None = None,
               act_quant: bool = False) -> torch.Tensor:
    """x [T, H] (bf16; other floats are rounded to it), ids [T, K] int (an expert's index in
    `packed`, -1 = skip), weights [T, K] -> [T, H] fp32, this group's share of the routed
    output. packed: uint8 on x's GPU, experts back to back (e at e * part.expert_bytes).
    path: one of `PATHS` ("auto": the pair kernels up to `DECODE_MAX_PAIRS` pairs);
    pair_config: the pair kernels' launch shape (None: `pair_config_for(fmt, T)`); act_quant (int8,
    fp8): the sorted path on int8 / fp8 tensor cores, activations quantized (act_quant.py)."""
    if path not in PATHS:
        raise ValueError(f"packed_moe: path {path!r} is not one of {', '.join(PATHS)}")
    check_call(x, ids, weights, packed, part, hidden)
    check_packed(part, fmt, hidden, group)
    if act_quant:
        check_act_quant(fmt, path)
    t, top_k = ids.shape
    if t and top_k and (path == "pairs" or path == "auto" and t * top_k <= DECODE_MAX_PAIRS):
        cfg = pair_config or pair_config_for(fmt, t)
        return _pairs(x, ids, weights, packed, part, fmt, hidden, group, cfg)
    if t == 0 or top_k == 0:
        return torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    if act_quant:
        slice_, hp = part.end - part.begin, padded_hidden(hidden, group)
        geometry = (matrix_geometry(fmt, 2 * slice_, hp, group),
                    matrix_geometry(fmt, -(-hidden // 16) * 16, slice_, group))
        return sorted_act_quant(x, ids, weights, packed, part, fmt, hidden, group,
                                tile_config(t * top_k, packed.numel() // part.expert_bytes),
                                geometry)
    return _sorted(x, ids, weights, packed, part, fmt, hidden, group)


def _sorted(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, packed: torch.Tensor,
            part: PackedGroup, fmt: str, hidden: int, group: int | None) -> torch.Tensor:
    """`packed_moe` by the pairs grouped into expert tiles (`routing_tiles`), T K > 0."""
    from hetmoe.kernels.dequant import FORMAT_CODES, MEMORY_ORDER
    from hetmoe.kernels.moe_down import moe_down_kernel
    from hetmoe.kernels.moe_gate_up import moe_gate_up_kernel
    from hetmoe.kernels.routing_tiles import routing_tiles

    t, top_k = ids.shape
    out = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    q = None if fmt == "bf16" else group
    slice_ = part.end - part.begin
    hp, hn = padded_hidden(hidden, q), -(-hidden // 16) * 16
    num_e = packed.numel() // part.expert_bytes
    cfg = tile_config(t * top_k, num_e)
    mem = MEMORY_ORDER[fmt]
    tiles = routing_tiles(ids, num_e, cfg.block_m)
    xb = x.to(torch.bfloat16).contiguous()
    w = weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(t * top_k, slice_, dtype=torch.bfloat16, device=x.device)
    code, g = FORMAT_CODES[fmt], q or 64
    nb_bytes, scale_off = matrix_geometry(fmt, 2 * slice_, hp, q)
    grid = (slice_ // cfg.block_n_gate_up, tiles.expert.numel())
    moe_gate_up_kernel[grid](
        xb, xb.stride(0), packed, tiles.order, tiles.expert, tiles.row, tiles.end, act,
        hidden, slice_, part.expert_bytes, nb_bytes, scale_off, num_e, TOP_K=top_k,
        K_BLOCKS=hp // 64, G=g, FMT=code, BM=cfg.block_m, BN=cfg.block_n_gate_up,
        MEM=mem, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    nb_bytes, scale_off = matrix_geometry(fmt, hn, slice_, q)
    grid = (-(-hidden // cfg.block_n_down), tiles.expert.numel())
    moe_down_kernel[grid](
        act, packed, tiles.order, w, tiles.expert, tiles.row, tiles.end, out, hidden, slice_,
        hn, part.expert_bytes, part.down_offset, nb_bytes, scale_off, num_e, TOP_K=top_k,
        K_BLOCKS=slice_ // 64, G=g, FMT=code, BM=cfg.block_m, BN=cfg.block_n_down,
        MEM=mem, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, packed: torch.Tensor,
           part: PackedGroup, fmt: str, hidden: int, group: int | None,
           cfg: PairConfig) -> torch.Tensor:
    """`packed_moe` by the pair kernels: two launches, no sort, no fill (x, ids and weights
    read in their own dtypes, out cleared by the gate/up kernel)."""
    from hetmoe.kernels.dequant import FORMAT_CODES, MEMORY_ORDER
    from hetmoe.kernels.pair_down import pair_down_kernel
    from hetmoe.kernels.pair_gate_up import pair_gate_up_kernel
    from hetmoe.kernels.pdl import launch_args

    pairs = ids.numel()
    q = None if fmt == "bf16" else group
    slice_ = part.end - part.begin
    hp, hn = padded_hidden(hidden, q), -(-hidden // 16) * 16
    num_e = packed.numel() // part.expert_bytes
    mem, code, g = MEMORY_ORDER[fmt], FORMAT_CODES[fmt], q or 64
    words = cfg.int4_words and fmt == "int4"
    x = x if x.stride(1) == 1 else x.contiguous()
    pdl = launch_args(x.device)
    flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)  # [T K] views when contiguous
    split_gu, ku_gu = share_steps(hp // 64, cfg.split_gate_up, cfg.k_unroll)
    act = torch.empty((pairs, slice_) if split_gu == 1 else (pairs, split_gu, 2 * slice_),
                      dtype=torch.bfloat16 if split_gu == 1 else torch.float32, device=x.device)
    out = torch.empty(ids.shape[0], hidden, dtype=torch.float32, device=x.device)
    n_gate_up = slice_ // cfg.block_n_gate_up
    zero_cols = 1 << (-(-hidden // n_gate_up) - 1).bit_length()  # pow2 >= H / n_gate_up
    nb_bytes, scale_off = matrix_geometry(fmt, 2 * slice_, hp, q)
    pair_gate_up_kernel[(pairs, n_gate_up, split_gu)](
        x, x.stride(0), flat_ids, packed, act, out, hidden, slice_, part.expert_bytes, nb_bytes,
        scale_off, num_e, TOP_K=ids.shape[1], K_BLOCKS=hp // 64 // split_gu, KU=ku_gu, G=g,
        FMT=code, BN=cfg.block_n_gate_up, ZN=zero_cols, MEM=mem, SPLIT=split_gu,
        SPAN=factored_span(cfg, fmt, g, ku_gu), WORDS=words, num_warps=cfg.warps_gate_up,
        **pdl)
    split_d, ku_d = share_steps(slice_ // 64, cfg.split_down, cfg.k_unroll)
    nb_bytes, scale_off = matrix_geometry(fmt, hn, slice_, q)
    pair_down_kernel[(pairs, -(-hidden // cfg.block_n_down), split_d)](
        act, flat_ids, flat_w, packed, out, hidden, slice_, hn, part.expert_bytes,
        part.down_offset, nb_bytes, scale_off, num_e, TOP_K=ids.shape[1],
        K_BLOCKS=slice_ // 64 // split_d, KU=ku_d, G=g, FMT=code, BN=cfg.block_n_down, MEM=mem,
        SPLIT_GU=split_gu, SPAN=factored_span(cfg, fmt, g, ku_d), WORDS=words,
        num_warps=cfg.warps_down, **pdl)
    return out


def share_steps(blocks: int, split: int, unroll: int) -> tuple[int, int]:
    """(programs, 64-k blocks a loop step) for a pair kernel's loop of `blocks` 64-k blocks:
    the most programs up to `split` that share it equally, then the most blocks up to
    `unroll` that divide a share (no program runs a partial step)."""
    split = max(d for d in range(1, min(split, blocks) + 1) if blocks % d == 0)
    share = blocks // split
    return split, max(u for u in range(1, min(unroll, share) + 1) if share % u == 0)


def factored_span(cfg: PairConfig, fmt: str, group: int, unroll: int) -> int:
    """The pair kernels' SPAN: 0 for bf16 weights (`cfg.factored` off, or bf16), else the
    32-k halves summed before their group's scale is applied: the most that stay in one group
    (group / 32, a power of two) and divide a loop step's 2 `unroll` halves."""
    if not cfg.factored or fmt == "bf16":
        return 0
    return math.gcd(group // 32, 2 * unroll)


def unsupported(device: torch.device, fmt: str) -> str:
    """Why the kernels cannot run `fmt` on `device` ("" if they can): a CUDA GPU of compute
    capability 8.0+ (8.9+ for fp8's hardware conversion) with Triton installed."""
    if device.type != "cuda":
        return f"the packed expert kernels run on CUDA GPUs, not {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "the packed expert kernels need Triton (pip install triton)"
    need = (8, 9) if fmt == "fp8" else (8, 0)
    have = torch.cuda.get_device_capability(device)
    if have < need:
        return (f"the packed expert kernels need compute capability {need[0]}.{need[1]} for "
                f"{fmt}, this GPU has {have[0]}.{have[1]}")
    return ""
