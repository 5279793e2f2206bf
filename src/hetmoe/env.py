"""Every environment variable hetmoe reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def _get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def cache_dir() -> Path:
    """Where built-in models are built on first use (HETMOE_CACHE_DIR, else ~/.cache/hetmoe)."""
    base = _get("HETMOE_CACHE_DIR") or os.path.join(
        _get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hetmoe"
    )
    return Path(base)


def forced_isa() -> str | None:
    """HETMOE_ISA=amx|avx512|avx2|scalar caps the CPU kernels used (tests, debugging)."""
    return _get("HETMOE_ISA")


def numa_groups() -> int | None:
    """HETMOE_NUMA_GROUPS=N forces N virtual NUMA groups (testing NUMA TP on one node)."""
    value = _get("HETMOE_NUMA_GROUPS")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HETMOE_NUMA_GROUPS must be a positive integer, got {value!r}")
    return int(value)


def cpu_threads() -> int | None:
    """HETMOE_THREADS=N sets the CPU expert pool size (default: all cores but one)."""
    value = _get("HETMOE_THREADS")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HETMOE_THREADS must be a positive integer, got {value!r}")
    return int(value)


def hf_endpoint() -> str | None:
    """HF_ENDPOINT: the Hub (or a mirror) model names are fetched from (None: huggingface.co).
    Read at each call, unlike huggingface_hub's import-time constant."""
    value = _get("HF_ENDPOINT")
    return value.rstrip("/") if value else None


def hf_hub_cache() -> Path:
    """The Hugging Face cache shared with transformers: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    cache = _get("HF_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = _get("HF_HOME") or os.path.join(
        _get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hf_offline() -> bool:
    """HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1): Hub names resolve from the cache only."""
    value = _get("HF_HUB_OFFLINE") or _get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "on", "yes", "true")


def gpu_expert_kernel() -> str:
    """HETMOE_GPU_EXPERTS=packed|unpack: how GPU prefill computes routed experts on their packed
    bytes: the Triton kernels that read them directly (packed, the default where Triton runs)
    or the torch unpack to bf16 + grouped GEMM (unpack: the reference, and A/B benchmarks)."""
    value = _get("HETMOE_GPU_EXPERTS", "packed")
    if value not in ("packed", "unpack"):
        raise ValueError(f"HETMOE_GPU_EXPERTS must be packed or unpack, got {value!r}")
    return value


def gpu_expert_math() -> str:
    """HETMOE_GPU_EXPERT_MATH=bf16|quantized: the packed kernels' sorted (prefill) path with
    weights dequantized to bf16 (bf16, the default) or, opt-in, x and the intermediate quantized
    per (row, group) onto int8 / fp8 tensor cores (quantized: int8 and fp8 models only, others
    refused by name; kernels/act_quant.py, its error stated there). Read once, when a runner's
    `MoEOverlap` is built."""
    value = _get("HETMOE_GPU_EXPERT_MATH", "bf16")
    if value not in ("bf16", "quantized"):
        raise ValueError(f"HETMOE_GPU_EXPERT_MATH must be bf16 or quantized, got {value!r}")
    return value


def decode_kernels() -> str:
    """HETMOE_DECODE_KERNELS=triton|torch: the fused decode step's GQA layers on a CUDA GPU: with
    the Triton kernels (kernels/gqa_decode.py, kernels/moe_router.py; the default: Qwen3-30B-A3B
    shape on an H100, a layer 63.8 -> 38.4 us and 22 -> 8 kernels, all-resident decode 165.7 ->
    212.5 tok/s, docs/benchmarks/gpu_kernels.md round 5) or all in torch ops compiled by
    Inductor (ops/fused.py). Without a GPU: torch ops."""
    value = _get("HETMOE_DECODE_KERNELS", "triton")
    if value not in ("triton", "torch"):
        raise ValueError(f"HETMOE_DECODE_KERNELS must be triton or torch, got {value!r}")
    return value


def dependent_launch() -> str:
    """HETMOE_DEPENDENT_LAUNCH=on|off|always: the decode step's Triton kernels launch as
    programmatic dependents on GPUs of compute capability 9.0+ (each starts while the one before
    it drains: kernels/pdl.py) where every routed expert is GPU-resident (on, the default),
    never (off), or also in steps with CPU experts (always: measured slower there, kept to
    measure it again)."""
    value = _get("HETMOE_DEPENDENT_LAUNCH", "on")
    if value not in ("on", "off", "always"):
        raise ValueError(f"HETMOE_DEPENDENT_LAUNCH must be on, off or always, got {value!r}")
    return value
