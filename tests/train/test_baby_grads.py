"""Baby models of every family with CPU experts: our loss and every LoRA gradient equal
transformers + PEFT autograd on the same weights and batch (fp32, 1e-4 relative); the adapter
saved by us loads into PEFT on the original model. On a GPU host (`-m device`) the same check
runs with attention, router and adapters on the GPU and the experts on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from baby import reference_model

from hetmoe import LLM
from hetmoe.presets.tiny import FAMILIES
from hetmoe.train.lora import LoraSettings, attach_lora, save_adapter

SETTINGS = LoraSettings(rank=4, alpha=8)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (1, 24), generator=g)
    labels = ids.clone()
    labels[:, :9] = -100  # the prompt part: no loss
    return ids, labels


def _reference(path: Path) -> torch.nn.Module:
    """transformers on the checkpoint with its routed experts rounded to bf16, as the CPU
    backend packs them (bf16 format: no other rounding)."""
    ref = reference_model(path)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name:
                p.copy_(p.bfloat16().float())
    return ref


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor,
                    labels: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads


GPU = pytest.param("cuda", marks=[
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")])


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_lora_grads_equal_peft(family: str, device: str, tiny_dir,
                                        tmp_path: Path) -> None:
    path = tiny_dir(family)
    llm = LLM(path, device=device, dtype="float32", experts="cpu", progress=False,
              gpu_expert_bytes=0)  # every expert through the CPU backend's backward
    assert any(type(m).__name__ == "CpuExperts" for m in llm.model.modules())
    ref = _reference(path)
    torch.manual_seed(0)
    ref_peft = attach_lora(ref, SETTINGS, init_lora_weights=False)  # B != 0: A gets gradients
    ours = attach_lora(llm.model, SETTINGS)
    adapters = {n: p for n, p in ref_peft.named_parameters() if p.requires_grad}
    mine = dict(ours.named_parameters())
    trained = {n for n, p in mine.items() if p.requires_grad}
    assert trained and trained <= set(adapters)
    with torch.no_grad():
        for n, p in adapters.items():
            if n in trained:
                mine[n].copy_(p)
            else:
                # PEFT's transformers-v5 MoE conversion reads the shared experts' gate_proj /
                # down_proj in the targets as the fused routed experts too (DeepSeek): on the HF
                # model only, where they are parameters. Zeroed out of the comparison.
                assert ".mlp.experts." in n, n
                if "lora_B" in n:
                    p.zero_()
    ids, labels = _batch(ref.config.vocab_size)
    loss, grads = _loss_and_grads(ours, ids.to(device), labels.to(device))
    grads = {n: g.cpu() for n, g in grads.items()}
    ref_loss, ref_grads = _loss_and_grads(ref_peft, ids, labels)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (loss, ref_loss)
    for n in trained:
        g = ref_grads[n]
        err = float((grads[n] - g).norm() / g.norm())
        assert err <= 1e-4, f"{n}: relative gradient error {err:.3g}"
    # The saved adapter is PEFT's format on the original model: same logits with PEFT.
    from peft import PeftModel

    save_adapter(ours, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_reference(path), str(tmp_path / "adapter"))
    with torch.no_grad():
        ref_logits = ref_peft(input_ids=ids).logits
        assert torch.allclose(loaded(input_ids=ids).logits, ref_logits, atol=1e-5)
