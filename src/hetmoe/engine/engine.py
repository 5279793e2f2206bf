"""`hetmoe.LLM`: load + inject a checkpoint, then generate through the scheduler (the one loop)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.runner import ModelRunner
from hetmoe.engine.sampler import GenerationOutput, SamplingParams
from hetmoe.engine.scheduler import Event, Scheduler
from hetmoe.experts.backend import ExpertBackend, get_backend
from hetmoe.inject.apply import InjectionReport, apply_rules
from hetmoe.inject.registry import OpContext
from hetmoe.inject.rules import Rule, load_rules, shipped_rules_path

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_MAX_SEQ_LEN = 4096


def default_device() -> torch.device:
    """cuda when a GPU is visible, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLM:
    """A MoE model ready to generate: `generate`, `stream`, `chat`, `logits`.

    `model_path` is a checkpoint directory or a preset name (`tiny-qwen3-moe`, ...); `rules` a
    YAML rule file (default: the family's shipped rules); `options` are `EngineConfig` fields.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        device: str | torch.device | None = None,
        rules: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        from hetmoe.loading import load_model
        from hetmoe.presets import resolve_model

        self.options = EngineConfig.from_options(**options)
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {str(self.device)!r} requested but no CUDA GPU is available")
        if self.options.experts is not None:
            get_backend(self.options.experts)  # unknown or unusable here: say so before loading
        self.path = resolve_model(model_path)
        raw = _read_config(self.path)
        self.rules: list[Rule] = load_rules(
            rules if rules is not None else shipped_rules_path(str(raw.get("model_type")))
        )
        self.dtype = _resolve_dtype(self.options.dtype, raw)
        self.injection = InjectionReport()

        def inject(model: torch.nn.Module) -> InjectionReport:
            ctx = OpContext(self.device, self.dtype, model.config, self.options.experts)
            self.injection = apply_rules(model, self.rules, ctx)
            return self.injection

        loaded = load_model(
            self.path, device=self.device, dtype=self.dtype, inject=inject,
            progress=self.options.progress,
        )
        self.model = loaded.model.eval()
        _check_experts_loaded(self.model, self.path)
        _share_cores(self.model, self.device, self.options.torch_threads)
        self.tokenizer = loaded.tokenizer
        self.family = loaded.family
        if self.options.verbose:
            print(self.injection.details())
        config = self.model.config
        window = self.options.max_seq_len or min(
            int(getattr(config, "max_position_embeddings", _DEFAULT_MAX_SEQ_LEN)),
            _DEFAULT_MAX_SEQ_LEN,
        )
        if self.options.deferred and self.device.type != "cuda":
            raise ValueError(
                f"option deferred={self.options.deferred} needs GPU decode with every MoE "
                f"layer's routed experts in the cpu backend; this run decodes on "
                f"{self.device.type} (use deferred=0)"
            )
        # The fused decode step cuts GPU launches; on the CPU device the HF layers run.
        runner_options = dataclasses.replace(
            self.options, fused_decode=self.options.fused_decode and self.device.type == "cuda")
        self.runner = ModelRunner(self.model, self.device, self.dtype, self.options.max_batch,
                                  window, runner_options)
        if self.options.deferred and self.runner.overlap is None:
            raise ValueError(
                f"option deferred={self.options.deferred} needs every MoE layer's routed experts "
                "in the cpu backend (use deferred=0)"
            )
        self.eos_token_ids = _eos_ids(self.path, config, self.tokenizer)
        self.scheduler = Scheduler(self.runner, self.decode, self.eos_token_ids, threaded=False)

    @property
    def max_seq_len(self) -> int:
        """Context window per sequence, in tokens."""
        return self.runner.max_seq_len

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (a string is tokenized; ids pass through)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.path} has no tokenizer: pass token ids, not text")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens dropped (ids as text without a tokenizer)."""
        if self.tokenizer is None:
            return "".join(f"<{t}>" for t in token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> GenerationOutput:
        """Generates a continuation of `prompt` (text or token ids)."""
        params = _params(max_new_tokens, temperature, top_p, top_k, seed, stop)
        result: list[GenerationOutput] = []
        for _ in self._run(self.encode(prompt), params, result):
            pass
        return result[0]

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[str]:
        """Like `generate`, yielding text pieces as they become final (UTF-8 and stop safe)."""
        params = _params(max_new_tokens, temperature, top_p, top_k, seed, stop)
        yield from self._run(self.encode(prompt), params, [])

    def chat(self, messages: Sequence[dict[str, str]], **sampling: Any) -> GenerationOutput:
        """Generates the assistant's reply to `messages` with the tokenizer's chat template."""
        return self.generate(self.chat_prompt(messages), **sampling)

    def stream_chat(self, messages: Sequence[dict[str, str]], **sampling: Any) -> Iterator[str]:
        """Like `chat`, yielding text pieces."""
        return self.stream(self.chat_prompt(messages), **sampling)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (`chat` and `chat_prompt` need one)."""
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of `messages` rendered by the chat template, ready for the reply."""
        tokenizer = self.tokenizer
        if tokenizer is None or not self.has_chat_template:
            raise ValueError(f"the tokenizer of {self.path} has no chat template")
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Prefill logits [len, vocab] float32 of `token_ids` (on the CPU)."""
        ids = self._checked_prompt(self.encode(token_ids))
        slot = self.runner.cache.allocate()
        try:
            return self.runner.prefill_logits(slot, ids).cpu()
        finally:
            self.runner.free(slot)

    def _checked_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) > self.max_seq_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context window is {self.max_seq_len} "
                "tokens (max_seq_len)"
            )
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} out of the vocabulary [0, {vocab})")
        return ids

    def start_loop(self, max_queue: int = 64,
                   decode: Callable[[list[int]], str] | None = None) -> Scheduler:
        """Runs the scheduler on a thread of its own (a server); `generate` / `stream` then
        submit to it too, so every request shares its batches. `decode` turns ids into text on
        that thread (default: `self.decode`)."""
        self.scheduler.stop()
        self.scheduler = Scheduler(self.runner, decode or self.decode, self.eos_token_ids,
                                   max_queue, threaded=True)
        return self.scheduler

    def stop_loop(self) -> None:
        """Stops the loop's thread (requests in flight end as cancelled); `generate` runs the
        loop in the caller's thread again."""
        self.scheduler.stop()
        self.scheduler = Scheduler(self.runner, self.decode, self.eos_token_ids, threaded=False)

    def _run(
        self, prompt_ids: list[int], params: SamplingParams, result: list[GenerationOutput]
    ) -> Iterator[str]:
        """Submits the request to the scheduler and waits for its events (driving the loop in
        this thread when no server runs it), yielding text pieces as they become final."""
        prompt_ids = self._checked_prompt(prompt_ids)
        scheduler = self.scheduler
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        handle = scheduler.submit(prompt_ids, params, events.put, fit_window=False)
        text: list[str] = []
        tokens: list[int] = []
        last: Event | None = None
        try:
            while last is None:
                if not scheduler.threaded and events.empty():
                    scheduler.run_once()
                    continue
                event = events.get()
                tokens.extend(event.token_ids)
                if event.text:
                    text.append(event.text)
                    yield event.text
                if event.finish_reason is not None:
                    last = event
        finally:
            if last is None:  # the consumer stopped early: free the slot before returning
                handle.cancel()
                while not scheduler.threaded and (scheduler.num_running
                                                  or scheduler.num_waiting):
                    scheduler.run_once()
                while scheduler.threaded and events.get().finish_reason is None:
                    pass
        assert last.finish_reason is not None
        if last.finish_reason == "error":
            raise RuntimeError(f"generation failed: {last.error}")
        result.append(GenerationOutput("".join(text), tokens, last.finish_reason,
                                       len(prompt_ids)))


def _params(
    max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
    stop: str | Sequence[str] | None,
) -> SamplingParams:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(max_new_tokens, float(temperature), float(top_p), int(top_k), seed, stops)


def _check_experts_loaded(model: torch.nn.Module, path: Path) -> None:
    """Every routed expert must have received its three matrices from the checkpoint."""
    missing = [
        f"{name}.{tensor}"
        for name, module in model.named_modules()
        if isinstance(module, ExpertBackend)
        for tensor in module.missing()
    ]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"{path}: the checkpoint lacks {len(missing)} routed-expert tensors: "
            f"{', '.join(missing[:5])}{more}"
        )


def _share_cores(model: torch.nn.Module, device: torch.device, requested: int | None) -> None:
    """On the CPU device, gives torch the cores the CPU expert pool leaves free.

    The pool's workers spin between layers, so torch threads on the same cores would be
    preempted by them and every torch op would wait for its slowest thread.
    """
    from hetmoe.experts.cpu_backend import CpuExperts

    if device.type != "cpu" or not any(isinstance(m, CpuExperts) for m in model.modules()):
        return
    if requested is None:
        from hetmoe._cpu import pool_info

        info = pool_info()
        requested = max(1, int(info["allowed_cpus"]) - int(info["threads"]))
    torch.set_num_threads(requested)


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    try:
        return json.loads(config_path.read_text())
    except OSError as exc:
        raise FileNotFoundError(f"{config_path}: cannot read it ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path}: not valid JSON: {exc}") from exc


def _resolve_dtype(option: str, raw: dict[str, Any]) -> torch.dtype:
    if option != "auto":
        return _DTYPES[option]
    if (raw.get("quantization_config") or {}).get("quant_method") == "fp8":
        return torch.bfloat16  # FP8 weights are dequantized at load, to bf16 by default
    stored = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return _DTYPES.get(str(stored), torch.float32)


def _eos_ids(path: Path, config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    sources = [config.eos_token_id, getattr(tokenizer, "eos_token_id", None)]
    generation = path / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)
