"""SFT data: file checks name the file and line; labels cover exactly the assistant turns on a
real chat template (SmolLM2's ChatML) and the tiny one; packing keeps samples apart (the packed
row's logits equal each sample's alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetmoe import LLM
from hetmoe.train.data import IGNORE, Sample, build_rows, check_file, pack, tokenize

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is your name?"},
        {"role": "assistant", "content": "My name is Zorblax."},
        {"role": "user", "content": "And again?"},
        {"role": "assistant", "content": "Still Zorblax."}]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("lines", "message"), [
    (['{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
      '"content": "yo"}]}', "{not json"], r"data.jsonl:2: not valid JSON"),
    (['{"text": "hi"}'], r"data.jsonl:1: expected `messages`.*found keys \['text'\]"),
    (['[1, 2]'], r"data.jsonl:1: expected a JSON object, found list"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], r"data.jsonl:1: no assistant"),
    (['{"messages": [{"role": "robot", "content": "hi"}]}'], r"data.jsonl:1: messages\[0\]"),
    (['{"prompt": "a", "completion": "b"}', '',
      '{"messages": [{"role": "assistant", "content": "x"}]}'],
     r"data.jsonl:3: a `messages` example after `prompt` ones \(line 1\)"),
    ([''], r"data.jsonl: no examples"),
])
def test_check_file_names_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_file(_write(tmp_path / "data.jsonl", lines))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope.jsonl: no such data file"):
        check_file(tmp_path / "nope.jsonl")


def _assistant_text(tokenizer: object, sample: Sample) -> list[str]:
    """The labeled runs of a sample, decoded."""
    runs: list[list[int]] = []
    previous = IGNORE
    for t, label in zip(sample.input_ids, sample.labels, strict=True):
        if label != IGNORE:
            assert label == t
            if previous == IGNORE:
                runs.append([])
            runs[-1].append(t)
        previous = label
    return [tokenizer.decode(r) for r in runs]  # type: ignore[attr-defined]


def test_labels_on_a_real_template() -> None:
    from transformers import AutoTokenizer

    from hetmoe.presets.demo import smollm2_gguf

    pytest.importorskip("gguf", reason="the SmolLM2 template is read from its GGUF")
    try:
        gguf_path = smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    assert "<|im_start|>" in tokenizer.chat_template
    sample = tokenize(tokenizer, CHAT)
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(CHAT,
                                                                              tokenize=False)
    assert _assistant_text(tokenizer, sample) == ["My name is Zorblax.<|im_end|>\n",
                                                  "Still Zorblax.<|im_end|>\n"]


def test_labels_on_the_tiny_template(tiny_qwen3_moe: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3_moe))
    sample = tokenize(tokenizer, CHAT)
    assert _assistant_text(tokenizer, sample) == ["My name is Zorblax.</s>\n",
                                                  "Still Zorblax.</s>\n"]


def test_pack_rows_positions_and_boundaries() -> None:
    samples = [Sample([1, 2, 3], [IGNORE, 2, 3]), Sample([4, 5], [4, 5]),
               Sample([6, 7, 8, 9, 10, 11], [6, 7, 8, 9, 10, 11]), Sample([12], [12])]
    rows, cut = pack(samples, seq_len=5)
    assert cut == 1
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [12]]
    assert [r.position_ids for r in rows] == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4], [0]]
    # each sample's first token is unlabeled: no loss predicts it from the previous sample
    assert [r.labels for r in rows] == [[IGNORE, 2, 3, IGNORE, 5], [IGNORE, 7, 8, 9, 10],
                                        [IGNORE]]


def test_packed_row_equals_samples_alone(tiny_qwen3_moe: Path, tmp_path: Path,
                                         one_torch_thread: None) -> None:
    data = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": p, "completion": c}) for p, c in
                                         [("Hello!", "Hi."), ("Where?", "At the red bridge.")]])
    llm = LLM(tiny_qwen3_moe, device="cpu", dtype="float32", experts="cpu", progress=False,
              max_batch=1)
    rows, cut = build_rows(data, llm.tokenizer, 256)
    assert len(rows) == 1 and cut == 0
    row = rows[0]
    split = row.position_ids.index(0, 1)
    with torch.no_grad():
        packed = llm.model(input_ids=torch.tensor([row.input_ids]), use_cache=False,
                           position_ids=torch.tensor([row.position_ids])).logits[0]
        first = llm.model(input_ids=torch.tensor([row.input_ids[:split]])).logits[0]
        second = llm.model(input_ids=torch.tensor([row.input_ids[split:]])).logits[0]
    assert torch.allclose(packed, torch.cat([first, second]), atol=1e-4)
