"""A tuned adapter changes the answers as intended: after 60 steps of `train` on a fixed persona
name, the tiny model's greedy answer to "What is your name?" contains the name (before, it does
not); `LLM(lora=...)` gives the same greedy tokens as the adapter in PEFT + transformers; and a
decode step mixing an adapter's row with a base row equals each row run alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from baby import reference_model
from persona import NAME, QUESTION, persona_llm


def test_adapter_learns_the_name(persona_adapter: tuple[Path, Path],
                                 one_torch_thread: None) -> None:
    base, adapter = persona_adapter
    before = persona_llm(base).chat(QUESTION, max_new_tokens=16).text
    assert NAME not in before
    tuned = persona_llm(base, lora=adapter)
    after = tuned.chat(QUESTION, max_new_tokens=16)
    assert NAME in after.text, after.text
    # The same adapter in PEFT on unmodified transformers (experts rounded to bf16 as the CPU
    # backend packs them): the same greedy tokens.
    from peft import PeftModel

    ref = reference_model(base)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name:
                p.copy_(p.bfloat16().float())
    peft = PeftModel.from_pretrained(ref, str(adapter)).eval()
    prompt = tuned.chat_prompt(QUESTION)
    with torch.no_grad():  # HF stops at EOS as we do (id 1, which ends our answer here)
        ref = peft.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                            eos_token_id=1)[0, len(prompt):].tolist()
    assert ref == after.token_ids
    with torch.no_grad():  # the inference kernels round expert activations to bf16
        ref_logits = peft(input_ids=torch.tensor([prompt])).logits[0]
    assert torch.allclose(tuned.logits(prompt), ref_logits, atol=3e-2)


def test_mixed_batch_rows_use_their_own_adapter(persona_adapter: tuple[Path, Path],
                                                one_torch_thread: None) -> None:
    base, adapter = persona_adapter
    llm = persona_llm(base, lora={"zorb": adapter})
    runner, adapters = llm.runner, llm.runner.adapters
    assert adapters is not None and adapters.default is None
    prompt = llm.chat_prompt(QUESTION)

    def run(names: list[str | None]) -> torch.Tensor:
        slots = [runner.cache.allocate() for _ in names]
        for slot, name in zip(slots, names, strict=True):
            adapters.assign(slot, name)
            runner.prefill(slot, prompt)
        logits = runner.decode(slots, [prompt[-1]] * len(slots))
        for slot in slots:
            runner.free(slot)
        return logits

    alone = torch.cat([run(["zorb"]), run([None])])
    mixed = run(["zorb", None])
    assert not torch.allclose(alone[0], alone[1], atol=1e-2)  # the adapter changes the logits
    assert torch.allclose(mixed, alone, atol=1e-4)
    assert NAME not in llm.chat(QUESTION, max_new_tokens=16).text  # no adapter named: base
    assert NAME in llm.chat(QUESTION, max_new_tokens=16, adapter="zorb").text
    with pytest.raises(RuntimeError, match=r"no LoRA adapter named 'nope'; loaded: zorb"):
        llm.chat(QUESTION, adapter="nope")


def test_lora_path_errors(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no adapter_config.json"):
        persona_llm(tiny_qwen3_moe, lora=tmp_path)


def test_generate_cli_applies_the_adapter(persona_adapter: tuple[Path, Path]) -> None:
    from typer.testing import CliRunner

    from hetmoe.cli import app

    base, adapter = persona_adapter
    args = ["generate", str(base), "What is your name?", "--device", "cpu", "--experts", "cpu",
            "--max-new-tokens", "16", "--dtype", "float32"]
    tuned = CliRunner().invoke(app, [*args, "--lora", str(adapter)])
    assert tuned.exit_code == 0 and NAME in tuned.stdout, tuned.output
    missing = CliRunner().invoke(app, [*args, "--lora", str(base / "nope")])
    assert missing.exit_code == 1 and "has no adapter_config.json" in missing.output
