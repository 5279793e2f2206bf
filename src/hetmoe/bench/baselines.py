"""The outside baseline: unmodified transformers with the routed experts offloaded by accelerate.

The model is built from the same config with random weights: every routed-expert module on the
CPU, everything else on the GPU, then `accelerate.dispatch_model` with that `device_map` (what
`from_pretrained(device_map=...)` does): the experts' weights stay in host memory and are moved to
the GPU by accelerate's hooks each time their module runs. Generation is HF `generate`, greedy.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetmoe.bench.random_model import random_tensor, weight_std
from hetmoe.loading.materialize import rebuild_computed_buffers
from hetmoe.loading.skeleton import build_skeleton

if TYPE_CHECKING:
    from transformers import GenerationMixin


def _is_routed_experts(name: str) -> bool:
    return name.endswith(".experts") and ".layers." in name


def build_offloaded_hf_model(config: Any, dtype: torch.dtype = torch.bfloat16,
                             seed: int = 0) -> GenerationMixin:
    """The plain HF model of `config`, random weights, experts offloaded to the CPU (accelerate)."""
    from accelerate import dispatch_model  # the test extra: the accelerate baseline only

    model = build_skeleton(config, dtype)
    gpu = torch.device("cuda")
    generator = torch.Generator(gpu).manual_seed(seed)
    experts = [name for name, _ in model.named_modules() if _is_routed_experts(name)]
    device_map: dict[str, str | int] = {}
    layers = int(config.num_hidden_layers)
    for name, module in model.named_modules():
        owned = [k for k, t in (*module._parameters.items(), *module._buffers.items())
                 if t is not None]
        if not owned:
            continue
        on_cpu = any(name == e or name.startswith(e + ".") for e in experts)
        device_map[name] = "cpu" if on_cpu else 0
        for table in (module._parameters, module._buffers):
            for key, t in list(table.items()):
                if t is None or t.device.type != "meta":
                    continue
                if table is module._buffers and key in module._non_persistent_buffers_set:
                    continue
                std = weight_std(name, layers)
                value = random_tensor(key, t, generator, gpu, std).to("cpu" if on_cpu else gpu)
                table[key] = nn.Parameter(value, False) if isinstance(t, nn.Parameter) else value
    rebuild_computed_buffers(model, gpu)
    return dispatch_model(model.eval(), device_map=device_map, main_device=0)


@torch.inference_mode()
def hf_generate_speed(model: GenerationMixin, prompt: list[int],
                      new_tokens: int) -> dict[str, float]:
    """Prefill and decode speed of HF `generate` (greedy): decode = the time of `new_tokens`
    minus the time of 1 new token, over new_tokens - 1."""
    ids = torch.tensor([prompt], device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        # Untyped call: some transformers releases type generate's self as a protocol their own
        # causal LMs do not match, others do not.
        generate: Any = model.generate
        generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(1)  # warm-up
    one = run(1)
    many = run(new_tokens)
    return {"prefill_s": one, "decode_tok_s": (new_tokens - 1) / (many - one),
            "new_tokens": new_tokens}
