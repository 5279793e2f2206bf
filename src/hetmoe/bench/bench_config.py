"""`BenchConfig`: what a `hetmoe bench` run builds and measures, and its modes (`MODES`); read by
bench/harness.py's `run_bench` and bench/decode_modes.py's decode measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetmoe.config import DEFAULT_DEFER_ORDER, DEFER_ORDERS

MODES = ("cpu", "torch-cpu", "accelerate")


@dataclass(frozen=True)
class BenchConfig:
    """What `hetmoe bench` builds and measures."""

    shape: str | None = None
    """Random-weight shape (bench/shapes.py); or `model`."""
    model: str | None = None
    """Checkpoint directory or preset (experts as its rules say; mode cpu only)."""
    experts: str = "cpu"
    """Mode: cpu (ours), torch-cpu or accelerate (baselines)."""
    weight_format: str = "bf16"
    """Routed-expert format in the CPU backend: bf16, int8, int4."""
    prompt_len: int = 32
    """Prompt tokens before decode."""
    new_tokens: int = 256
    """Tokens generated per decode run (the first step is not timed)."""
    prefill_lengths: tuple[int, ...] = (128, 1024, 4096)
    """Prompt lengths whose prefill speed is measured."""
    deferred: tuple[int, ...] = (0,)
    """Expert Deferral values timed in graph mode."""
    defer_order: str = DEFAULT_DEFER_ORDER
    """Which experts those values defer (`EngineConfig.defer_order`)."""
    eager: bool = True
    """Also time decode in eager mode and count launches in both modes."""
    alternatives: bool = True
    """With `eager`: also time graph decode through the HF layers."""
    trace: str | None = None
    """Chrome trace file of a few eager decode steps."""
    num_layers: int | None = None
    """Fewer decoder layers than the shape's (None: all)."""
    seed: int = 0
    """Seed of the random weights and prompts."""
    bandwidth_gib: float = 2.0
    """Size of the host read-bandwidth probe (well beyond the last-level cache)."""
    gpu_expert_bytes: int | str = "auto"
    """Routed experts resident on the GPU (`EngineConfig.gpu_expert_bytes`: auto, what a user
    gets; 0: every expert on the CPU, what scripts timing the CPU path pass)."""

    def __post_init__(self) -> None:
        if (self.shape is None) == (self.model is None):
            raise ValueError("bench takes a MODEL or --random-weights SHAPE (exactly one)")
        if self.model is not None and self.experts != "cpu":
            raise ValueError(f"--experts {self.experts} needs --random-weights SHAPE")
        if self.experts not in MODES:
            raise ValueError(f"experts must be one of {', '.join(MODES)}, got {self.experts!r}")
        if self.defer_order not in DEFER_ORDERS:
            raise ValueError(f"defer_order must be one of {', '.join(DEFER_ORDERS)}, got "
                             f"{self.defer_order!r}")
        if self.new_tokens < 3 or self.prompt_len < 1:
            raise ValueError("bench needs prompt_len >= 1 and new_tokens >= 3 (first step untimed)")
