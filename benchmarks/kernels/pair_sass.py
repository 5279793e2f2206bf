"""The pair kernels' k loop counted in sm_90 SASS, on any machine (Triton's bundled ptxas and
nvdisasm; no GPU): per launch shape and kernel, instructions per thread a weight, loads a
weight, conversions (I2F, I2FP, F2F, F2FP, HADD2) a weight, registers and local memory (spills),
at one layer's shape (default Qwen3-30B-A3B: Hp 2048, S 768, top-8), arguments 16-divisible as
the launches at that shape specialize, beside each kernel's loop steps a program (each step waits
for its loads: Triton does not pipeline a loop without a dot) and programs at `--pairs` pairs.
The loop is the longest backward branch's body. `--x-dtype fp32` compiles gate/up for the fp32
x the decode step passes (the fp32 view of its staged inputs, ops/fused.py `unpack_moe_inputs`).

    python benchmarks/kernels/pair_sass.py --format int4 --group 32 \
        --shapes 32,1,64,1,4,4,4 32,1,64,1,4,4,4,1 32,1,64,1,4,4,4,1,1
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hetmoe.kernels import dequant
from hetmoe.kernels import packed_moe as pm
from hetmoe.kernels.pair_config import PairConfig, parse_pair_config
from hetmoe.kernels.pair_down import pair_down_kernel
from hetmoe.kernels.pair_gate_up import pair_gate_up_kernel

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTERS = {"x_ptr": "*bf16", "ids_ptr": "*i64", "packed_ptr": "*u8", "out_ptr": "*fp32",
            "weights_ptr": "*fp32"}
CONVERSIONS = ("I2F", "I2FP", "F2F", "F2FP", "HADD2")


def compile_sm90(fn: Any, warps: int, act: str, x: str = "bf16", **consts: object) -> bytes:
    """`fn` compiled for sm_90 with every pointer and int argument 16-divisible, act and x
    pointing to `act` and `x` -> cubin."""
    consts = {k: v for k, v in consts.items() if k in {p.name for p in fn.params}}
    pointers = {**POINTERS, "act_ptr": "*" + act, "x_ptr": "*" + x}
    sig = {p.name: "constexpr" if p.name in consts else pointers.get(p.name, "i32")
           for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name] != "constexpr"}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps}).asm["cubin"]


def loop_counts(cubin: bytes, path: Path) -> dict[str, Any]:
    """Opcode counts of the k loop (the longest body ending in a backward branch), registers
    and local bytes of `cubin` (written to `path` for the tools)."""
    path.write_bytes(cubin)
    sass = subprocess.run([BIN / "nvdisasm", "-c", path], capture_output=True, text=True,
                          check=True).stdout
    labels: dict[str, int] = {}
    ops: list[str] = []
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            ops.append(m.group(1))
    body: list[str] = []
    for i, op in enumerate(ops):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", op)
        if m and labels.get(m.group(1), i + 1) <= i and i + 1 - labels[m.group(1)] > len(body):
            body = ops[labels[m.group(1)]:i + 1]
    names = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for op in body)
    res = subprocess.run([BIN / "cuobjdump", "-res-usage", path], capture_output=True,
                         text=True, check=True).stdout
    usage = {m.group(1): int(m.group(2)) for m in re.finditer(r"(REG|LOCAL):(\d+)", res)}
    return {"ops": names, "instructions": len(body), "regs": usage["REG"],
            "local": usage["LOCAL"]}


def count_shape(cfg: PairConfig, fmt: str, group: int, hidden: int, inter: int,
                top_k: int, out: Path, pairs: int = 8, x: str = "bf16") -> list[str]:
    """Table rows (gate/up, down) of one launch shape."""
    code, mem, g = dequant.FORMAT_CODES[fmt], dequant.MEMORY_ORDER[fmt], group
    words = cfg.int4_words and fmt == "int4"
    split, ku = pm.share_steps(hidden // 64, cfg.split_gate_up, cfg.k_unroll)
    act = "bf16" if split == 1 else "fp32"
    gate_up = compile_sm90(pair_gate_up_kernel, cfg.warps_gate_up, act, x, TOP_K=top_k, KU=ku,
                           G=g, FMT=code, BN=cfg.block_n_gate_up, ZN=128, MEM=mem, SPLIT=split,
                           SPAN=pm.factored_span(cfg, fmt, g, ku), WORDS=words)
    split_d, ku_d = pm.share_steps(inter // 64, cfg.split_down, cfg.k_unroll)
    down = compile_sm90(pair_down_kernel, cfg.warps_down, act, TOP_K=top_k, KU=ku_d, G=g,
                        FMT=code, BN=cfg.block_n_down, MEM=mem, SPLIT_GU=split,
                        SPAN=pm.factored_span(cfg, fmt, g, ku_d), WORDS=words)
    # (loop steps a program, programs) of each launch, as packed_moe._pairs grids them
    launches = {"gate/up": (hidden // 64 // split // ku,
                            pairs * (inter // cfg.block_n_gate_up) * split),
                "down": (inter // 64 // split_d // ku_d,
                         pairs * -(-hidden // cfg.block_n_down) * split_d)}
    rows = []
    # weights a thread a loop step: KU blocks of 64 k, BN rows (gate/up: two matrices)
    for name, cubin, weights in (
            ("gate/up", gate_up, ku * 64 * cfg.block_n_gate_up * 2 / (32 * cfg.warps_gate_up)),
            ("down", down, ku_d * 64 * cfg.block_n_down / (32 * cfg.warps_down))):
        c = loop_counts(cubin, out / f"{name.replace('/', '_')}.cubin")
        loads = sum(v for k, v in c["ops"].items() if k.startswith(("LDG", "LD.")))
        conv = sum(v for k, v in c["ops"].items() if k.split(".")[0] in CONVERSIONS)
        top = ", ".join(f"{k} {v}" for k, v in c["ops"].most_common(6))
        steps, programs = launches[name]
        rows.append(f"| {name} | {fmt} {g} | {tuple(vars(cfg).values())} | {steps} | "
                    f"{programs} | {c['instructions'] / weights:.2f} | {loads / weights:.3f} | "
                    f"{conv / weights:.2f} | {c['regs']} | {c['local']} | {top} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="int4", choices=[f for f in pm.FORMATS])
    parser.add_argument("--group", type=int, default=32, choices=pm.GROUPS)
    parser.add_argument("--hidden", type=int, default=2048, help="Hp, a multiple of 64")
    parser.add_argument("--intermediate", type=int, default=768, help="the slice S")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=8, help="(token, slot) pairs of the "
                        "programs column (8: one token at top-8, decode)")
    parser.add_argument("--x-dtype", default="bf16", choices=("bf16", "fp32"),
                        help="x's dtype in gate/up (fp32: as the decode step passes it)")
    parser.add_argument("--shapes", nargs="+", default=["32,1,64,1,4,4,4"],
                        help="PairConfig fields, comma-separated (bools as 0/1)")
    args = parser.parse_args()
    if dequant.INTERPRETED:
        raise SystemExit("pair_sass: unset TRITON_INTERPRET (it counts compiled kernels)")
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "pair_sass"
    out.mkdir(exist_ok=True)
    print("| kernel | format, group | shape | loop steps | programs | instr / weight | "
          "loads / weight | conversions / weight | regs | local bytes | top opcodes |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for text in args.shapes:
        cfg = parse_pair_config(text)
        for row in count_shape(cfg, args.format, args.group, args.hidden, args.intermediate,
                               args.top_k, out, args.pairs, args.x_dtype):
            print(row, flush=True)


if __name__ == "__main__":
    main()
