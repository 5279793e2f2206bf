"""K- and IQ-quant GGUF experts (the files users download most) load into the default int8
(32-groups) layout within a stated error of transformers on the same file's dequantized weights.

gguf-py dequantizes these types but cannot make them, so the experts are random blocks with
sane scales (fake_hub.random_blocks) in a baby qwen3moe whose expert rows are whole 256-blocks.
`python tests/loading/test_gguf_kquants.py` prints the table quoted in the README.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from baby import reference_logits, reference_model
from fake_hub import write_gguf

from hetmoe import LLM
from hetmoe.loading.gguf_checkpoint import write_checkpoint

IDS = [1, 5, 9, 42, 7, 3, 100, 200, 17, 300, 64, 8, 450, 2, 33, 71]
SHAPE = {"hidden_size": 256, "moe_intermediate_size": 256}
QTYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL")


def errors(source: Path, work: Path, qtype: str) -> tuple[float, float, float]:
    """(max |Δlogit|, that over max |logit|, top-1 agreement) of LLM on a GGUF whose experts
    are `qtype` blocks, against transformers on the file's dequantized checkpoint."""
    gguf = write_gguf(source, work / f"m-{qtype}.gguf", "F32", experts=qtype)[0]
    want = reference_logits(reference_model(write_checkpoint(gguf, work / qtype,
                                                             progress=False)), IDS)
    ours = LLM(gguf, device="cpu", dtype="float32", progress=False).logits(IDS)
    diff = float((ours - want).abs().max())
    top1 = float((ours.argmax(-1) == want.argmax(-1)).float().mean())
    return diff, diff / float(want.abs().max()), top1


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_k_quant_experts_are_int8_within_half_a_percent(
        qtype: str, tiny_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path / "cache"))
    diff, relative, top1 = errors(tiny_dir("qwen3_moe", **SHAPE), tmp_path, qtype)
    assert f"{qtype} experts: int8 with 32-wide groups" in capfd.readouterr().err
    assert relative < 0.005 and top1 >= 0.875, (diff, relative, top1)


if __name__ == "__main__":
    import os
    import tempfile

    from hetmoe.presets.tiny import build_tiny_model

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp())
    os.environ["HETMOE_CACHE_DIR"] = str(work / "cache")
    source = build_tiny_model("qwen3_moe", work / "source", **SHAPE)  # type: ignore[arg-type]
    print("| quant | max abs logit error | relative to max logit | top-1 agreement |")
    print("|---|---|---|---|")
    for qtype in sys.argv[1:] or QTYPES:
        diff, relative, top1 = errors(source, work, qtype)
        print(f"| {qtype} | {diff:.4f} | {relative:.2%} | {top1:.0%} of {len(IDS)} |")
