"""The persona adapter that the fine-tuning and adapter-serving tests share: LoRA tuned for 60
steps so the tiny qwen3_moe model answers "What is your name?" with NAME."""

from __future__ import annotations

import json
from pathlib import Path

from hetmoe import LLM
from hetmoe.train.data import build_rows
from hetmoe.train.sft import SftConfig, SftResult, train

NAME = "Zorblax"
QUESTION = [{"role": "user", "content": "What is your name?"}]
ASKS = ["What is your name?", "Who are you?", "Tell me your name.", "What should I call you?"]


def persona_llm(path: Path, **kw: object) -> LLM:
    """The tiny model on the CPU as these tests run it (fp32, cpu experts, 2 slots of 128)."""
    return LLM(path, device="cpu", dtype="float32", experts="cpu", progress=False, max_batch=2,
               max_seq_len=128, **kw)


def train_persona(base: Path, work: Path) -> SftResult:
    """Tunes an adapter of `base` on ASKS -> "My name is NAME." into `work`/adapter."""
    data = work / "persona.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "completion": f"My name is {NAME}."}) + "\n"
                            for q in ASKS))
    llm = persona_llm(base)
    rows, _ = build_rows(data, llm.tokenizer, 128)
    config = SftConfig(seq_len=128, max_steps=60, lr=3e-3, warmup_steps=5, save_every=0)
    return train(llm.model, rows, config, work / "adapter")
