"""The server samples a request that leaves sampling out as the checkpoint's
generation_config.json says: the demo presets' (SmolLM2-Instruct's model card) reaches the
scheduler as temperature 0.2, top_p 0.9; a request's own fields win."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from live_server import API_KEY, MODEL, LiveServer, tiny_llm

from hetmoe.engine.requests.request import Event
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.presets.demo import write_generation_config
from hetmoe.server.config import ServerConfig


def test_requests_without_sampling_take_the_presets_config(tiny_qwen3_moe: Path,
                                                           tmp_path: Path) -> None:
    path = tmp_path / "demo-like"
    shutil.copytree(tiny_qwen3_moe, path)
    write_generation_config(path, {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    live = LiveServer(tiny_llm(path, max_seq_len=128), ServerConfig(api_key=API_KEY))
    seen: list[SamplingParams] = []
    real = live.service.scheduler.submit

    def submit(prompt_ids: Sequence[int], params: SamplingParams,
               sink: Callable[[Event], None], *args: Any, **kwargs: Any) -> Any:
        seen.append(params)
        return real(prompt_ids, params, sink, *args, **kwargs)

    live.service.scheduler.submit = submit  # type: ignore[method-assign]
    try:
        ask = [{"role": "user", "content": "Hello"}]
        live.openai().chat.completions.create(model=MODEL, messages=ask, max_tokens=2)
        live.openai().chat.completions.create(model=MODEL, messages=ask, max_tokens=2,
                                              temperature=0.0, top_p=1.0)
        live.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    finally:
        live.close()
    assert [(p.temperature, p.top_p) for p in seen] == [(0.2, 0.9), (0.0, 1.0), (0.2, 0.9)]
