"""Does the prefix cache change greedy answers? Each prompt is asked after a longer request that
shares its start (its KV is reused: `cached_tokens`), then again with the prefix cache off (a
fresh prefill); the table says whether the two greedy answers are the same tokens.

Kernels whose rounding depends on how many tokens a call carries (the C++ CPU experts; torch's
matmuls in bf16) make the reused KV differ in the last bits from a fresh prefill's, so a near
tie can turn an answer; torch experts in float32 give the same tokens (README, prefix cache).

Usage: python benchmarks/engine/prefix_cache_rounding.py [--model demo] [--experts cpu|torch]
       [--dtype auto|float32|bfloat16] [--tokens 48] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hetmoe import LLM

STARTS = (
    "Write a short story about a lighthouse keeper who",
    "Explain in simple words why the sky is blue and",
    "List five facts about the planet Mars, including",
    "Describe how bread is made, starting with the",
    "Give advice to a student who is learning to play the",
    "Summarize the history of the bicycle from its",
)
LONGER = " what happens at night, in detail, with many words."
SHORTER = " why."


def main(argv: list[str] | None = None) -> dict:
    """Runs the comparison (`argv` as on the command line); returns what it writes as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--experts", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per answer")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    llm = LLM(args.model, device="cpu", progress=False, max_seq_len=1024, max_batch=4,
              experts=args.experts, dtype=args.dtype)
    rows = []
    print(f"{'cached':>6} {'same':>5}  prompt")
    for start in STARTS:
        llm.chat([{"role": "user", "content": start + LONGER}], max_new_tokens=8)
        ask = [{"role": "user", "content": start + SHORTER}]
        cached = llm.chat(ask, max_new_tokens=args.tokens, temperature=0)
        llm.scheduler.prefix.enabled = False
        try:
            fresh = llm.chat(ask, max_new_tokens=args.tokens, temperature=0)
        finally:
            llm.scheduler.prefix.enabled = True
        same = cached.token_ids == fresh.token_ids
        rows.append({"prompt": start + SHORTER, "cached_tokens": cached.cached_tokens,
                     "same": same, "cached": cached.text, "fresh": fresh.text})
        print(f"{cached.cached_tokens:>6} {str(same):>5}  {start + SHORTER}", flush=True)
    differ = sum(not r["same"] for r in rows)
    print(f"{args.experts} experts, dtype {llm.dtype}: {differ} of {len(rows)} greedy answers "
          "differ between the cached prefix and a fresh prefill")
    result = {"model": args.model, "experts": args.experts, "dtype": str(llm.dtype),
              "tokens": args.tokens, "differ": differ, "rows": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
