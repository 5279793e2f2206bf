"""`CpuMoE`: the routed experts of one MoE layer, computed on the CPU by `hetmoe._cpu`.

Weights are packed (and quantized to INT8/INT4 if asked) into the C++ layout at load; `forward`
computes out[q, H] = sum_j w_j * down_e(silu(gate_e x) * up_e x) over the (expert, weight) pairs
of each token. Every argument is checked here, except the expert ids' range, which the C++
routing pass checks as it reads them; the C++ side receives raw pointers only. All
layers share one process-wide thread pool.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from hetmoe import env
from hetmoe.experts.call_check import check_call, check_ids
from hetmoe.experts.expert_weights import WEIGHT_FORMATS, ExpertWeights, check_group_size
from hetmoe.experts.packed_layout import PackedGroup

AMX_MIN_TOKENS = {"bf16": 2, "int8": 32, "int4": 32, "fp8": 8}
"""Tokens per expert from which AMX tiles beat AVX-512, per format (measured by
benchmarks/kernels/bench_cpu_moe.py on a 16-core Xeon with AMX: docs/benchmarks/cpu_moe.md; fp8's
in its FP8 section, `cpu_moe_fp8_r1.json`: 4 tokens 663 us AVX-512 against 851 AMX, 8 tokens 1,462
against 806)."""


def _release(state: dict[str, object]) -> None:
    """Drops a `CpuMoE`'s native layer and the calls that hold it (its state: `__dict__`)."""
    state.pop("_pending", None)
    state.pop("_layer", None)


@dataclass
class PendingCall:
    """A submitted call: keeps its tensors alive until `CpuMoE.sync` returns the output."""

    handle: int | None
    """The pool job's handle; None for a call of no tokens (nothing submitted). The pool's
    first job has handle 0, so 0 is a job like any other."""
    out: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    layer: object  # the C++ layer, alive until the job is done


class CpuMoE:
    """Routed experts of one layer on the CPU (see the module docstring).

    Args:
        num_experts: experts in the layer (E).
        hidden: model width H, any size: the packed weights are zero-padded inside (exact; x
            and out keep H columns, no copy per call).
        intermediate: expert width I, any size (zero-padded at load, exact).
        weight_format: "bf16", "int8" (symmetric groups), "int4" (asymmetric groups) or "fp8"
            (FP8 checkpoints' e4m3 weights and block scales as they are: loaded from
            float8_e4m3fn weights only).
        group_size: quantization group along the input dim (32, 64, 128 or 256, dividing H and I
            each rounded up to a multiple of 32); default 128 for int8 and fp8 (64 or 32 where
            128 does not divide), 32 for int4; must be None for bf16. Larger groups cost
            accuracy: int4 stays under 0.15 only up to 64. Fp8 groups must divide the
            checkpoint's scale blocks (128 for DeepSeek-V3).
        activation: only "silu".
        threads: pool workers; None = the process-wide pool (HETMOE_THREADS, else all cores
            but one). Layers with the same count share one pool.
        isa: cap on the kernel family ("amx", "avx512", "avx2", "scalar"); None = HETMOE_ISA,
            else the best this CPU runs.
        amx_min_tokens: tokens per expert from which AMX kernels are used; None = the measured
            crossover of the format (`AMX_MIN_TOKENS`).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        weight_format: str = "bf16",
        group_size: int | None = None,
        activation: str = "silu",
        threads: int | None = None,
        isa: str | None = None,
        amx_min_tokens: int | None = None,
    ) -> None:
        from hetmoe import _cpu  # the C++ extension may be absent (cpu_backend.unavailable)

        for name, value in (("num_experts", num_experts), ("hidden", hidden),
                            ("intermediate", intermediate)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CpuMoE: {name} must be a positive integer, got {value!r}")
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"CpuMoE: weight_format must be one of {sorted(WEIGHT_FORMATS)}, "
                f"got {weight_format!r}"
            )
        group_size = check_group_size(weight_format, group_size, hidden, intermediate)
        if activation != "silu":
            raise ValueError(f"CpuMoE: activation must be 'silu', got {activation!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"CpuMoE: threads must be None or a positive integer, got {threads!r}")
        if amx_min_tokens is None:
            amx_min_tokens = AMX_MIN_TOKENS[weight_format]
        _check_amx_min_tokens(amx_min_tokens)
        isa = isa if isa is not None else (env.forced_isa() or "auto")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.weight_format, self.group_size = weight_format, group_size
        self._weights = ExpertWeights(num_experts, hidden, intermediate)
        self._layer = _cpu.MoELayer(
            num_experts, hidden, intermediate, WEIGHT_FORMATS[weight_format], group_size or 0,
            isa, amx_min_tokens, threads or 0,
        )
        self._amx_min_tokens = amx_min_tokens
        self._loaded = torch.zeros(num_experts, dtype=torch.bool)
        self._gpu_mask: torch.Tensor | None = None
        self._pending: deque[PendingCall] = deque()
        self._lock = threading.Lock()
        self._bound: tuple[torch.Tensor, ...] = ()  # bind's buffers, kept alive
        self._late_out: torch.Tensor | None = None  # submit_flagged's deferred output
        # The native layer goes at exit too: a model's object graph has reference cycles (LLM and
        # its scheduler, MoE blocks and their overlap), which the interpreter may not collect
        # before it unloads hetmoe._cpu; nanobind then reports the layers as leaked.
        weakref.finalize(self, _release, self.__dict__)

    @property
    def isa(self) -> str:
        """The kernel family cap in use ("amx", "avx512", "avx2" or "scalar")."""
        return str(self._layer.isa)

    @property
    def amx_min_tokens(self) -> int:
        """Tokens per expert from which AMX kernels are used (settable; later calls use it)."""
        return self._amx_min_tokens

    @amx_min_tokens.setter
    def amx_min_tokens(self, tokens: int) -> None:
        _check_amx_min_tokens(tokens)
        self._amx_min_tokens = tokens
        self._layer.set_amx_min_tokens(tokens)

    @property
    def num_groups(self) -> int:
        """NUMA groups the intermediate dimension is split over."""
        return int(self._layer.num_groups)

    @property
    def packed_bytes(self) -> int:
        """Bytes of packed weights and scales of the loaded experts."""
        return int(self._layer.packed_bytes)

    def packed_groups(self) -> list[PackedGroup]:
        """Where each NUMA group's packed experts lie in host memory (experts/packed_layout.py
        reads them; GPU prefill copies them as they are)."""
        mapped = bool(self._layer.mapped)
        return [PackedGroup(*self._layer.group_memory(g), read_only=mapped)  # type: ignore[misc]
                for g in range(self.num_groups)]

    def map_file(self, path: str, offsets: list[int], populate: bool = False) -> None:
        """Serves every expert from read-only mappings of `path` (group g's `packed_groups()`
        bytes at offsets[g], as `hetmoe convert` wrote them): no packing, no copy. Not while
        a submitted call of this layer is in flight (the layer's own memory is released)."""
        self._layer.map_file(str(path), [int(o) for o in offsets], populate)
        self._loaded[:] = True

    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             gate_scale: torch.Tensor | None = None, up_scale: torch.Tensor | None = None,
             down_scale: torch.Tensor | None = None,
             fp8_block: tuple[int, int] = (128, 128)) -> None:
        """Packs all experts: gate/up [E, I, H], down [E, H, I] (bf16/fp16/fp32, or FP8 e4m3
        with block scales `*_scale` [E, ceil(rows/B0), ceil(cols/B1)], B = `fp8_block`; the fp8
        format keeps them as they are, other formats dequantize them first)."""
        self._weights.check_stacked(gate, up, down, gate_scale, up_scale, down_scale)
        for e in range(self.num_experts):
            gs, us, ds = (s[e] if s is not None else None for s in (gate_scale, up_scale,
                                                                     down_scale))
            self.load_expert(e, gate[e], up[e], down[e], gs, us, ds, fp8_block=fp8_block)

    def load_expert(self, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                    gate_scale: torch.Tensor | None = None, up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None,
                    fp8_block: tuple[int, int] = (128, 128)) -> None:
        """Packs one expert: gate/up [I, H], down [H, I]; FP8 weights need their block scales.
        Not while a submitted call of this layer is in flight."""
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(
                f"CpuMoE.load_expert: expert must be in [0, {self.num_experts}), got {expert!r}"
            )
        weights, scales = (gate, up, down), (gate_scale, up_scale, down_scale)
        if self.weight_format == "fp8":
            assert self.group_size is not None
            codes, block_scales = self._weights.prepare_fp8(expert, weights, scales, fp8_block,
                                                            self.group_size)
            self._layer.load_expert_fp8(expert, *(t.data_ptr() for t in codes),
                                        [s.data_ptr() for s in block_scales], *fp8_block)
        else:
            src = self._weights.prepare(expert, weights, scales, fp8_block)
            code = 0 if src[0].dtype == torch.bfloat16 else 1
            self._layer.load_expert(expert, *(t.data_ptr() for t in src), code)
        self._loaded[expert] = True

    def set_gpu_experts(self, mask: torch.Tensor | None) -> None:
        """Marks experts that live on the GPU (bool [E]); they are skipped here. None clears.
        Calls submitted earlier keep the mask they were routed with; not thread-safe against a
        concurrent submit."""
        if mask is None:
            self._gpu_mask = None
            self._layer.set_gpu_mask(0)
            return
        if not isinstance(mask, torch.Tensor) or mask.shape != (self.num_experts,):
            found = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"CpuMoE.set_gpu_experts: mask must be a bool tensor [{self.num_experts}], "
                f"found {found}"
            )
        self._gpu_mask = mask.detach().to("cpu", torch.uint8).contiguous()
        self._layer.set_gpu_mask(self._gpu_mask.data_ptr())

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """out[q, H] (dtype of x) = sum_j w_j * expert_{ids_j}(x); ids of -1 are skipped."""
        out, args = self._check_call(x, expert_ids, expert_weights, out)
        if args[4]:  # q
            try:
                self._layer.forward(*args)
            except IndexError:  # the routing pass refused an id: name it as every check here
                self._check_ids(expert_ids)
                raise
        return out

    __call__ = forward

    def submit(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
               out: torch.Tensor | None = None) -> PendingCall:
        """Starts `forward` on the pool and returns at once; `sync` returns the output."""
        out, args = self._check_call(x, expert_ids, expert_weights, out)
        try:
            handle = self._layer.submit(*args) if args[4] else None
        except IndexError:  # the routing pass refused an id (see forward)
            self._check_ids(expert_ids)
            raise
        call = PendingCall(handle, out, (x, expert_ids, expert_weights), self._layer)
        with self._lock:
            self._pending.append(call)
        return call

    def sync(self, call: PendingCall | None = None) -> torch.Tensor:
        """Waits for `call` (default: the oldest pending submit) and returns its output."""
        with self._lock:
            if call is None:
                if not self._pending:
                    raise RuntimeError("CpuMoE.sync: no submitted call is pending")
                call = self._pending.popleft()
            elif call in self._pending:
                self._pending.remove(call)
            else:
                raise RuntimeError("CpuMoE.sync: this call was already synced or is not ours")
        if call.handle is not None:
            self._layer.wait(call.handle)
        return call.out

    def bind(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
             out: torch.Tensor) -> None:
        """Binds fixed (pinned) CPU buffers, checked as in `forward`: every later
        `submit_flagged` job computes `forward` on what they hold when its ready word is set
        (a GPU stream writes them first)."""
        out, args = self._check_call(x, expert_ids, expert_weights, out)
        if args[4] == 0:
            raise ValueError("CpuMoE.bind: x must have at least one token")
        self._layer.bind_call(*args)
        self._bound = (x, expert_ids, expert_weights, out)

    def submit_flagged(self, flags: object, deferred: int = 0, late_flags: object = None,
                       late_out: torch.Tensor | None = None) -> int:
        """Queues `forward` on the buffers bound by `bind` as a job that a GPU stream
        starts and awaits through `flags` (a `hetmoe._cpu.StreamFlags`): it waits in the pool
        for the ready word, then sets the done word. Returns the handle for `wait_flagged`.

        With `deferred` > 0 (Expert Deferral) that job computes each token's first k - deferred
        slots only; the same job then computes the last `deferred` slots into `late_out` (shaped
        like the bound out) and sets `late_flags`' done word."""
        if not self._bound:
            raise RuntimeError("CpuMoE.submit_flagged: call bind(x, ids, weights, out) first")
        if not deferred:
            return int(self._layer.submit_flagged(flags))
        out = self._bound[3]
        k = self._bound[1].shape[1]
        if not 0 < deferred < k:
            raise ValueError(f"CpuMoE.submit_flagged: deferred must be in [0, {k}) (the bound "
                             f"ids' slots), got {deferred}")
        if late_flags is None or late_out is None:
            raise ValueError("CpuMoE.submit_flagged: deferred experts need late_flags and "
                             "late_out")
        if (late_out.shape != out.shape or late_out.dtype != out.dtype
                or late_out.device.type != "cpu" or not late_out.is_contiguous()):
            raise ValueError(f"CpuMoE.submit_flagged: late_out must be a contiguous CPU tensor "
                             f"like the bound out ({tuple(out.shape)}, {out.dtype}), got "
                             f"{tuple(late_out.shape)}, {late_out.dtype} on {late_out.device}")
        self._late_out = late_out  # kept alive while the job may write it
        return int(self._layer.submit_flagged(flags, deferred, late_flags, late_out.data_ptr()))

    def wait_flagged(self, handle: int) -> None:
        """Waits for a `submit_flagged` job; raises the error its routing or a task hit."""
        self._layer.wait(handle)

    def _check_call(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    out: torch.Tensor | None) -> tuple[torch.Tensor, tuple[int, ...]]:
        return check_call(self.hidden, x, ids, weights, out)

    def _check_ids(self, ids: torch.Tensor) -> None:
        check_ids(self.num_experts, ids)


def _check_amx_min_tokens(tokens: object) -> None:
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"CpuMoE: amx_min_tokens must be a positive integer, got {tokens!r}")
