"""`LLM.generate`'s log-probabilities name their tokens as text (`token`, `top_tokens`) beside
the ids (`token_id`, `top`)."""

from __future__ import annotations

from hetmoe import LLM

PROMPT = "Hello! The harbour town woke slowly that morning."


def test_generated_and_prompt_entries_carry_token_text(llm_of) -> None:
    llm: LLM = llm_of("qwen3_moe")
    out = llm.generate(PROMPT, max_new_tokens=6, logprobs=3, prompt_logprobs=2)
    assert out.logprobs is not None and out.prompt_logprobs is not None
    for entry in [*out.logprobs, *out.prompt_logprobs[1:]]:
        assert entry is not None and entry.top_tokens is not None
        assert entry.token == llm.tokenizer.decode([entry.token_id])
        assert entry.top_tokens == tuple((llm.tokenizer.decode([t]), lp) for t, lp in entry.top)
        assert all(isinstance(text, str) for text, _ in entry.top_tokens)
    assert [e.token for e in out.logprobs] == [llm.tokenizer.decode([t]) for t in out.token_ids]
    assert len(out.logprobs) == len(out.token_ids) >= 1
    assert llm.token_text(1) == "</s>"  # special tokens (an ending EOS) are spelled out
