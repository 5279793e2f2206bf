"""`hetmoe.LLM`: load + inject a checkpoint, then generate through the scheduler (the one loop)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, overload

import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.executor.adapters import LoraAdapters, assign_adapter, with_lora
from hetmoe.engine.executor.overlap import all_on_cpu_backend
from hetmoe.engine.executor.prefill_planner import check_prefill_mode
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.model.chat_template import chat_ids, read_chat_template, set_chat_template
from hetmoe.engine.model.deferral_auto import (
    DeferralChoice,
    choose_deferred,
    probe_ids,
    record_deferral,
)
from hetmoe.engine.model.kv_fit import KvFit, engine_fit
from hetmoe.engine.model.model_setup import (
    check_device,
    check_experts_loaded,
    eos_ids,
    read_config,
    resolve_dtype,
    sampling_defaults,
    share_cores,
)
from hetmoe.engine.model.model_source import check_fits, default_window, open_model
from hetmoe.engine.requests.collected_output import CollectedOutput
from hetmoe.engine.requests.constrained import Constraints
from hetmoe.engine.requests.logprobs import TokenLogprob
from hetmoe.engine.requests.request import Event
from hetmoe.engine.requests.sampler import GenerationOutput, SamplingParams, request_params
from hetmoe.engine.requests.scheduler import Scheduler
from hetmoe.experts.backend import get_backend
from hetmoe.inject.apply import InjectionReport, apply_rules
from hetmoe.inject.registry import OpContext
from hetmoe.inject.rules import Rule, load_rules, shipped_rules_path
from hetmoe.loading import load_model
from hetmoe.loading.converted import ConvertedModel
from hetmoe.loading.fp8 import config_fp8_scheme

log = logging.getLogger(__name__)


class LLM:
    """A MoE model ready to generate: `generate`, `stream`, `chat`, `logits`.

    `model_path` is a checkpoint directory, a converted directory (`hetmoe convert`: experts
    mapped, `verify` checks every checksum), a GGUF file (converted once into the cache) or a
    preset name (`tiny-qwen3-moe`, ...); `rules` a YAML rule file (default: the family's shipped
    rules); `lora` a PEFT adapter directory (used by default) or {name: directory} (a request
    picks one by `adapter=NAME`); `chat_template` a Jinja file that replaces the checkpoint's
    chat template (checked before loading); `options` are `EngineConfig` fields (`max_batch`
    "auto": the KV slots that fit the memory the weights leave, at most 256, kept as `kv_fit`).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        device: str | torch.device | None = None,
        rules: str | os.PathLike[str] | None = None,
        verify: bool = False,
        lora: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None = None,
        chat_template: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        template = read_chat_template(chat_template) if chat_template is not None else None
        self.options, adapters = with_lora(EngineConfig.from_options(**options), lora)
        self.kv_fit: KvFit | None = None
        """What `max_batch="auto"` chose and why (None: a fixed count)."""
        self.device = check_device(device)
        check_prefill_mode(self.options.prefill_experts, self.device)
        if self.options.experts is not None:
            get_backend(self.options.experts)  # unknown or unusable here: say so before loading
        self.path, converted = open_model(model_path, verify, self.options.progress,
                                          self.options.experts)
        raw = read_config(self.path)
        self.sampling_defaults = sampling_defaults(self.path)
        """What the checkpoint's generation_config.json recommends (the server's defaults for
        fields a request leaves out)."""
        self.rules: list[Rule] = load_rules(
            rules if rules is not None else shipped_rules_path(str(raw.get("model_type")))
        )
        self.dtype = resolve_dtype(self.options.dtype, raw)
        self.injection = InjectionReport()
        inject = functools.partial(self._inject, raw=raw, converted=converted)
        loaded = load_model(
            self.path, device=self.device, dtype=self.dtype, inject=inject,
            progress=self.options.progress,
        )
        self.model = loaded.model.eval()
        if converted is not None:
            converted.map_experts(self.model)
        check_experts_loaded(self.model, self.path)
        share_cores(self.model, self.device, self.options.torch_threads)
        self.tokenizer = loaded.tokenizer
        if template is not None:
            set_chat_template(self.tokenizer, template, str(chat_template), self.path)
        self.family = loaded.family
        if self.options.verbose:
            print(self.injection.details())
        config = self.model.config
        window = self.options.max_seq_len or default_window(config)
        self.options.check_deferred(self.device.type, all_on_cpu_backend(self.model))
        # The fused decode step cuts GPU launches; on the CPU device the HF layers run.
        auto = self.options.deferred == "auto"
        runner_options = dataclasses.replace(
            self.options, fused_decode=self.options.fused_decode and self.device.type == "cuda",
            deferred=0 if auto else self.options.deferred, max_batch=self.max_batch)
        self.runner = ModelRunner(self.model, self.device, self.dtype, self.max_batch, window,
                                  runner_options)
        self.runner.adapters = LoraAdapters.load(self.model, adapters, lora)
        self.deferral: DeferralChoice | None = None
        """What `deferred="auto"` chose and why (None: a fixed count), before any request."""
        if auto:
            self.deferral = choose_deferred(self.runner,
                                            probe_ids(self.tokenizer, self.runner.vocab_size))
            if self.device.type == "cuda":
                record_deferral(self.path, self.deferral, self.device)
        self.eos_token_ids = eos_ids(self.path, config, self.tokenizer)
        self.constraints = Constraints(self.tokenizer, self.eos_token_ids, self.runner.vocab_size,
                                       str(self.path))
        """`response_format` indexes over this tokenizer's vocabulary (built at first use)."""
        self.scheduler = self._local_loop()

    def _inject(self, model: torch.nn.Module, raw: dict[str, Any],
                converted: ConvertedModel | None) -> InjectionReport:
        """Injects the rules into the meta skeleton `model`; with max_batch "auto" sizes the KV
        slots from its plan (`kv_fit`), logged once; refuses a model that does not fit this
        machine with its slots, all before any weight is read."""
        ctx = OpContext(self.device, self.dtype, model.config, self.options.experts,
                        config_fp8_scheme(raw, str(self.path / "config.json")))
        self.injection = apply_rules(model, self.rules, ctx)
        if self.options.max_batch == "auto":
            window = self.options.max_seq_len or default_window(model.config)
            self.kv_fit = engine_fit(model, self.device, self.dtype, window,
                                     self.options.gpu_expert_bytes, converted)
            log.info(self.kv_fit.auto_line())
        check_fits(model, self.device, self.dtype,
                   dataclasses.replace(self.options, max_batch=self.max_batch), converted)
        return self.injection

    @property
    def max_batch(self) -> int:
        """KV slots, i.e. sequences decoded together at most: the `max_batch` asked, or the count
        "auto" chose (`kv_fit`, set once the skeleton is injected)."""
        return self.kv_fit.slots if self.kv_fit is not None else int(self.options.max_batch)

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

    @overload
    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 **sampling: Any) -> GenerationOutput: ...

    @overload
    def generate(self, prompt: list[str] | list[list[int]], params: SamplingParams | None = None,
                 **sampling: Any) -> list[GenerationOutput]: ...

    def generate(
        self,
        prompt: str | Sequence[int] | list[str] | list[list[int]],
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Generates a continuation of `prompt` (text or token ids) with `params`, or with
        `SamplingParams` fields as keywords (`max_tokens` is the OpenAI name of
        `max_new_tokens`, 128 by default). A list of prompts (texts, or lists of token ids) is
        generated together, sharing the scheduler's batches: one output per prompt, in order.
        With `logprobs` / `prompt_logprobs` set, the outputs carry them; `response_format`
        ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}})
        constrains the text to JSON."""
        params = request_params(params, sampling)
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > (slots := self.runner.max_batch):
                log.info("%d prompts, %d KV slots (max_batch): %d decode together, the rest as "
                         "slots free; max_batch=\"auto\" sizes the slots from the memory the "
                         "weights leave", len(prompt), slots, slots)
            return self._run_all([self._checked_prompt(self.encode(p)) for p in prompt], params)
        result: list[GenerationOutput] = []
        for _ in self._run(self.encode(prompt), params, result):  # type: ignore[arg-type]
            pass
        return result[0]

    __call__ = generate

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               **sampling: Any) -> Generator[str, None, None]:
        """Like `generate` (one prompt), yielding text pieces as they become final (UTF-8 and
        stop safe)."""
        yield from self._run(self.encode(prompt), request_params(params, sampling), [])

    def chat(self, messages: Sequence[dict[str, str]], **sampling: Any) -> GenerationOutput:
        """Generates the assistant's reply to `messages` with the tokenizer's chat template."""
        return self.generate(self.chat_prompt(messages), **sampling)

    def stream_chat(self, messages: Sequence[dict[str, str]],
                    **sampling: Any) -> Generator[str, None, None]:
        """Like `chat`, yielding text pieces (`close()` stops the answer and frees its slot)."""
        return self.stream(self.chat_prompt(messages), **sampling)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (`chat` and `chat_prompt` need one)."""
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def chat_prompt(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of `messages` rendered by the chat template, ready for the reply; `tools`
        (JSON-schema function definitions) go to the template as its `tools`."""
        tokenizer = self.tokenizer
        if tokenizer is None or not self.has_chat_template:
            raise ValueError(f"the tokenizer of {self.path} has no chat template")
        return chat_ids(tokenizer, messages, tools)

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Prefill logits [len, vocab] float32 of `token_ids` (on the CPU)."""
        ids = self._checked_prompt(self.encode(token_ids))
        slot = self.runner.cache.allocate()
        try:  # with LLM(lora=PATH), that adapter's logits
            assign_adapter(self.runner, slot, None)
            return self.runner.prefill_logits(slot, ids).cpu()
        finally:
            self.runner.free(slot)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens spelled out (`<id>` without a tokenizer)."""
        if self.tokenizer is None:
            return f"<{token_id}>"
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _named(self, entry: TokenLogprob) -> TokenLogprob:
        """`entry` with its token and alternatives as text, for `generate`'s outputs."""
        return dataclasses.replace(entry, token=self.token_text(entry.token_id), top_tokens=tuple(
            (self.token_text(t), logprob) for t, logprob in entry.top))

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

    def _local_loop(self) -> Scheduler:
        # No server: the caller's own requests only, so no queue limit (a batch may be large).
        return Scheduler(self.runner, self.decode, self.eos_token_ids, max_queue=2**31,
                         threaded=False, prefix_cache=self.options.prefix_cache,
                         constraints=self.constraints)

    def start_loop(self, max_queue: int = 64,
                   decode: Callable[[list[int]], str] | None = None) -> Scheduler:
        """Runs the scheduler on a thread of its own (a server); `generate` / `stream` then
        submit to it too, so every request shares its batches. `decode` turns ids into text on
        that thread (default: `self.decode`)."""
        self.scheduler.stop()
        self.scheduler = Scheduler(self.runner, decode or self.decode, self.eos_token_ids,
                                   max_queue, threaded=True, constraints=self.constraints,
                                   prefix_cache=self.options.prefix_cache)
        return self.scheduler

    def stop_loop(self) -> None:
        """Stops the loop's thread (requests in flight end as cancelled); `generate` runs the
        loop in the caller's thread again."""
        self.scheduler.stop()
        self.scheduler = self._local_loop()

    def _events(self, prompts: list[list[int]],
                params: SamplingParams) -> Iterator[tuple[int, Event]]:
        """Submits the requests and yields (request index, event) until each has ended, driving
        the loop in this thread when no server runs it; a consumer that stops early cancels the
        rest and their slots are freed before this returns."""
        scheduler = self.scheduler
        events: queue.SimpleQueue[tuple[int, Event]] = queue.SimpleQueue()
        handles = [scheduler.submit(ids, params, functools.partial(_put, events, i),
                                    fit_window=False) for i, ids in enumerate(prompts)]
        running = set(range(len(prompts)))

        def take() -> tuple[int, Event]:
            while not scheduler.threaded and events.empty():
                scheduler.run_once()
            i, event = events.get()
            if event.finish_reason is not None:
                running.discard(i)
            return i, event

        try:
            while running:
                yield take()
        finally:
            for i in running:
                handles[i].cancel()
            while running:
                take()

    def _run(
        self, prompt_ids: list[int], params: SamplingParams, result: list[GenerationOutput]
    ) -> Iterator[str]:
        """One request's text pieces as they become final; its output appended to `result`."""
        out = CollectedOutput(self._checked_prompt(prompt_ids))
        for _, event in self._events([out.prompt], params):
            out.add(event)
            if event.text:
                yield event.text
        result.append(out.output(params, self._named))

    def _run_all(self, prompts: list[list[int]],
                 params: SamplingParams) -> list[GenerationOutput]:
        outs = [CollectedOutput(ids) for ids in prompts]
        for i, event in self._events(prompts, params):
            outs[i].add(event)
        return [out.output(params, self._named) for out in outs]


def _put(events: queue.SimpleQueue[tuple[int, Event]], i: int, event: Event) -> None:
    events.put((i, event))
