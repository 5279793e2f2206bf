"""The Triton kernels compile for a Hopper GPU (sm_90) on any machine, in a process without the
interpreter (hopper_compile.py): the compiled branches the interpreted tests here skip (the pair
kernels, every launch shape: test_pair_kernels.py)."""

from __future__ import annotations

from hopper_compile import assert_compiles_for_hopper

SCRIPT = """
import triton
from hopper_compile import compile_for_hopper

from hetmoe.kernels import gqa_decode as gqa, moe_router as mr, packed_moe as pm
from hetmoe.kernels.moe_down import moe_down_kernel
from hetmoe.kernels.moe_gate_up import moe_gate_up_kernel

POINTERS = {"x_ptr": "*bf16", "act_ptr": "*bf16", "ids_ptr": "*i64", "packed_ptr": "*u8",
            "out_ptr": "*fp32", "weights_ptr": "*fp32"}


def build(fn, cfg, **consts):
    types = {p.name: POINTERS.get(p.name, "*i32" if p.name.endswith("_ptr") else "i32")
             for p in fn.params}
    compile_for_hopper(fn, types, options={"num_warps": cfg.num_warps,
                                          "num_stages": cfg.num_stages}, **consts)


for cfg in (pm.SMALL_M, pm.LARGE_M):
    build(moe_gate_up_kernel, cfg, TOP_K=8, G=32, FMT=2, BM=cfg.block_m,
          BN=cfg.block_n_gate_up, MEM=False)
    build(moe_down_kernel, cfg, TOP_K=8, G=32, FMT=2, BM=cfg.block_m, BN=cfg.block_n_down,
          MEM=False)
for dtype, d, group, prologue in (("bf16", 128, 8, True), ("fp16", 80, 3, False),
                                  ("fp32", 16, 2, True)):
    dims = dict(D=d, BLOCK_D=max(16, triton.next_power_of_2(d)))
    sig = dict.fromkeys(("q_ptr", "k_new_ptr", "v_new_ptr", "cache_ptr", "q_norm_ptr",
                         "k_norm_ptr", "cos_ptr", "sin_ptr"), "*" + dtype)
    sig.update(slots_ptr="*i64", lo_ptr="*i64", pos_ptr="*i64", part_ptr="*fp32",
               stat_ptr="*fp32", s_slot="i64", scale="fp32", eps="fp32")
    sig.update(dict.fromkeys(("s_q", "s_k", "s_v", "s_cos", "s_key", "s_kv", "s_head"), "i32"))
    compile_for_hopper(gqa.split_kernel, sig, H_KV=4, G=group, BLOCK_G=16, NORM=prologue,
                       ROPE=prologue, IEEE=dtype == "fp32", **dims)
    compile_for_hopper(gqa.combine_kernel, {"part_ptr": "*fp32", "stat_ptr": "*fp32",
                                            "out_ptr": "*" + dtype, "splits": "i32"},
                       BLOCK_S=16, **dims)
for dtype, sigmoid in (("bf16", False), ("fp32", True)):
    sig = dict.fromkeys(("h_ptr", "o_ptr", "norm_ptr", "router_ptr", "h_out_ptr", "x_out_ptr"),
                        "*" + dtype)
    sig.update(stage_ptr="*i32", logits_ptr="*fp32", H="i32", E="i32", eps="fp32")
    compile_for_hopper(mr.logits_kernel, sig, BLOCK_E=8, BLOCK_H=1024, LOGITS_FP32=sigmoid)
    sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "x_ptr": "*" + dtype, "stage_ptr": "*i32",
           "B": "i32", "H": "i32", "E": "i32", "scaling": "fp32"}
    compile_for_hopper(mr.topk_kernel, sig, K=8, BLOCK_E=128, BLOCK_K=8, SIGMOID=sigmoid,
                       BIAS=sigmoid, NORM=True, ROUND_WEIGHTS=not sigmoid)
    sig = dict.fromkeys(("h_ptr", "o_ptr", "norm_ptr", "router_ptr", "h_out_ptr", "x_out_ptr"),
                        "*" + dtype)
    sig.update(bias_ptr="*fp32", stage_ptr="*i32", logits_ptr="*fp32", tickets_ptr="*i32",
               B="i32", H="i32", E="i32", eps="fp32", scaling="fp32")
    ptx = compile_for_hopper(mr.router_kernel, sig, BLOCK_E=8, BLOCK_H=1024,
                             LOGITS_FP32=sigmoid, K=8, ALL_E=128, BLOCK_K=8, SIGMOID=sigmoid,
                             BIAS=sigmoid, NORM=True, ROUND_WEIGHTS=not sigmoid).asm["ptx"]
    # the ticket: an acq_rel add at gpu scope after a barrier; the logits read past L1
    assert "atom.global.gpu.acq_rel.add" in ptx and "bar.sync" in ptx, ptx[-3000:]
    assert "ld.global.cg" in ptx, ptx[-3000:]
print("compiled")
"""


def test_the_kernels_compile_for_hopper() -> None:
    assert_compiles_for_hopper(SCRIPT)
