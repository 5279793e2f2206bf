"""`ModelRunner`: tensors in, logits or tokens out, over the static KV cache. No text.

The one runner for prefill and decode, single-threaded (one owner at a time). ONE entry:

- `step(StepPlan) -> StepOutput`: the plan's prefill chunks (any number of sequences, each into its
  slot from its own start) and one new token for each of its B decode rows, each at its own
  position. A plan with chunks runs as ONE forward pass, its decode rows included
  (engine/executor/prefill_batch.py: one expert call per MoE layer; long passes stream experts to
  the GPU), on the HF layers: CUDA graphs and the fused decode layers hold decode rows alone (with
  LoRA adapters, which peft names per batch row, the decode rows run apart). A plan of decode rows
  alone is one decode step; greedy plans get tokens, and with CUDA graphs a plan with `ahead` also
  launches the next step of the same slots before this one's tokens are read
  (engine/executor/launch_ahead.py; `settle` rolls back a step launched ahead nobody continues);
  from `EngineConfig.stream_decode_rows` rows the prefill planner may run it as such a pass instead,
  part of each layer's experts streamed to the GPU (engine/executor/weighed_decode.py).
- Shorthands of `step` for tests and scripts: `prefill(slot, token_ids, start=0) -> [V]`,
  `prefill_logits -> [T, V]`, `decode(slots, token_ids) -> [B, V]`, `greedy(slot, token, limit)`.

With every MoE layer's experts in the CPU backend it composes `MoEOverlap` (the MoE step's
links), `PrefillPlanner` (where prefill experts run), `FusedDecoder` and `GraphCache`; decode
steps attend over a window bucket of the cache (ops/kv_batch.py). Logits are float32. The module
path runs each HF decoder layer's steps through ops/decoder_layer.py; the runner owns embedding,
rotary positions, the final norm and `lm_head`, and passes a `KVBatch` down.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.executor.adapters import LoraAdapters
from hetmoe.engine.executor.expert_placement import place_experts
from hetmoe.engine.executor.fused_decode import FusedDecoder
from hetmoe.engine.executor.graphs import GraphCache
from hetmoe.engine.executor.kv_cache import StaticKVCache
from hetmoe.engine.executor.launch_ahead import LaunchAhead, Launched, sleep_until_done
from hetmoe.engine.executor.layer_plan import fits_fused
from hetmoe.engine.executor.overlap import MoEOverlap, all_on_cpu_backend
from hetmoe.engine.executor.prefill_batch import StepLayout, step_layouts
from hetmoe.engine.executor.prefill_planner import PrefillPlanner
from hetmoe.engine.executor.step_checks import check_chunk, check_decode_rows
from hetmoe.engine.executor.weighed_decode import weighed_decode
from hetmoe.engine.placement.placement_plan import PlacementPlan
from hetmoe.engine.placement.placement_policy import TrafficPolicy
from hetmoe.engine.placement.slots import Placement
from hetmoe.engine.step import PrefillChunk, StepOutput, StepPlan
from hetmoe.ops.decoder_layer import decoder_stack
from hetmoe.ops.kv_batch import KVBatch, RaggedKV, window_bucket


class ModelRunner:
    """Prefill and batched decode of an injected model over a multi-slot static KV cache."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype, max_batch: int,
                 max_seq_len: int, config: EngineConfig | None = None) -> None:
        self.model = model  # the HF causal LM, injected
        self.base: Any = getattr(model, model.base_model_prefix)
        self.device = device
        self.config = config = config or EngineConfig()
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.vocab_size = int(model.config.vocab_size)
        self.overlap: MoEOverlap | None = None
        self.planner: PrefillPlanner | None = None  # where prefill experts run (costs loaded)
        self.fused: FusedDecoder | None = None
        self.graph_cache: GraphCache | None = None
        self.windows: Counter[int] = Counter()  # decode steps per window bucket (CPU experts)
        if isinstance(config.deferred, str):  # LLM resolves "auto" on a runner built at 0
            raise ValueError("ModelRunner takes a deferred count, not 'auto' (LLM picks it)")
        if all_on_cpu_backend(model):
            fits = config.fused_decode and fits_fused(model)
            rows = max(max_batch, *config.graph_batch_sizes)
            self.overlap = MoEOverlap(model, device, rows, config.deferred, fits,
                                      config.defer_order)
            self.planner = PrefillPlanner.for_overlap(self.overlap)
            if fits:
                compile_ = config.compile_decode and device.type == "cuda"
                self.fused = FusedDecoder(model, self.overlap, compile_)
            if device.type == "cuda":
                self.graph_cache = GraphCache(config, device, self.overlap, self._step_forward,
                                              max_batch)
        else:
            self._set_deferred(config.deferred)  # a count without the overlap is refused
        self.use_graphs = self.graph_cache is not None and config.cuda_graphs
        """Replay decode steps as CUDA graphs (settable: False launches the same steps)."""
        self.cache = StaticKVCache(model, max_batch, max_seq_len, dtype)
        self.lengths = self.cache.lengths
        self.adapters: LoraAdapters | None = None  # per slot (LLM(lora=...)); None: as loaded
        self.launch_ahead = LaunchAhead(self)
        """The greedy step launched before the previous one's tokens are read (CUDA graphs)."""
        self.placement: Placement | None = None
        """Routed experts resident on the GPU (`place`); None: every expert on the CPU."""
        self.policy: TrafficPolicy | None = None
        """Moves resident experts toward the routing between steps (`place`)."""
        budget = config.gpu_expert_bytes  # EngineConfig folds in the former name's budget
        if self.overlap is not None and (budget != 0 or config.fetch_slots):
            self.place(budget)  # after the KV cache: `auto` sees what is left
        elif self.planner is not None:
            self.planner.prepare(config.prefill_experts, config.fetch_slots,
                                 config.stream_decode_rows, max_batch)

    @property
    def graphs(self) -> dict[tuple[int, int], Any]:
        """The captured decode steps by (batch size, window bucket)."""
        return self.graph_cache.graphs if self.graph_cache is not None else {}

    def committed(self, slot: int) -> int:
        """Tokens in `slot` that the caller has read (its length, less a step launched ahead)."""
        return self.lengths[slot] - int(self.launch_ahead.holds(slot))

    def free(self, slot: int) -> None:
        """Frees `slot` (after settling a step launched ahead, which may write to it)."""
        self.settle()
        self.cache.free(slot)
        if self.adapters is not None:
            self.adapters.release(slot)

    def prefill(self, slot: int, token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Logits [V] after running `token_ids` into `slot` from position `start` (a `step`)."""
        return self.prefill_logits(slot, token_ids, start, every_position=False)[-1]

    def prefill_logits(self, slot: int, token_ids: Sequence[int], start: int = 0,
                       every_position: bool = True) -> torch.Tensor:
        """Like `prefill`, but the logits of every position: [T, V]."""
        chunk = PrefillChunk(slot, tuple(int(t) for t in token_ids), start, every_position)
        return self.step(StepPlan(prefills=(chunk,))).prefill_logits[0]

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [B, V] after appending token_ids[b] to slots[b] (a `step`)."""
        out = self.step(StepPlan(tuple(slots), tuple(int(t) for t in token_ids))).logits
        assert out is not None
        return out

    def greedy(self, slot: int, token: int,
               limit: int | None = None) -> Generator[int, None, None]:
        """Greedy decode of `slot` after `token` (sampled, not cached yet): each step's token until
        the caller stops, `limit` tokens or a full window (plans with `ahead`: launched early)."""
        yielded = 0
        try:
            while self.lengths[slot] < self.max_seq_len and (limit is None or yielded < limit):
                more = (limit is None or yielded + 1 < limit) and \
                    self.lengths[slot] + 1 < self.max_seq_len
                tokens = self.step(StepPlan((slot,), (token,), greedy=True, ahead=more)).tokens
                assert tokens is not None
                token = tokens[0]
                yielded += 1
                yield token
        finally:
            self.settle()

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepOutput:
        """Runs one step (see the module docstring): its prefill chunks and its decode rows."""
        if not plan.prefills:
            return self._decode_step(plan)
        self.settle()
        for chunk in plan.prefills:
            self.check_chunk(chunk)
        if plan.decodes:
            check_decode_rows(plan, self.cache, self.max_seq_len, self.vocab_size)
        # peft names an adapter per batch row: with adapters each pass runs apart, then decodes.
        apart = self.adapters is not None
        logits = [torch.empty(0)] * len(plan.prefills)
        for layout in step_layouts(plan, self.lengths, self.max_seq_len, apart):
            out = self._joined(layout, logits, plan.greedy)
        if apart and plan.decodes:
            return dataclasses.replace(self._decode_step(plan), prefill_logits=tuple(logits))
        return self._after(out) if plan.decodes else out

    def _decode_step(self, plan: StepPlan) -> StepOutput:
        """The decode rows of `plan`: eager, or greedy launched (ahead) on CUDA graphs; from
        `planner.decode_rows` rows possibly a pass streaming experts (weighed_decode.py)."""
        launched = self.launch_ahead.take(plan)
        if launched is None:
            check_decode_rows(plan, self.cache, self.max_seq_len, self.vocab_size)
        if self.planner is not None and len(plan.slots) >= self.planner.decode_rows:
            return weighed_decode(self, self.planner, plan, launched)
        return self._decode_path(plan, launched)

    def _decode_path(self, plan: StepPlan, launched: Launched | None) -> StepOutput:
        """Decode rows eager, or greedy launched (ahead) on CUDA graphs."""
        if plan.greedy and self.use_graphs:
            return self.launch_ahead.run(plan, launched, self._after)
        try:
            return self._after(self._run_step(plan))
        except BaseException:
            self.launch_ahead.fail(launched)
            raise

    def _after(self, out: StepOutput) -> StepOutput:
        """Between steps: the placement follows the traffic (`EngineConfig.placement_interval`)."""
        if self.policy is not None:
            self.policy.after_step()
        return out

    def settle(self) -> None:
        """Waits for a step launched ahead and rolls it back (its tokens were not wanted)."""
        self.launch_ahead.settle()

    def reset_graphs(self, deferred: int | None = None, defer_order: str | None = None) -> None:
        """Drops the captured graphs (to change `deferred` or `defer_order`: graphs bake them)."""
        self.settle()
        self.graphs.clear()  # first: a change refused below leaves no graph of other settings
        if defer_order is not None and self.overlap is not None:  # (none: nothing defers)
            self.overlap.defer_order = defer_order  # checked first: a refused one sets no count
        if deferred is not None:
            self._set_deferred(deferred)

    def _set_deferred(self, deferred: int) -> None:
        """Expert Deferral's count on the MoE step (`MoEStep.deferred` checks its bound)."""
        if self.overlap is None and deferred:
            raise ValueError(f"deferred={deferred} needs every MoE layer's routed experts in the "
                             "cpu backend")
        if self.overlap is not None:
            self.overlap.deferred = deferred

    def place(self, budget: int | str, counts: Sequence[torch.Tensor] | None = None,
              fetch_slots: int | None = None) -> PlacementPlan:
        """Keeps routed experts resident on the GPU under `budget` (bytes or "auto", as
        `EngineConfig.gpu_expert_bytes`), the most routed by `counts` [E] per MoE layer, else the
        first; 0: every expert on the CPU. `fetch_slots` (default the config's): fetch-or-compute's
        pool. Between steps only: the graphs (which bake in the CPU jobs) are dropped
        (engine/executor/expert_placement.py)."""
        return place_experts(self, budget, counts, fetch_slots)

    def _phase(self, decoding: bool, slots: Sequence[int]) -> contextlib.ExitStack:
        """The MoE step's phase and the rows' adapters; re-attaches this runner's step over another
        runner's (runners may share a model; a test's step stays)."""
        stack = contextlib.ExitStack()
        if self.adapters is not None:
            stack.enter_context(self.adapters.rows(slots))
        if self.overlap is not None:
            current = self.overlap.layers[0].step
            if current is None or (isinstance(current, MoEOverlap) and current is not self.overlap):
                self.overlap.attach()
            stack.enter_context(self.overlap.phase(decoding))
        return stack

    def _run_step(self, plan: StepPlan) -> StepOutput:
        """A step run to its end: logits, or the argmax read on the host."""
        starts = [self.lengths[s] for s in plan.slots]
        # One host-to-device copy for the step's three index vectors (each copy waits for it).
        index = torch.tensor([list(plan.token_ids), starts, list(plan.slots)]).to(self.device)
        ids, positions = index[0, :, None], index[1, :, None]  # [B, 1] each
        with self._phase(decoding=True, slots=plan.slots):
            try:
                hidden = self._decode_forward(ids, KVBatch(index[2], positions, max(starts) + 1))
                logits = self.model.lm_head(hidden[:, 0]).float()  # [B, V]
                if self.device.type == "cuda":
                    sleep_until_done()
            except BaseException:
                if self.overlap is not None:
                    self.overlap.abort_step()  # queued CPU jobs must not wait for a lost step
                raise
        if self.overlap is not None:
            self.overlap.finish_step()
        for slot in plan.slots:
            self.lengths[slot] += 1
        if plan.greedy:
            return StepOutput(tokens=tuple(logits.argmax(-1).tolist()))
        return StepOutput(logits=logits)

    def _launch(self, slots: tuple[int, ...], ids: torch.Tensor) -> Launched:
        """Launches a greedy step of `slots` on ids [B, 1] (on the GPU); read with `_read`."""
        starts = [self.lengths[s] for s in slots]
        index = torch.tensor([starts, list(slots)], pin_memory=True)
        index = index.to(self.device, non_blocking=True)
        kv = KVBatch(index[1], index[0][:, None], max(starts) + 1)
        assert self.overlap is not None
        with self._phase(decoding=True, slots=slots):
            hidden = self._decode_forward(ids, kv)[:, 0]  # [B, H]
        for slot in slots:
            self.lengths[slot] += 1
        token = self.model.lm_head(hidden).float().argmax(-1, keepdim=True)  # [B, 1]
        host = torch.empty(len(slots), 1, dtype=torch.int64, pin_memory=True)
        host.copy_(token, non_blocking=True)
        done = torch.cuda.Event(blocking=True)  # sleep, not spin, on it (sleep_until_done)
        done.record()
        return Launched(slots, token, host, done, self.overlap.take_pending())

    def _read(self, launched: Launched) -> tuple[int, ...]:
        """Waits for a launched step and its CPU jobs; its tokens."""
        launched.done.synchronize()
        jobs, launched.jobs = launched.jobs, []
        assert self.overlap is not None
        self.overlap.finish_step(jobs)
        return tuple(launched.host[:, 0].tolist())

    def _decode_forward(self, ids: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        """ids [B, 1] -> final hidden [B, 1, H] of a decode step: graphs or eager, fused or HF
        layers (CPU-expert models over the step's window bucket)."""
        if self.overlap is None:
            return self._forward(ids, kv)
        width = window_bucket(kv.kv_len, self.config.smallest_window, self.max_seq_len)
        self.windows[width] += 1
        kv = KVBatch(kv.slots, kv.positions, width)
        cache = self.graph_cache if self.use_graphs else None
        size = cache.size_for(ids.shape[0]) if cache is not None else None
        if cache is None or size is None:
            return self._step_forward(ids, kv, None)
        return cache.run(ids, kv, size)

    def _step_forward(self, ids: torch.Tensor, kv: KVBatch,
                      before_layer: Callable[[int], None] | None) -> torch.Tensor:
        """A decode step's forward: fused layer functions (`before_layer(n)` first), or HF's."""
        if self.fused is not None:
            return self.fused.forward(ids, kv, before_layer)
        return self._forward(ids, kv)

    def check_chunk(self, chunk: PrefillChunk) -> None:
        """ValueError naming what is wrong with a prefill chunk (slot, start, window, ids)."""
        check_chunk(chunk, self.cache, self.max_seq_len, self.vocab_size)

    def _joined(self, layout: StepLayout, logits: list[torch.Tensor], greedy: bool,
                experts: contextlib.AbstractContextManager[None] | None = None) -> StepOutput:
        """Checked chunks and decode rows in ONE forward pass (one expert call per MoE layer);
        chunks' logits into `logits` (by chunk index); returns the decode rows' logits or tokens.
        `experts`: where the pass's experts run (None: the planner's prefill pass)."""
        ids, kv = layout.tensors(self.device)  # [B, S] or [1, T]
        # CPU, streamed to the GPU or split (EngineConfig.prefill_experts; prefill_planner.py)
        if experts is None:
            experts = contextlib.nullcontext() if self.planner is None else \
                self.planner.prefill_pass(ids.numel(), self.config.prefill_experts)
        with self._phase(decoding=False, slots=layout.row_slots), experts:
            hidden = self._forward(ids, kv)  # [B, S, H] or [1, T, H]
        layout.advance(self.lengths)
        rows, decode = layout.split(hidden)
        out = self.model.lm_head(torch.cat([*rows, decode])).float()  # [sum T + Bd, V]
        return layout.output(out, logits, greedy)

    def _forward(self, ids: torch.Tensor, kv: KVBatch | RaggedKV) -> torch.Tensor:
        """ids [B, S] -> final hidden states [B, S, H] (after the last norm), HF layers (a
        `RaggedKV`'s ids [1, T]: its parts end to end)."""
        hidden = self.base.embed_tokens(ids)
        rotary = self.base.rotary_emb(hidden, kv.positions)
        return decoder_stack(self.base, hidden, rotary, kv)
