"""Models of real shape with random weights, built on the fly: no checkpoint, one copy of a weight.

`build_random_model(config, device, ...)` builds the meta skeleton, injects the family's shipped
rules, then gives every tensor random values where it lives: GPU modules on `device`, routed
experts layer by layer through the expert backend's `load_tensor` (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`). A layer's experts are drawn on the GPU when there is one (fast), copied to
one reusable pinned staging buffer and packed by the backend from there, so host memory holds the
packed experts plus one layer's staging, never a second copy of the model. Weights are N(0, 0.02)
like HF's initializer, except the token embeddings and the residual projections (`weight_std`:
so routers spread tokens over the experts as trained ones do); norms are 1, biases 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from hetmoe.experts.backend import ExpertBackend, backends
from hetmoe.experts.torch_backend import TorchExperts
from hetmoe.inject.apply import apply_rules
from hetmoe.inject.registry import OpContext
from hetmoe.inject.rules import load_rules, shipped_rules_path
from hetmoe.loading.materialize import rebuild_computed_buffers
from hetmoe.loading.skeleton import build_skeleton
from hetmoe.ops.moe import moe_layers

log = logging.getLogger(__name__)

STD = 0.02
"""Standard deviation of random weights (HF's `initializer_range`)."""

EXPERT_KINDS = ("cpu", "torch-cpu")
"""Where routed experts go: the C++ CPU backend, or plain torch on the CPU (the baseline)."""


def build_random_model(
    config: Any,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    experts: str = "cpu",
    weight_format: str = "bf16",
    seed: int = 0,
) -> nn.Module:
    """An injected causal LM of `config`'s shape with random weights (see the module doc)."""
    if experts not in EXPERT_KINDS:
        raise ValueError(f"experts must be one of {EXPERT_KINDS}, got {experts!r}")
    if experts == "cpu" and "cpu" not in backends():
        raise ValueError("experts='cpu' needs the C++ CPU backend (hetmoe._cpu), not built here")
    if experts == "torch-cpu" and weight_format != "bf16":
        raise ValueError(f"plain-torch experts are bf16 only, got weight_format={weight_format!r}")
    started = time.perf_counter()
    model = build_skeleton(config, dtype)
    rules = load_rules(shipped_rules_path(config.model_type))
    apply_rules(model, rules, OpContext(device, dtype, config, "cpu"))
    layers = moe_layers(model)
    for moe in layers:
        moe.experts = _expert_backend(moe.experts, experts, weight_format, dtype)
    gen_device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator(gen_device).manual_seed(seed)
    _fill_dense(model, device, generator, gen_device)
    staging: dict[str, torch.Tensor] = {}
    for i, moe in enumerate(layers):
        _fill_experts(moe.experts, generator, gen_device, dtype, staging)
        log.info("experts of MoE layer %d/%d ready (%.1f s)", i + 1, len(layers),
                 time.perf_counter() - started)
    rebuild_computed_buffers(model, device)
    return model.eval()


def _expert_backend(current: ExpertBackend, kind: str, weight_format: str,
                    dtype: torch.dtype) -> ExpertBackend:
    """The backend for one layer: the injected one, or the same spec elsewhere/quantized."""
    cpu = torch.device("cpu")
    if kind == "torch-cpu":
        return TorchExperts(current.spec, cpu, dtype)
    if weight_format == "bf16":
        return current
    return type(current)(current.spec, current.device, dtype, weight_format=weight_format)


def _fill_dense(model: nn.Module, device: torch.device, generator: torch.Generator,
                gen_device: torch.device) -> None:
    """Random values for every parameter/persistent buffer on meta outside expert backends."""
    owners = [name for name, m in model.named_modules() if isinstance(m, ExpertBackend)]
    config: Any = model.config
    num_layers = int(config.num_hidden_layers)
    for module_name, module in model.named_modules():
        if any(module_name == o or module_name.startswith(o + ".") for o in owners):
            continue
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or t.device.type != "meta":
                    continue
                if table is module._buffers and name in module._non_persistent_buffers_set:
                    continue  # computed at construction (rotary inv_freq): rebuilt afterwards
                std = weight_std(module_name, num_layers)
                value = random_tensor(name, t, generator, gen_device, std).to(device)
                table[name] = nn.Parameter(value, False) if isinstance(t, nn.Parameter) else value


def weight_std(module: str, num_layers: int) -> float:
    """Standard deviation of `module`'s random weight matrix. Token embeddings N(0, 1) and the
    projections that write into the residual stream N(0, STD / sqrt(2 layers)) (GPT-2's scaled
    init) keep each token's residual its own through depth: with STD everywhere, attention over
    random weights (near-uniform) soon adds the same vector to every position, and every
    token's router then picks the same few experts (16.7 distinct experts per layer per 512
    tokens on the Qwen3-30B-A3B shape; a trained router spreads them)."""
    last = module.rsplit(".", 1)[-1]
    if last == "embed_tokens":
        return 1.0
    if last in ("o_proj", "down_proj"):
        return STD / (2 * num_layers) ** 0.5
    return STD


def random_tensor(name: str, t: torch.Tensor, generator: torch.Generator,
                  gen_device: torch.device, std: float = STD) -> torch.Tensor:
    """Random values for meta tensor `t` named `name`: N(0, std) matrices, unit norms, zero bias."""
    if t.dim() >= 2 and t.is_floating_point():
        out = torch.empty(t.shape, dtype=torch.float32, device=gen_device)
        return out.normal_(0.0, std, generator=generator).to(t.dtype)
    if name == "weight" and t.is_floating_point():
        return torch.ones(t.shape, dtype=t.dtype, device=gen_device)  # norms
    return torch.zeros(t.shape, dtype=t.dtype, device=gen_device)  # biases, correction bias


def _fill_experts(experts: ExpertBackend, generator: torch.Generator, gen_device: torch.device,
                  dtype: torch.dtype, staging: dict[str, torch.Tensor]) -> None:
    """Draws one layer's experts and hands them to the backend through one staging buffer."""
    s = experts.spec
    e, h, i = s.num_experts, s.hidden_size, s.intermediate_size
    for name, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
        buffer = staging.get(name)
        if buffer is None or tuple(buffer.shape) != shape:
            pinned = gen_device.type == "cuda"
            buffer = staging[name] = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        for first in range(0, e, 8):  # 8 experts at a time bounds the GPU scratch
            chunk = buffer[first : first + 8]
            drawn = torch.empty(chunk.shape, dtype=torch.float32, device=gen_device)
            chunk.copy_(drawn.normal_(0.0, STD, generator=generator).to(dtype))
        experts.load_tensor(name, buffer)
