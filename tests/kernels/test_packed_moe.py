"""`kernels.packed_moe` (Triton, on the CPU backend's packed bytes) against float64 references:
the unpacked weights of the same bytes (every format and group, odd sizes padded inside, ids of
-1, duplicate ids, experts with 0 and 1 rows, T from 1 to thousands), the original float weights
within each format's quantization error, a CUDA graph replay, and bad inputs named.

Device tests (`pytest -m device` on a GPU host) cover the real shapes; small shapes of every
format run everywhere, both paths (grouped by expert, one pair per program), on the GPU when
there is one and under Triton's interpreter otherwise (tests/kernels/conftest.py); so do the
argument checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from hetmoe import env
from hetmoe.bench.cuda_graphs import capture
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import PackedGroup, host_tensor, unpack_group
from hetmoe.kernels import packed_moe as kernel
from hetmoe.kernels.packed_moe import check_packed, packed_moe, tile_config, unsupported
from hetmoe.kernels.pair_config import pair_config_for

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HERE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the small-shape tests run the kernels: the GPU, else the CPU under the interpreter."""

# (format, experts, hidden, intermediate, group): odd sizes pad H to 64-k blocks and groups
# and the slice to whole units; every group size of every quantized format.
SHAPES = [
    ("bf16", 7, 200, 136, None), ("bf16", 5, 256, 512, None),
    ("int8", 6, 200, 136, 32), ("int8", 5, 192, 320, 64), ("int8", 4, 256, 384, 128),
    ("int8", 4, 512, 256, 256),
    ("int4", 6, 200, 136, 32), ("int4", 5, 192, 320, 64), ("int4", 4, 256, 384, 128),
    ("int4", 4, 512, 256, 256),
    ("fp8", 6, 200, 136, 32), ("fp8", 5, 192, 320, 64), ("fp8", 4, 256, 384, 128),
    ("fp8", 4, 512, 256, 256),
]


@dataclasses.dataclass
class Layer:
    """One layer's experts packed by the CPU backend, and what its bytes hold in float64."""

    moe: CpuMoE
    part: PackedGroup
    raw: torch.Tensor  # [E * expert_bytes] uint8, a copy of the mapping
    gate_up: torch.Tensor  # [E, 2S, Hp] float64 (unpacked)
    down: torch.Tensor  # [E, Hn, S] float64 (unpacked)
    original: tuple[torch.Tensor, ...]  # gate, up [E, I, H], down [E, H, I] float64


def make_layer(fmt: str, e: int, h: int, i: int, group: int | None, seed: int) -> Layer:
    g = torch.Generator().manual_seed(seed)
    shapes = ((e, i, h), (e, i, h), (e, h, i))
    moe = CpuMoE(e, h, i, fmt, group_size=group)
    if fmt == "fp8":  # codes of magnitude <= 1 (no NaN), block scales over 2^8
        bn, bk = 128, max(128, group or 0)  # a block's columns are whole groups
        codes = [(torch.randint(0, 0x39, s, generator=g, dtype=torch.uint8)
                  | (torch.randint(0, 2, s, generator=g, dtype=torch.uint8) << 7))
                 .view(torch.float8_e4m3fn) for s in shapes]
        scales = [torch.exp2(-8 * torch.rand(e, -(-s[1] // bn), -(-s[2] // bk),
                                             generator=g)) * 4 / s[2] ** 0.5 for s in shapes]
        moe.load(*codes, *scales, fp8_block=(bn, bk))
        original = tuple(
            (c.float() * s.repeat_interleave(bn, 1).repeat_interleave(bk, 2)
             [:, :c.shape[1], :c.shape[2]]).double() for c, s in zip(codes, scales, strict=True))
    else:
        weights = [torch.randn(s, generator=g) / s[2] ** 0.5 for s in shapes]
        moe.load(*weights)
        original = tuple(w.double() for w in weights)
    (part,) = moe.packed_groups()
    raw = host_tensor(part).clone()
    gate_up, down = unpack_group(raw.view(e, part.expert_bytes), part, fmt, h, moe.group_size)
    return Layer(moe, part, raw, gate_up.double(), down.double(), original)


def reference(layer: Layer, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """float64 on the unpacked weights with the kernels' roundings: x and the intermediate in
    bf16 (as routed_mlp and the CPU kernels)."""
    h = x.shape[1]
    s = layer.down.shape[2]
    xb = x.to(torch.bfloat16).double()
    out = torch.zeros(x.shape[0], h, dtype=torch.float64)
    for e in range(layer.gate_up.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        proj = xb[tok] @ layer.gate_up[e, :, :h].T  # [n, 2S]
        act = (F.silu(proj[:, :s]) * proj[:, s:]).to(torch.bfloat16).double()
        y = act @ layer.down[e, :h].T
        out.index_add_(0, tok, y * weights[tok, slot].double()[:, None])
    return out


def exact(layer: Layer) -> Layer:
    """`layer` with its weights unpacked in float64 without the bf16 rounding of scale * q."""
    fmt, (e, size) = layer.moe.weight_format, (layer.gate_up.shape[0], layer.part.expert_bytes)
    gate_up, down = unpack_group(layer.raw.view(e, size), layer.part, fmt, layer.moe.hidden,
                                 layer.moe.group_size, torch.float64)
    return dataclasses.replace(layer, gate_up=gate_up, down=down)


def expected(layer: Layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             path: str) -> torch.Tensor:
    """`reference` for what `path` computes: the pair kernels of a `factored` format
    (`pair_config_for`) multiply the unrounded weights, the other paths bf16-rounded ones."""
    fmt, (t, k) = layer.moe.weight_format, ids.shape
    pairs = path == "pairs" or path == "auto" and t * k <= kernel.DECODE_MAX_PAIRS
    factored = pairs and fmt != "bf16" and pair_config_for(fmt, t).factored
    return reference(exact(layer) if factored else layer, x, ids, weights)


def routing(t: int, k: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [t, k] with duplicates and 15 % of -1, the last expert never picked and expert 0
    exactly once; weights [t, k] in [0, 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, e - 1, (t, k), generator=g)
    ids[torch.rand(t, k, generator=g) < 0.15] = -1
    ids[t // 2, k - 1] = 0
    return ids, torch.rand(t, k, generator=g)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


def edge_case(shape: tuple, t: int) -> tuple[Layer, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The small-shape tests' inputs: a layer of `shape` (format, experts, hidden, intermediate,
    group), x [t, H] and top-2 `routing` with row 1 routed nowhere and row t - 1 sending both
    slots to one expert -> (layer, x, ids, weights)."""
    fmt, e, h, i, group = shape
    layer = make_layer(fmt, e, h, i, group, seed=e + h)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1))
    ids, weights = routing(t, 2, e, seed=2)
    ids[1] = -1  # a row routed nowhere
    ids[t - 1, 0] = ids[t - 1, 1] = e - 2  # one expert in every slot of a row
    return layer, x, ids, weights


@pytest.mark.device
@cuda
@pytest.mark.parametrize("tokens", [1, 37, 700])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_equals_float64_on_the_same_bytes(shape: tuple, tokens: int) -> None:
    fmt, e, h, i, group = shape
    layer = make_layer(fmt, e, h, i, group, seed=tokens + e)
    for k, path in [(1, "auto"), (1, "pairs"), (4, "sorted"), (4, "pairs")]:
        x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(k))
        ids, weights = routing(tokens, k, e, seed=tokens * k)
        out = packed_moe(x.cuda(), ids.cuda(), weights.cuda(), layer.raw.cuda(), layer.part,
                         fmt, h, layer.moe.group_size, path=path)
        assert out.shape == (tokens, h) and out.dtype == torch.float32
        ref = expected(layer, x, ids, weights, path)
        assert rel_error(out, ref) < 2e-3, (k, path, rel_error(out, ref))
        skipped = (ids < 0).all(1)  # rows routed nowhere are exact zeros
        assert not out[skipped.cuda()].any()


@pytest.mark.device
@cuda
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "fp8"])
def test_thousands_of_tokens_on_the_wide_tiles(fmt: str) -> None:
    e, h, i, group = 8, 256, 384, (None if fmt == "bf16" else 128)
    layer = make_layer(fmt, e, h, i, group, seed=9)
    tokens, k = 3000, 4
    assert tile_config(tokens * k, e).block_m > 16
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(3))
    ids, weights = routing(tokens, k, e, seed=4)
    out = packed_moe(x.cuda(), ids.cuda(), weights.cuda(), layer.raw.cuda(), layer.part, fmt,
                     h, layer.moe.group_size)
    assert rel_error(out, reference(layer, x, ids, weights)) < 2e-3


@pytest.mark.device
@cuda
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_within_the_formats_error_of_the_original_weights(fmt: str) -> None:
    """Against the float weights before packing: the format's quantization error only, and
    int4 as close as the CPU backend on the same bytes."""
    e, h, i = 6, 256, 384
    layer = make_layer(fmt, e, h, i, None, seed=11)
    x = torch.randn(300, h, generator=torch.Generator().manual_seed(12))
    ids, weights = routing(300, 4, e, seed=13)
    out = packed_moe(x.cuda(), ids.cuda(), weights.cuda(), layer.raw.cuda(), layer.part, fmt,
                     h, layer.moe.group_size)
    gate, up, down = layer.original
    truth = torch.zeros(300, h, dtype=torch.float64)
    for t in range(300):
        for j in range(4):
            ex = int(ids[t, j])
            if ex >= 0:
                xt = x[t].double()
                act = F.silu(gate[ex] @ xt) * (up[ex] @ xt)
                truth[t] += weights[t, j].double() * (down[ex] @ act)
    cpu = layer.moe.forward(x, ids, weights)
    if fmt == "int4":
        assert rel_error(out, truth) <= 1.05 * rel_error(cpu, truth) + 1e-3
    else:
        assert rel_error(out, truth) < (0.01 if fmt == "bf16" else 0.03)


@pytest.mark.device
@cuda
@pytest.mark.parametrize("path", ["pairs", "sorted"])
def test_a_cuda_graph_replays_new_routing(path: str) -> None:
    """Decode's use: captured once (no host sync inside), replayed on new ids and inputs."""
    layer = make_layer("int4", 6, 256, 384, 64, seed=21)
    raw = layer.raw.cuda()
    x = torch.zeros(4, 256, device="cuda")
    ids = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
    weights = torch.zeros(4, 2, device="cuda")

    def step() -> torch.Tensor:
        return packed_moe(x, ids, weights, raw, layer.part, "int4", 256, 64, path=path)

    for out, new_x, new_ids, new_w in graph_replays(step, x, ids, weights, 6, 3):
        assert rel_error(out, expected(layer, new_x, new_ids, new_w, path)) < 2e-3


def graph_replays(step: Callable[[], torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, experts: int,
                  seeds: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """`step` (reading the static x, ids, weights on the GPU) run once outside a capture (its
    kernels compile), captured once, then per seed new inputs (x random, `routing` over
    `experts`) copied in and the graph replayed -> yields (out, x, ids, weights) on the CPU
    side."""
    graph, out = capture(step)
    (t, h), k = x.shape, ids.shape[1]
    for seed in range(seeds):
        new_x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed))
        new_ids, new_w = routing(t, k, experts, seed=seed)
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_w)
        graph.replay()
        yield out, new_x, new_ids, new_w


# Small shapes for the interpreter (about a second a call): every format, each int group
# layout (int4 runs of 64 k and of one group), hidden sizes padded inside, a loop of 4 blocks a
# step (bf16: 256 padded columns).
SMALL = [("bf16", 4, 200, 64, None), ("int8", 4, 100, 64, 32), ("int4", 4, 72, 64, 32),
         ("int4", 3, 128, 128, 128), ("fp8", 4, 100, 128, 128)]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "-".join(map(str, s)))
def test_small_shapes_equal_float64_on_both_paths(shape: tuple) -> None:
    fmt, _, h, _, _ = shape
    layer, x, ids, weights = edge_case(shape, 4)
    for path in ("sorted", "pairs"):
        out = packed_moe(x.to(HERE), ids.to(HERE), weights.to(HERE), layer.raw.to(HERE),
                         layer.part, fmt, h, layer.moe.group_size, path=path)
        assert out.shape == (4, h) and out.dtype == torch.float32
        ref = expected(layer, x, ids, weights, path)
        assert rel_error(out, ref) < 2e-3, (path, rel_error(out, ref))
        assert torch.equal(out[1].cpu(), torch.zeros(h))  # cleared, nothing added


@pytest.mark.usefixtures("interpreted")
def test_the_pair_path_reads_any_dtype_and_marks_an_id_past_the_experts() -> None:
    """float64 x, bf16 weights and int32 ids read as they are (x rounded as torch rounds it);
    an id >= E turns its token's row to NaN (no host sync to raise from), the others stay."""
    layer = make_layer("int8", 4, 64, 64, 64, seed=5)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    ids, weights = routing(3, 2, 4, seed=7)
    ids[2, 1] = 4
    out = packed_moe(x.double().to(HERE), ids.int().to(HERE), weights.bfloat16().to(HERE),
                     layer.raw.to(HERE), layer.part, "int8", 64, 64, path="pairs").cpu()
    assert out[2].isnan().all()
    ids[2, 1] = -1
    ref = expected(layer, x, ids, weights.bfloat16().double(), "pairs")
    assert rel_error(out[:2], ref[:2]) < 2e-3


@pytest.mark.parametrize(("limit", "tokens", "k", "want"), [
    (0, 1, 8, "sorted"), (64, 1, 8, "pairs"), (64, 8, 8, "pairs"), (64, 9, 8, "sorted"),
    (64, 100, 1, "sorted")])
def test_auto_takes_the_pair_kernels_up_to_the_threshold(monkeypatch: pytest.MonkeyPatch,
                                                         limit: int, tokens: int, k: int,
                                                         want: str) -> None:
    monkeypatch.setattr(kernel, "DECODE_MAX_PAIRS", limit)
    taken: list[str] = []
    for name in ("pairs", "sorted"):
        monkeypatch.setattr(kernel, f"_{name}", lambda *a, name=name: taken.append(name))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ids = torch.zeros(tokens, k, dtype=torch.int64)
    packed_moe(torch.zeros(tokens, 64), ids, torch.zeros(tokens, k),
               torch.zeros(40960, dtype=torch.uint8), GROUP, "int8", 64, 64)
    assert taken == [want]


def test_auto_takes_the_pairs_up_to_the_measured_64() -> None:
    assert kernel.DECODE_MAX_PAIRS == 64


GROUP = PackedGroup(address=0, bytes=40960, expert_bytes=20480, down_offset=12288, begin=0,
                    end=64)  # CpuMoE(2, 64, 64, "int8", group_size=64)'s


@pytest.mark.parametrize(("fmt", "group", "part", "message"), [
    ("fp4", 32, GROUP, "format 'fp4' is not one of bf16, int8, int4, fp8"),
    ("int8", 48, GROUP, r"int8 needs a group in \(32, 64, 128, 256\), got 48"),
    ("int4", None, GROUP, r"int4 needs a group in"),
    ("int8", 128, GROUP, r"slice \[0, 64\) is not a positive multiple of 128"),
    ("int8", 64, dataclasses.replace(GROUP, down_offset=100), "down_offset=100"),
    ("int8", 64, dataclasses.replace(GROUP, expert_bytes=13000), "expert_bytes=13000"),
])
def test_bad_packed_geometry_is_named(fmt: str, group: int | None, part: PackedGroup,
                                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_packed(part, fmt, 64, group)


def test_the_geometry_of_real_packed_layers_passes() -> None:
    for fmt, e, h, i, group in SHAPES:
        moe = CpuMoE(e, h, i, fmt, group_size=group)
        (part,) = moe.packed_groups()
        check_packed(part, fmt, h, moe.group_size)


@pytest.mark.parametrize(("change", "message"), [
    ({"x": torch.zeros(3, 65)}, r"x must be a float \[T, 64\] tensor, got torch.float32 \[3, 65\]"),
    ({"ids": torch.zeros(3, 2)}, r"ids must be an integer \[3, K\] tensor"),
    ({"weights": torch.zeros(3, 3)}, r"weights must be \[3, 2\] like ids, got \[3, 3\]"),
    ({"packed": torch.zeros(100, dtype=torch.uint8)}, "not a whole number of experts"),
    ({"packed": torch.zeros(20480)}, "packed must be a contiguous 1-D uint8 tensor"),
    ({}, r"must be on one CUDA device, got cpu"),
    ({"x": torch.zeros(3, 64, device="meta")}, r"must be on one CUDA device, got cpu, meta"),
])
def test_bad_call_arguments_are_named(monkeypatch: pytest.MonkeyPatch, change: dict,
                                      message: str) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors only under it
    args = {"x": torch.zeros(3, 64), "ids": torch.zeros(3, 2, dtype=torch.int64),
            "weights": torch.zeros(3, 2), "packed": torch.zeros(20480, dtype=torch.uint8)}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        packed_moe(args["x"], args["ids"], args["weights"], args["packed"], GROUP, "int8", 64,
                   64)


def test_a_bad_path_is_named() -> None:
    with pytest.raises(ValueError, match="path 'fast' is not one of auto, sorted, pairs"):
        packed_moe(torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2),
                   torch.zeros(40960, dtype=torch.uint8), GROUP, "int8", 64, 64, path="fast")


def test_the_kernels_name_why_they_cannot_run_here() -> None:
    assert unsupported(torch.device("cpu"), "int4") == (
        "the packed expert kernels run on CUDA GPUs, not cpu")


@pytest.mark.parametrize(("value", "want"), [(None, "packed"), ("unpack", "unpack"),
                                             ("packed", "packed")])
def test_the_gpu_expert_path_setting(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                     want: str) -> None:
    if value is None:
        monkeypatch.delenv("HETMOE_GPU_EXPERTS", raising=False)
    else:
        monkeypatch.setenv("HETMOE_GPU_EXPERTS", value)
    assert env.gpu_expert_kernel() == want


def test_a_bad_gpu_expert_path_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMOE_GPU_EXPERTS", "fast")
    with pytest.raises(ValueError, match="HETMOE_GPU_EXPERTS must be packed or unpack, got 'fast'"):
        env.gpu_expert_kernel()
