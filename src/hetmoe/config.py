"""Engine options: one frozen dataclass, the single source of defaults for `LLM` and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFILL_EXPERTS = ("auto", "cpu", "gpu", "split")
DEFER_ORDERS = ("score", "misses")
"""Which experts Expert Deferral defers (ops/deferral.py)."""
DEFAULT_DEFER_ORDER = "misses"
"""The order every default names (measured as fast or faster than "score" at every budget)."""
DEFAULT_MAX_BATCH = 8
"""KV slots unless asked: a fixed count (auto would size the KV cache first, taking GPU room from
auto-resident experts, and capture more CUDA graphs at start); also what `hetmoe info` plans."""


@dataclass(frozen=True)
class EngineConfig:
    """Options of `hetmoe.LLM(model, device, rules, **options)`; checked when built."""

    dtype: str = "auto"
    """Weights and activations dtype: auto (the checkpoint's), float32, bfloat16 or float16."""
    max_seq_len: int | None = None
    """Context window per sequence (prompt + generated); None: the model's, capped at 4096."""
    max_batch: int | str = DEFAULT_MAX_BATCH
    """KV-cache slots, i.e. sequences decoded together at most; "auto": as many slots of the
    context window as fit the memory the weights leave, at most 256, sized by `LLM` from the
    injected skeleton before any weight is read (engine/model/kv_fit.py `engine_fit`)."""
    experts: str | None = None
    """Routed-expert backend for every MoE layer (`torch`, `cpu`); None: as the rules say."""
    torch_threads: int | None = None
    """CPU-device runs: torch's intra-op threads beside the CPU expert pool; None: the cores the
    pool leaves free (at least 1), so torch and the spinning pool never fight for a core."""
    deferred: int | str = 0
    """GPU decode with CPU experts: Expert Deferral, each token's `deferred` lowest-scored experts
    per MoE layer join the next layer's output while its attention runs (0: exact decode);
    "auto": chosen when the model loads from measured step times and guarded by a probe's KL
    (engine/model/deferral_auto.py; 0 without a GPU)."""
    defer_order: str = DEFAULT_DEFER_ORDER
    """Which experts Expert Deferral defers (ops/deferral.py): "misses", each token's
    lowest-scored CPU misses only, at most `deferred`, resident GPU experts always at once (with
    none resident the same as "score"; with every expert resident nothing is deferred; as fast or
    faster than "score" at every measured budget, docs/benchmarks/gpu_experts.md); "score", its
    lowest-scored whatever runs them (the KTransformers paper's rule)."""
    compile_decode: bool = True
    """GPU decode with CPU experts: compile the per-layer decode step with torch.compile (needs
    Triton and a C compiler); False runs the same functions uncompiled."""
    fused_decode: bool = True
    """GPU decode with CPU experts through one function per decoder layer
    (engine/executor/fused_decode.py) when the model fits; False runs the HF decoder layers (as
    `LLM` always does on the CPU device)."""
    cuda_graphs: bool = True
    """GPU decode with CPU experts: replay decode steps as CUDA graphs (False: the same steps
    launched eagerly, for debugging)."""
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Decode batch sizes that get a CUDA graph (a batch is padded to the next one); beyond
    the largest, doublings up to `max_batch` get one too (engine/executor/graphs.py
    `graph_sizes`)."""
    smallest_window: int = 256
    """Smallest attention window bucket of a decode step with CPU experts
    (engine/executor/graphs.py); at least 2; >= the context window: always the whole window."""
    prefill_experts: str = "auto"
    """GPU with CPU experts: where a prefill runs each MoE layer's routed experts. "auto": by
    this machine's measured costs (hetmoe.calibration; measured once and stored), on the CPU,
    streamed to the GPU layer by layer from the packed host copy (bf16, int8, int4 or fp8;
    engine/placement/layer_stream.py), or split: the first experts of each layer streamed and
    computed on the GPU while the CPU computes the rest (engine/placement/expert_split.py); "cpu",
    "gpu" (every expert streamed) or "split" force one."""
    stream_decode_rows: int | str = "auto"
    """GPU with CPU experts: decode steps of at least this many rows (no prompt chunks) may run
    as a pass of the prefill planner, the first misses of each MoE layer streamed to the GPU
    while the CPU computes the rest, under `prefill_experts`' mode (engine/executor/
    prefill_planner.py `decode_experts`); in "auto" mode its tuner times such steps against the
    decode path (CUDA graphs) per row bucket and keeps the faster. "auto", the default: from the
    fewest rows at which this machine's cost model expects the split at most `DECODE_GAIN` of the
    CPU's time, never at 8 rows or fewer nor with `prefill_experts` "gpu" (which would stream
    every miss: give a row count for that) (engine/placement/expert_split.py); on an H100 box
    (2026-11-28, INT8, budget 0) it decoded 64 and 128 streams at 198 and 357 tok/s against 170
    and 295 without it, and 32 streams (below its 40 rows) alike (docs/benchmarks/serve.md);
    0: never; N: from N rows."""
    prefill_resident_bytes: int = 0
    """Deprecated: the former name of `gpu_expert_bytes` (bytes): when set, it replaces a
    `gpu_expert_bytes` of "auto" or 0 (the resident experts serve prefill and decode alike)."""
    gpu_expert_bytes: int | str = "auto"
    """Routed experts resident on the GPU, computed there (engine/placement/slots.py): "auto" = the
    GPU memory left after the other weights, KV cache, graphs, prefill staging and a margin
    (none without a GPU); bytes (clamped to that room, with a warning); 0: every expert on the
    CPU (what benchmarks of the CPU path pass)."""
    placement_interval: int = 0
    """Resident experts follow the routing: every this many decode steps the most routed
    experts are promoted into the slots of the least routed (engine/placement/placement_policy.py);
    0: the placement stays as planned."""
    fetch_slots: int = 0
    """Fetch-or-compute (engine/placement/placement_fetch.py): GPU staging slots, one expert's
    packed bytes each and on top of `gpu_expert_bytes`, into which a step outside CUDA graphs (a
    prefill chunk on the CPU path, eager batched decode) copies the CPU misses whose tokens make
    the GPU finish them sooner (engine/placement/fetch_plan.py, this machine's measured costs); 0:
    every miss on the CPU."""
    graph_split_layer: int = 4
    """Fused decode graphs are captured as two, split before this decoder layer (0 or beyond
    the last layer: one graph), so the GPU starts while the CPU still launches the rest."""
    prefill_chunk: int | None = 4096
    """Prompt tokens prefilled per step while other requests decode (a decode step runs between
    chunks, so a long prompt stalls them one chunk at a time); None: a prompt at once."""
    prefix_cache: bool = True
    """Reuse the KV cache of earlier requests (kept in their slots) for a new prompt that starts
    with the same tokens (engine/requests/prefix_cache.py). Exact with torch experts in float32; the
    C++ CPU experts (and, in bf16, torch's matmuls) round by how many tokens a call carries, so a
    cached prefix may differ in the last bits and a near tie may flip a greedy token (off for
    bit-reproducible evaluation)."""
    verbose: bool = False
    """Print the injection report (what was replaced, on which device) after loading."""
    progress: bool = True
    """Show the loader's progress bar."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"option dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"option max_seq_len must be positive, got {self.max_seq_len}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"option torch_threads must be positive, got {self.torch_threads}")
        if self.deferred != "auto" and (not isinstance(self.deferred, int)
                                        or isinstance(self.deferred, bool) or self.deferred < 0):
            raise ValueError(f"option deferred must be 'auto' or an integer >= 0, got "
                             f"{self.deferred!r}")
        if self.defer_order not in DEFER_ORDERS:
            raise ValueError(f"option defer_order must be one of {', '.join(DEFER_ORDERS)}, got "
                             f"{self.defer_order!r}")
        if self.max_batch != "auto" and (not isinstance(self.max_batch, int)
                                         or isinstance(self.max_batch, bool) or self.max_batch < 1):
            raise ValueError(f"option max_batch must be 'auto' or a positive integer, got "
                             f"{self.max_batch!r}")
        sizes = self.graph_batch_sizes
        if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"option graph_batch_sizes must be positive integers, got {sizes!r}")
        if self.prefill_experts not in PREFILL_EXPERTS:
            raise ValueError(f"option prefill_experts must be one of "
                             f"{', '.join(PREFILL_EXPERTS)}, got {self.prefill_experts!r}")
        if self.stream_decode_rows != "auto" and (not isinstance(self.stream_decode_rows, int)
                                                  or isinstance(self.stream_decode_rows, bool)
                                                  or self.stream_decode_rows < 0):
            raise ValueError(f"option stream_decode_rows must be 'auto' or an integer >= 0 "
                             f"(0: never), got {self.stream_decode_rows!r}")
        if not isinstance(self.prefill_resident_bytes, int) or self.prefill_resident_bytes < 0:
            raise ValueError(f"option prefill_resident_bytes must be an integer >= 0, got "
                             f"{self.prefill_resident_bytes!r}")
        if self.gpu_expert_bytes != "auto" and (not isinstance(self.gpu_expert_bytes, int)
                                                or self.gpu_expert_bytes < 0):
            raise ValueError(f"option gpu_expert_bytes must be 'auto' or an integer >= 0, got "
                             f"{self.gpu_expert_bytes!r}")
        if self.prefill_resident_bytes and self.gpu_expert_bytes in ("auto", 0):
            # The former name, still honoured: a budget set under it wins over the default.
            object.__setattr__(self, "gpu_expert_bytes", self.prefill_resident_bytes)
        if not isinstance(self.placement_interval, int) or self.placement_interval < 0:
            raise ValueError(f"option placement_interval must be an integer >= 0, got "
                             f"{self.placement_interval!r}")
        if not isinstance(self.fetch_slots, int) or self.fetch_slots < 0:
            raise ValueError(f"option fetch_slots must be an integer >= 0, got "
                             f"{self.fetch_slots!r}")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int)
                                               or self.prefill_chunk < 1):
            raise ValueError(f"option prefill_chunk must be None or a positive integer, got "
                             f"{self.prefill_chunk!r}")
        if not isinstance(self.graph_split_layer, int) or self.graph_split_layer < 0:
            raise ValueError(f"option graph_split_layer must be an integer >= 0, got "
                             f"{self.graph_split_layer!r}")
        if not isinstance(self.smallest_window, int) or self.smallest_window < 2:
            # A compiled dimension of width 1 would be specialized, not dynamic.
            raise ValueError(f"option smallest_window must be an integer >= 2, got "
                             f"{self.smallest_window!r}")

    def check_deferred(self, device: str, cpu_experts: bool) -> None:
        """`deferred` against the run it is for, before any model work: GPU decode (`device`)
        with every MoE layer's routed experts in the cpu backend (`cpu_experts`). Its bound by
        the router's top-k is checked where the MoE step is made (ops/deferral.py). "auto" fits
        any run (it picks 0 where deferral cannot run)."""
        if not self.deferred or self.deferred == "auto":
            return
        if device != "cuda":
            raise ValueError(
                f"option deferred={self.deferred} needs GPU decode with every MoE layer's routed "
                f"experts in the cpu backend; this run decodes on {device} (use deferred=0)")
        if not cpu_experts:
            raise ValueError(f"option deferred={self.deferred} needs every MoE layer's routed "
                             "experts in the cpu backend (use deferred=0)")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Builds the config from keyword options, naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown LLM option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)
