"""The GQA decode op (kernels/gqa_decode.py) as torch.compile traces it inside the fused decode
step, on any machine: Dynamo, then AOTAutograd, which keeps the custom op as one node (its fake
implementation gives the output's shape; nothing is launched). The window's chunk count must stay
one dynamic dimension, as engine/executor/fused_decode.py's `_window` marks it: every window
bucket shares one compiled graph. (When the op was a triton_op, AOTAutograd traced its kernels and
the [B, h, S, D] partials' layout check specialized S = 1 at 2 chunks: a bucket of 2 chunks
compiled a graph of its own, the graph device check's `graph_buckets_no_compile`.)

Runs in a process without TRITON_INTERPRET (hopper_compile.py), as on a GPU."""

from __future__ import annotations

from hopper_compile import assert_compiles_for_hopper

SCRIPT = """
import torch
import triton
from triton.backends.compiler import GPUTarget


class Hopper:
    '''The driver the TTIR analysis asks for its target (no GPU here).'''

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from hetmoe.kernels.gqa_decode import gqa_decode_attention


class Traced(Exception):
    '''Raised where the compiled step would launch: tracing is all this checks.'''


def not_launched(gm, example_inputs):
    def run(*args):
        raise Traced
    return run


def attention(qkv, cache, slots, lo, pos, mask, cos, sin, norm):
    # as make_gqa_layer calls it: q, k, v views of the projected row, heads of 16
    b = qkv.shape[0]
    q, k, v = (t.view(b, -1, 16) for t in qkv.split([64, 32, 32], dim=-1))
    return gqa_decode_attention(q, k, v, cache, slots, lo, pos, mask.shape[1], 0.25, norm, norm,
                                1e-6, cos, sin)


step = torch.compile(attention, fullgraph=True, dynamic=False,
                     backend=aot_autograd(fw_compiler=not_launched))
cache = torch.zeros(4, 320, 2, 2, 16)
rows = torch.zeros(1, dtype=torch.int64)
compiles = []
for chunks in (5, 2, 4, 3, 2):  # a 300-entry window, then buckets of 128, 256, 192, 128
    mask = torch.zeros(1, chunks, 64, dtype=torch.bool)
    torch._dynamo.mark_dynamic(mask, 1)
    before = counters["stats"]["unique_graphs"]
    try:
        step(torch.randn(1, 128), cache, rows, rows, rows, mask, torch.ones(1, 16),
             torch.ones(1, 16), torch.ones(16))
    except Traced:
        pass
    compiles.append(counters["stats"]["unique_graphs"] - before)
assert compiles == [1, 0, 0, 0, 0], f"graphs compiled per window: {compiles}"
print("compiled")
"""


def test_every_window_bucket_shares_one_traced_graph() -> None:
    assert_compiles_for_hopper(SCRIPT)
