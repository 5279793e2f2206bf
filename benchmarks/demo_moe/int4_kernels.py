"""What the AMX int4 kernel on int8 tiles costs against the bf16-tile one, on real hidden states:
`demo-moe`'s MoE inputs over the held-out text.

The int8-tile kernel (csrc/kernels/amx_int4_i8.cpp, HETMOE_AMX_INT4=i8) requantizes each
activation row to symmetric int8 with one scale over all of K, where the bf16-tile kernel
(amx_int4.cpp, HETMOE_AMX_INT4=bf16) keeps activations in bf16; real hidden states have outlier
channels, which stretch that one scale. Per configuration of the CPU experts (`ROWS`: int4 on AMX
under each kernel with every call on tiles, int4 on AVX-512, int8 and bf16 for reference,
on AVX-512):
- layer level: every MoE layer's inputs (x, router picks and weights) over the held-out windows,
  recorded once with torch experts in fp32, through that layer's `CpuMoE`; the relative error
  against float64 on the weights the layer holds, dequantized (the kernel's own error), and on
  the unquantized ones (the format's total error);
- model level: held-out perplexity (each window one prefill) and its mean KL against torch fp32
  experts; greedy replies to all of demo_moe_eval.QUESTIONS: how many are right and how many
  equal the fp32 model's.
HETMOE_AMX_INT4 is read once per process, so the script runs itself once per value, setting it
(rows that make no int4 AMX call run under "bf16", which they never read). AMX rows need an AMX
CPU or the emulated-AMX build (the same kernels in integer math, bit-exact, slower). Writes JSON
and the doc's table between its markers.

Usage: python benchmarks/demo_moe/int4_kernels.py [--windows 6] [--window 256]
           [--max-new-tokens 16] [--rows int4-amx-i8,int4-amx-bf16,int4-avx512,int8,bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from demo_moe_eval import (
    QUESTIONS,
    answered_right,
    held_out_windows,
    perplexity,
    stamp,
    stamp_line,
    write_marked,
)
from quality import ask, attached, load

from hetmoe import LLM
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.experts.cpu_moe import AMX_MIN_TOKENS, CpuMoE
from hetmoe.experts.packed_layout import host_tensor, unpack_group
from hetmoe.inject.rules import shipped_rules_path
from hetmoe.ops.moe import moe_layers
from hetmoe.presets import resolve_model

SCRIPT = "benchmarks/demo_moe/int4_kernels.py"
NEVER = 1 << 30
"""amx_min_tokens that no call reaches: the AVX-512 kernels only."""
Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""float64 gate, up [E, I, H] and down [E, H, I] of a layer (or of one NUMA group's slice)."""
Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One MoE call's x [T, H] fp32, expert ids [T, K] and weights [T, K]."""


@dataclass(frozen=True)
class Row:
    """One configuration of the CPU experts the tables compare."""

    weight_format: str
    """CpuMoE weight format."""
    amx: bool
    """True: every call on AMX tiles (amx_min_tokens 1, decode included); False: none
    (AVX-512 kernels)."""
    kernel: str
    """HETMOE_AMX_INT4 of the row's process (only int4 calls on AMX read it)."""


ROWS = {"int4-amx-i8": Row("int4", True, "i8"), "int4-amx-bf16": Row("int4", True, "bf16"),
        "int4-avx512": Row("int4", False, "bf16"), "int8": Row("int8", False, "bf16"),
        "bf16": Row("bf16", False, "bf16")}
"""The references run AVX-512: int8 there gives the same floats as on AMX (the int formats'
tests check it bit for bit), bf16 the same products summed in another order; the emulated AMX
build would only make them slower."""


@dataclass
class Reference:
    """Torch fp32 experts on the held-out windows: what every row is measured against."""

    windows: list[list[int]]
    num_experts: int
    calls: list[list[Call]]
    """Per MoE layer, its call of each window."""
    exact: list[torch.Tensor]
    """Per MoE layer, float64 [N, H]: its calls on the unquantized weights, joined."""
    logp: list[torch.Tensor]
    """Per window, log-probs [T, V] (fp16)."""
    ppl: float
    replies: list[str]


def moe64(call: Call, weights: Weights) -> torch.Tensor:
    """float64 [T, H]: sum_j w_j * down_e(silu(gate_e x) * up_e x) over the call's picks."""
    x, ids, w = call
    x64, (gate, up, down) = x.double(), weights
    out = torch.zeros_like(x64)
    for e in range(gate.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            xe = x64[tok]  # [n, H]
            h = F.silu(xe @ gate[e].T) * (xe @ up[e].T)  # [n, I]
            out.index_add_(0, tok, (h @ down[e].T) * w[tok, slot].double()[:, None])
    return out


def held_weights(moe: CpuMoE) -> list[Weights]:
    """Per NUMA group, the weights the layer computes with, exactly (float64): its packed bytes
    read back, over the group's slice of the (padded) intermediate dimension."""
    groups = []
    for part in moe.packed_groups():
        raw = host_tensor(part).view(-1, part.expert_bytes)  # [E, expert bytes]
        gate_up, down = unpack_group(raw, part, moe.weight_format, moe.hidden, moe.group_size,
                                     torch.float64)
        s, h = part.end - part.begin, moe.hidden
        groups.append((gate_up[:, :s, :h], gate_up[:, s:, :h], down[:, :h]))
    return groups


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def window_logits(runner: ModelRunner) -> Callable[[list[int]], torch.Tensor]:
    """Logits [T, V] of a window prefilled alone in slot 0 (one MoE call per layer)."""
    def logits_of(ids: list[int]) -> torch.Tensor:
        runner.lengths[0] = 0
        return runner.prefill_logits(0, ids)
    return logits_of


@torch.inference_mode()
def reference(args: argparse.Namespace, log: Callable[[str], None]) -> Reference:
    """Records every MoE layer's calls with torch fp32 experts (one prefill per window), the
    exact log-probs and perplexity, and the fp32 model's replies to QUESTIONS."""
    llm, runner = load("demo-moe", args.window)
    windows = held_out_windows(llm.encode, args.window, args.windows)
    layers = moe_layers(llm.model)
    calls: list[list[Call]] = [[] for _ in layers]
    logp: list[torch.Tensor] = []

    def keep(i: int) -> Callable[..., None]:
        def hook(_module: Any, inputs: tuple[torch.Tensor], out: tuple[torch.Tensor, ...]) -> None:
            calls[i].append((inputs[0].float().clone(), out[0].clone(), out[1].float().clone()))
        return hook

    hooks = [m.gate.register_forward_hook(keep(i)) for i, m in enumerate(layers)]
    try:
        ppl = perplexity(window_logits(runner), windows, lambda w, lp: logp.append(lp.half()))
    finally:
        for hook in hooks:
            hook.remove()
    with attached(llm, "defer", 0) as step:
        _, replies = ask(llm, runner, step, list(range(len(QUESTIONS))), args.max_new_tokens)
    weights = [(m.experts.gate.double(), m.experts.up.double(), m.experts.down.double())
               for m in layers]
    exact = [torch.cat([moe64(c, w) for c in layer]) for layer, w in zip(calls, weights,
                                                                         strict=True)]
    log(f"torch fp32: ppl {ppl:.4f}, {len(windows)} windows, {len(layers)} MoE layers recorded")
    return Reference(windows, len(layers[0].experts.gate), calls, exact, logp, ppl, replies)


def load_cpu(row: Row, window: int, rules_dir: Path) -> tuple[LLM, ModelRunner]:
    """`demo-moe` in fp32 with every routed expert on the CPU backend in the row's format and
    AMX use; AMX rows refuse a machine whose layers cannot run it."""
    needle = "kwargs: {experts: auto}"
    shipped = shipped_rules_path("mixtral").read_text()
    if needle not in shipped:
        raise ValueError(f"{shipped_rules_path('mixtral')} no longer holds {needle!r}: the "
                         "script cannot pick the experts' format there")
    rules = rules_dir / f"mixtral_{row.weight_format}.yaml"
    rules.write_text(shipped.replace(
        needle, f"kwargs: {{experts: cpu, weight_format: {row.weight_format}}}"))
    llm = LLM(resolve_model("demo-moe"), device="cpu", dtype="float32", rules=rules,
              progress=False, max_seq_len=window)
    for moe in moe_layers(llm.model):
        cpu: CpuMoE = moe.experts.moe
        if row.amx and cpu.isa != "amx":
            raise ValueError(f"row {row} needs AMX: this build runs {cpu.isa!r} at most (use an "
                             "AMX CPU or the emulated-AMX build)")
        cpu.amx_min_tokens = 1 if row.amx else NEVER
    return llm, ModelRunner(llm.model, llm.device, llm.dtype, len(QUESTIONS), window)


@torch.inference_mode()
def layer_errors(llm: LLM, ref: Reference, row: Row) -> list[dict[str, float]]:
    """Per MoE layer, the relative error of its CpuMoE on the recorded calls against float64
    on its own dequantized weights ("kernel") and on the unquantized ones ("total")."""
    errors = []
    for i, (moe, calls) in enumerate(zip(moe_layers(llm.model), ref.calls, strict=True)):
        cpu: CpuMoE = moe.experts.moe
        if i == 0 and row.amx:
            check_amx_runs(cpu, calls[0])
        held = held_weights(cpu)
        got = torch.cat([cpu.forward(*c).double() for c in calls])  # [N, H]
        own = torch.cat([torch.stack([moe64(c, g) for g in held]).sum(0) for c in calls])
        errors.append({"kernel": rel_error(got, own), "total": rel_error(got, ref.exact[i])})
    return errors


def check_amx_runs(cpu: CpuMoE, call: Call) -> None:
    """An AMX row's kernel differs from AVX-512 in its rounding: equal outputs on one call would
    mean the tiles never ran."""
    on_tiles = cpu.forward(*call)
    cpu.amx_min_tokens = NEVER
    off = cpu.forward(*call)
    cpu.amx_min_tokens = 1
    if torch.equal(on_tiles, off):
        raise RuntimeError("amx_min_tokens 1 and AVX-512 gave the same output: AMX did not run")


@torch.inference_mode()
def model_level(llm: LLM, runner: ModelRunner, ref: Reference, max_new: int) -> dict[str, Any]:
    """Perplexity and mean KL(fp32 || row) over the windows; replies right and equal to fp32."""
    kl, count = 0.0, 0

    def against_exact(w: int, logp: torch.Tensor) -> None:
        nonlocal kl, count
        exact = ref.logp[w].float()
        kl += (exact.exp() * (exact - logp)).sum(-1)[:-1].sum().item()
        count += logp.shape[0] - 1

    ppl = perplexity(window_logits(runner), ref.windows, against_exact)
    with attached(llm, "defer", 0) as step:
        em, replies = ask(llm, runner, step, list(range(len(QUESTIONS))), max_new)
    same = sum(a == b for a, b in zip(replies, ref.replies, strict=True))
    return {"ppl": ppl, "kl": kl / count, "right": round(em * len(QUESTIONS)), "same": same,
            "replies": replies}


def tokens_per_expert(ref: Reference) -> dict[str, float]:
    """Over every (window, layer, expert): the fewest tokens routed to it, and the share that
    reach int4's AMX crossover (what the engine would run on tiles)."""
    counts = torch.cat([torch.bincount(ids.flatten(), minlength=ref.num_experts)
                        for layer in ref.calls for _, ids, _ in layer])
    return {"min": int(counts.min()), "mean": float(counts.double().mean()),
            "share_at_crossover": float((counts >= AMX_MIN_TOKENS["int4"]).double().mean())}


def measure_part(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """This process's rows, all of one HETMOE_AMX_INT4 value (checked against the build's)."""
    from hetmoe import _cpu

    kernel = _cpu.amx_int4_kernel()
    wrong = [n for n in args.rows if ROWS[n].kernel != kernel]
    if wrong:
        raise ValueError(f"rows {wrong} need another HETMOE_AMX_INT4 than this process's "
                         f"{kernel!r} (run without --part-out: it sets it per row)")
    ref = reference(args, log)
    part: dict[str, Any] = {"kernel": kernel, "amx_emulation": bool(_cpu.AMX_EMULATION),
                            "exact_ppl": ref.ppl, "exact_replies": ref.replies,
                            "exact_right": len(answered_right(range(len(QUESTIONS)),
                                                              ref.replies)),
                            "tokens_per_expert": tokens_per_expert(ref), "rows": {}}
    with tempfile.TemporaryDirectory() as rules_dir:
        for name in args.rows:
            start = time.perf_counter()
            llm, runner = load_cpu(ROWS[name], args.window, Path(rules_dir))
            layers = layer_errors(llm, ref, ROWS[name])
            model = model_level(llm, runner, ref, args.max_new_tokens)
            part["rows"][name] = {"layers": layers, **model, "kernel": kernel,
                                  "seconds": round(time.perf_counter() - start)}
            log(f"{name}: kernel error mean {mean(layers, 'kernel'):.4f}, total "
                f"{mean(layers, 'total'):.4f}; ppl {model['ppl']:.4f}, KL {model['kl']:.4f}, "
                f"{model['right']} right, {model['same']} as fp32")
            del llm, runner
    return part


def run_parts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs this script once per HETMOE_AMX_INT4 value the rows need, with it set."""
    parts = []
    for kernel in dict.fromkeys(ROWS[n].kernel for n in args.rows):
        names = [n for n in args.rows if ROWS[n].kernel == kernel]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "part.json"
            cmd = [sys.executable, __file__, "--windows", str(args.windows), "--window",
                   str(args.window), "--max-new-tokens", str(args.max_new_tokens), "--rows",
                   ",".join(names), "--part-out", str(out)]
            subprocess.run(cmd, env={**os.environ, "HETMOE_AMX_INT4": kernel}, check=True)
            parts.append(json.loads(out.read_text()))
    return parts


def mean(layers: list[dict[str, float]], key: str) -> float:
    return sum(layer[key] for layer in layers) / len(layers)


def tables(result: dict[str, Any]) -> str:
    """Markdown: the model-level table, then the per-layer errors (kernel / total)."""
    rows = result["rows"]
    n = len(QUESTIONS)
    lines = ["| CPU experts | AMX | kernel error (mean / max) | total error (mean / max) "
             "| perplexity | vs fp32 | KL vs fp32 | right | replies as fp32 | time |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| torch fp32 (exact) | - | - | - | {result['exact_ppl']:.4f} | - | - "
             f"| {result['exact_right']} / {n} | {n} / {n} | - |"]
    for name, r in rows.items():
        amx = f"every call, {r['kernel']} tiles" if ROWS[name].amx else "none (AVX-512)"
        k = [x["kernel"] for x in r["layers"]]
        t = [x["total"] for x in r["layers"]]
        lines.append(f"| {ROWS[name].weight_format} | {amx} | {sum(k) / len(k):.4f} / "
                     f"{max(k):.4f} | {sum(t) / len(t):.4f} / {max(t):.4f} | {r['ppl']:.4f} "
                     f"| {r['ppl'] / result['exact_ppl'] - 1:+.2%} | {r['kl']:.4f} "
                     f"| {r['right']} / {n} | {r['same']} / {n} | {r['seconds']} s |")
    lines += ["", "| layer | " + " | ".join(f"{name} kernel / total" for name in rows) + " |",
              "|---:|" + "---:|" * len(rows)]
    count = len(next(iter(rows.values()))["layers"])
    for i in range(count):
        cells = [f"{r['layers'][i]['kernel']:.4f} / {r['layers'][i]['total']:.4f}"
                 for r in rows.values()]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    for label, agg in (("mean", lambda v: sum(v) / len(v)), ("max", max)):
        cells = [f"{agg([x['kernel'] for x in r['layers']]):.4f} / "
                 f"{agg([x['total'] for x in r['layers']]):.4f}" for r in rows.values()]
        lines.append(f"| **{label}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(parts: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One result of the parts, rows in the order asked; the reference from the first part
    (each part's own, which its rows are measured against, is kept as `parts`)."""
    rows = {n: p["rows"][n] for n in names for p in parts if n in p["rows"]}
    first = parts[0]
    return {"exact_ppl": first["exact_ppl"], "exact_right": first["exact_right"],
            "amx_emulation": first["amx_emulation"],
            "tokens_per_expert": first["tokens_per_expert"], "rows": rows,
            "parts": [{k: p[k] for k in ("kernel", "exact_ppl", "exact_right", "exact_replies")}
                      for p in parts]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6, help="held-out windows")
    parser.add_argument("--window", type=int, default=256, help="tokens per window (prefill)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="per reply")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--part-out", type=Path, help="(internal) measure here, write JSON")
    args = parser.parse_args(argv)
    args.rows = [n for n in args.rows.split(",") if n]
    unknown = [n for n in args.rows if n not in ROWS]
    if unknown or not args.rows:
        parser.error(f"--rows takes names of {', '.join(ROWS)}; got {unknown or 'none'}")
    if args.windows < 1 or args.window < 2:
        parser.error(f"need >= 1 window of >= 2 tokens, got {args.windows} x {args.window}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    torch.manual_seed(0)
    if args.part_out is not None:
        part = measure_part(args, lambda line: print(line, flush=True))
        args.part_out.write_text(json.dumps(part))
        return part
    result = merge(run_parts(args), args.rows)
    result.update(stamp(__file__, argv), windows=args.windows, window=args.window,
                  max_new_tokens=args.max_new_tokens)
    body = tables(result)
    print(body)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo_moe_int4_kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    tpe = result["tokens_per_expert"]
    line = stamp_line(result, f"{args.windows} held-out windows of {args.window} tokens, "
                      f"{tpe['mean']:.0f} tokens per expert and window on average, "
                      f"{tpe['min']} at least; AMX emulation: {result['amx_emulation']}")
    write_marked(args.out / "demo_moe.md", "int4 kernels", SCRIPT, f"{line}\n\n{body}")
    return result


if __name__ == "__main__":
    main()
