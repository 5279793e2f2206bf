"""Our own generation loop: LLM, model runner, static KV cache, sampler, scheduler."""
