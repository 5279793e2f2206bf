"""Device checks of the hybrid runtime on baby models (needs CUDA): what CI cannot run. Run by
`pytest -m device tests/engine/test_graph_device.py`, and as a script that prints the rows and
writes JSON by `python benchmarks/engine/check_graph_device.py`.

For every family's baby model (fp32, routed experts in the C++ CPU backend, the rest on the GPU):
- CUDA-graph decode and eager decode give identical tokens (batch 1, and batch 3 padded to 4),
  with and without Expert Deferral;
- the graph path equals the plain runner on the same model (no overlap, no graphs) within fp32
  rounding, and the torch-experts reference in tokens and within bf16-kernel tolerance;
- graph decode with deferral equals the pure-torch deferral reference on the same model;
- a step that raises after its CPU jobs were queued releases them (abort), and the next step
  decodes the same tokens;
- decode through the compiled fused layer functions (engine/executor/fused_decode.py, the default)
  and through the HF layers give the same tokens and logits within fp32 rounding (batch 1 and 3,
  with and without deferral), and so do the fused step with its Triton kernels
  (kernels/gqa_decode.py, kernels/moe_router.py: the default) and in torch ops; GPU kernels per
  token of each;
- attention over window buckets (a cache of 300 entries: 32, 64, 128, 256, 300) in graph mode,
  decoding across every bucket boundary up to a full window, batch 1 and 3: the same tokens as
  eager decode with the same buckets (logits within fp32 rounding at batch 1) and as graph
  decode over the whole window (logits within summation-order noise); one graph captured per
  (batch size, bucket) and no compile per bucket (the window's chunk count is a dynamic
  dimension); capture time per graph;
- greedy steps launched ahead (`ModelRunner.greedy`, what greedy requests run) give the tokens
  of the decode loop, stopping early discards the step launched ahead, and a `limit` ends the
  steps without launching one beyond it;
- no CPU job reported an error; launches per token in both modes.

A row is filled as each number is measured (the script prints each entry then, with its verdict);
a section that raises is recorded as `error_<section>` (a failure) and the next one runs, so one
run tells every check even if a later one fails or the run is cut. Where two runs' tokens differ,
`<key>_diverged` says where, with the reference's top-2 logit gap there (a near-tie flips on
rounding; a real fault flips a decisive token).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from deferral_reference import DeferralReference
from graph_device_row import CompileLog, Decoded, Row, compare_tokens, max_delta, section

from hetmoe import LLM
from hetmoe.bench.measure import count_launches
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.fused_decode import FusedDecoder
from hetmoe.engine.executor.layer_plan import fits_fused
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.presets.tiny import build_tiny_model

PROMPTS = [[5, 9, 33, 100, 7], [11, 12, 13], [200, 3, 3, 40, 41, 42, 43]]
STEPS = 24


def decode(runner: ModelRunner, batch: int, reference: DeferralReference | None = None,
           steps: int = STEPS, after_step: Callable[[], None] | None = None) -> Decoded:
    """Greedy decode of the first `batch` prompts together; returns tokens and [B, V] logits.
    `after_step()` runs after each decode step."""
    slots = [runner.cache.allocate() for _ in range(batch)]
    try:
        tokens = [[int(runner.prefill(s, p).argmax())] for s, p in zip(slots, PROMPTS,
                                                                       strict=False)]
        logits = []
        for _ in range(steps):
            last = [t[-1] for t in tokens]
            if reference is None:
                out = runner.decode(slots, last)
            else:
                with reference.decoding():
                    out = runner.decode(slots, last)
            logits.append(out.float().cpu())
            for row, t in zip(out.argmax(-1).tolist(), tokens, strict=True):
                t.append(row)
            if after_step is not None:
                after_step()
        return tokens, logits
    finally:
        for s in slots:
            runner.free(s)


def greedy_ahead(runner: ModelRunner) -> list[int]:
    """`runner.greedy` (each step launched before the previous token is read) on the first
    prompt, as `decode` lays tokens out; then a run stopped after 3 tokens must leave the slot's
    length at the tokens it consumed (the step launched ahead discarded), and one with `limit=5`
    must give 5 tokens and launch none beyond. [] if it did not."""
    slot = runner.cache.allocate()
    try:
        tokens = [int(runner.prefill(slot, PROMPTS[0]).argmax())]
        steps = runner.greedy(slot, tokens[0])
        tokens += [next(steps) for _ in range(STEPS)]
        steps.close()
        if runner.lengths[slot] != len(PROMPTS[0]) + STEPS:
            return []
    finally:
        runner.free(slot)
    slot = runner.cache.allocate()
    try:
        steps = runner.greedy(slot, int(runner.prefill(slot, PROMPTS[0]).argmax()))
        early = [next(steps) for _ in range(3)]
        steps.close()
        if early != tokens[1:4] or runner.lengths[slot] != len(PROMPTS[0]) + 3:
            return []
    finally:
        runner.free(slot)
    slot = runner.cache.allocate()
    try:  # with a limit the generator ends by itself, no step launched beyond it
        steps = runner.greedy(slot, int(runner.prefill(slot, PROMPTS[0]).argmax()), limit=5)
        if list(steps) != tokens[1:6] or runner.lengths[slot] != len(PROMPTS[0]) + 5:
            return []
    finally:
        runner.free(slot)
    return tokens


def check_family(family: str, root: Path, row: Row | None = None) -> Row:
    """Every check on `family`'s baby model, into `row` (a dict by default) as each is measured;
    each section of checks goes on after another one raised (`graph_device_row.section`)."""
    row = {} if row is None else row
    row["family"] = family
    path = build_tiny_model(family, root / family)
    cpu = LLM(path, device="cuda", dtype="float32", experts="cpu", progress=False,
              max_seq_len=64, max_batch=4, gpu_expert_bytes=0)  # the CPU experts' path
    ref = LLM(path, device="cuda", dtype="float32", experts="torch", progress=False,
              max_seq_len=64, max_batch=4)
    top_k = int(cpu.model.config.num_experts_per_tok)
    row["top_k"] = top_k
    # The plain path: HF layers, each MoE layer's own step (backend submit/sync), no graphs.
    plain = ModelRunner(cpu.model, cpu.device, cpu.dtype, 4, cpu.max_seq_len,
                        EngineConfig(cuda_graphs=False, fused_decode=False, gpu_expert_bytes=0))
    if plain.overlap is None:
        raise RuntimeError(f"{family}: the plain runner has no MoE overlap to detach")
    plain.overlap.detach()
    plain.overlap = None
    references = decode(ref.runner, 1), decode(plain, 1)
    with section(row, "llm"):  # LLM on a GPU with CPU experts: overlap + graphs + fused decode
        row["llm_uses_graphs"] = cpu.runner.use_graphs
        row["llm_fused_as_planned"] = (cpu.runner.fused is not None) == fits_fused(cpu.model)
        generated = cpu.generate(PROMPTS[0], max_new_tokens=STEPS + 1).token_ids
        row["llm_generate_tokens"] = generated
        plain_tokens = references[1][0][0]
        row["graph_llm_generate_eq_plain_tokens"] = generated == plain_tokens[: len(generated)]
    for d in sorted({0, min(2, top_k - 2)}):
        with section(row, f"graphs_d{d}"):
            check_graphs(cpu, d, plain, references, row)
    with section(row, "fused"):
        check_fused(cpu, row)
    with section(row, "buckets"):
        check_buckets(cpu, row)
    with section(row, "abort"):
        row["graph_recovers_after_abort"] = check_abort(cpu)
    return row


def check_graphs(llm: LLM, d: int, plain: ModelRunner, references: tuple[Decoded, Decoded],
                 row: Row) -> None:
    """Graph decode with `d` deferred experts (graphs split before layer 1, as the real models'
    are before layer 4) against eager decode on the same runner (batch 1 and 3) and at d = 0
    `references` (the torch-experts reference's decode, the plain path's), else the pure-torch
    deferral reference on `plain`; greedy steps launched ahead; launches per token."""
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                         EngineConfig(deferred=d, graph_split_layer=1, gpu_expert_bytes=0))
    try:
        for batch in (1, 3):
            runner.use_graphs = True
            graph = decode(runner, batch)
            runner.use_graphs = False
            eager = decode(runner, batch)
            compare_tokens(row, f"graph_eq_eager_b{batch}_d{d}", graph, eager)
            row[f"graph_vs_eager_max_dlogit_b{batch}_d{d}"] = max_delta(graph[1], eager[1])
        runner.use_graphs = True
        ours = decode(runner, 1)
        row[f"graph_greedy_ahead_eq_decode_d{d}"] = greedy_ahead(runner) == ours[0][0]
        if d == 0:
            reference, want = references
            compare_tokens(row, "graph_eq_plain_tokens", ours, want)
            row["graph_vs_plain_max_dlogit"] = max_delta(ours[1], want[1])
            compare_tokens(row, "graph_eq_torch_reference_tokens", ours, reference)
            row["graph_vs_torch_reference_max_dlogit"] = max_delta(ours[1], reference[1])
            graph_launches = count_launches(runner, PROMPTS[0], 4)
            runner.use_graphs = False
            row["launches"] = {"graph": graph_launches,
                               "eager": count_launches(runner, PROMPTS[0], 4)}
        else:
            runner.overlap.detach()
            reference = decode(plain, 1, DeferralReference(llm.model, d))
            compare_tokens(row, f"graph_d{d}_eq_reference_tokens", ours, reference)
            row[f"graph_d{d}_vs_reference_max_dlogit"] = max_delta(ours[1], reference[1])
    finally:
        runner.overlap.detach()


def check_fused(llm: LLM, row: Row) -> None:
    """Graph decode through the compiled fused layer functions vs through the HF layers (both
    CUDA graphs, same CPU experts): same tokens, logits within fp32 rounding, batch 1 and 3,
    with and without deferral; the same for the fused step with its Triton kernels (the default)
    vs in torch ops; kernels per token of each."""
    d_late = min(2, int(llm.model.config.num_experts_per_tok) - 2)
    for d in sorted({0, d_late}):
        runs = {}
        for name in ("module", "fused", "fused_torch_ops"):
            runner = ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                                 EngineConfig(deferred=d, fused_decode=name != "module",
                                              gpu_expert_bytes=0))
            if name == "fused":
                row["fused_used"] = runner.fused is not None
                row["fused_kernels"] = getattr(runner.fused, "kernels", None)
            if name == "fused_torch_ops" and runner.fused is not None:
                assert runner.overlap is not None
                runner.fused = FusedDecoder(llm.model, runner.overlap, True, "torch")
            try:
                runs[name] = [decode(runner, batch) for batch in (1, 3)]
                if d == 0:
                    row[f"kernels_per_token_{name}"] = count_launches(
                        runner, PROMPTS[0], 4)["gpu_kernels_per_token"]
            finally:
                runner.overlap.detach()
        for i, batch in enumerate((1, 3)):
            fused, module = runs["fused"][i], runs["module"][i]
            torch_ops = runs["fused_torch_ops"][i]
            compare_tokens(row, f"graph_fused_eq_module_b{batch}_d{d}", fused, module)
            row[f"fused_vs_module_max_dlogit_b{batch}_d{d}"] = max_delta(fused[1], module[1])
            compare_tokens(row, f"graph_fused_kernels_eq_torch_ops_b{batch}_d{d}", fused,
                           torch_ops)
            row[f"fused_kernels_vs_torch_ops_max_dlogit_b{batch}_d{d}"] = max_delta(
                fused[1], torch_ops[1])


BUCKET_MAX_SEQ_LEN = 300
"""Cache length of `check_buckets` (not a power of two; 2 to 5 window chunks of 64)."""
SMALLEST_WINDOW = 32
"""Smallest window bucket of `check_buckets` (the runtime's default is 256)."""


def check_buckets(llm: LLM, row: Row) -> None:
    """Decode across every window bucket boundary (32, 64, 128, 256, 300 = the cache length)
    in graph mode, batch 1 and 3 (the longest row from 8 to 299 cached entries), against eager
    decode with the same buckets and graph decode over the whole window; one graph per bucket,
    and no compile for a bucket once the whole-window run compiled the shapes (compiles are
    counted per graph captured: `bucket_compiles_by_graph_b*`)."""
    steps = BUCKET_MAX_SEQ_LEN - max(len(p) for p in PROMPTS) - 1
    compiles = {}
    for batch in (1, 3):
        runs = {}
        for name, smallest, graphs in (("whole", BUCKET_MAX_SEQ_LEN, True),
                                       ("buckets", SMALLEST_WINDOW, True),
                                       ("eager", SMALLEST_WINDOW, False)):
            runner = ModelRunner(llm.model, llm.device, llm.dtype, 4, BUCKET_MAX_SEQ_LEN,
                                 EngineConfig(smallest_window=smallest, gpu_expert_bytes=0))
            runner.use_graphs = graphs
            log = CompileLog(runner)
            try:
                runs[name] = decode(runner, batch, steps=steps, after_step=log)
            finally:
                runner.overlap.detach()
            if name == "buckets":
                size = 1 if batch == 1 else 4
                widths = sorted(runner.windows)
                row[f"bucket_widths_b{batch}"] = widths
                row[f"graph_one_per_bucket_b{batch}"] = sorted(runner.graphs) == [
                    (size, w) for w in widths] and widths == [32, 64, 128, 256, 300]
                compiles[batch] = log.total
                row[f"bucket_compiles_b{batch}"] = log.total
                row[f"bucket_compiles_by_graph_b{batch}"] = log.by_graph
                row[f"bucket_capture_ms_b{batch}"] = {
                    w: round(g.capture_s * 1e3, 2) for (_, w), g in sorted(runner.graphs.items())}
        buckets, eager, whole = runs["buckets"], runs["eager"], runs["whole"]
        compare_tokens(row, f"graph_buckets_eq_eager_b{batch}", buckets, eager)
        row[f"graph_vs_eager_max_dlogit_b{batch}_buckets"] = max_delta(buckets[1], eager[1])
        compare_tokens(row, f"graph_buckets_eq_whole_window_b{batch}", buckets, whole)
        row[f"buckets_vs_whole_window_max_dlogit_b{batch}"] = max_delta(buckets[1], whole[1])
    row["graph_buckets_no_compile"] = compiles[1] == compiles[3] == 0


class BrokenGraph:
    """Stands in for a captured graph whose launch fails."""

    def replay(self) -> None:
        raise RuntimeError("injected replay failure")


def check_abort(llm: LLM) -> bool:
    """A replay that raises after its CPU jobs were queued: the jobs are released, and decode
    afterwards gives the tokens of an undisturbed run."""
    # Split after the first layer: the broken last part is replayed once the jobs are queued.
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                         EngineConfig(graph_split_layer=1, gpu_expert_bytes=0))
    want, _ = decode(runner, 1)
    slot = runner.cache.allocate()
    try:
        last = int(runner.prefill(slot, PROMPTS[0]).argmax())
        runner.decode([slot], [last])  # captures the graph of batch 1 (and this step's window)
        (key,) = runner.graphs
        parts = runner.graphs[key].parts
        runner.graphs[key].parts = [*parts[:-1], BrokenGraph()]  # type: ignore[list-item]
        try:
            runner.decode([slot], [last])
            return False
        except RuntimeError as exc:
            if "injected replay failure" not in str(exc):
                raise
        runner.graphs[key].parts = parts
        released = not runner.overlap.pending and all(
            link.flags.ready == 0 and link.flags.done == 0 for link in runner.overlap.host)
    finally:
        runner.free(slot)
    again, _ = decode(runner, 1)
    runner.overlap.detach()
    return released and again == want
