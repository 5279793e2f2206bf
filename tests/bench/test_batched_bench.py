"""bench/batched_bench.py: llama-batched-bench's rows read from its markdown table and its JSONL,
as tools/batched-bench/batched-bench.cpp of the peer kit's llama.cpp prints them, and the
errors that name a bad line."""

from __future__ import annotations

import json

import pytest
from batched_bench_sample import MARKDOWN

from hetmoe.bench.batched_bench import FIELDS, output_tok_s, parse_batched_bench


def jsonl_line(pl: int, t_pp: float, t_tg: float) -> str:
    """One `--output-format jsonl` line, keys in its printf's order."""
    t = t_pp + t_tg
    return json.dumps({"n_kv_max": 20480, "n_batch": 4096, "n_ubatch": 4096, "flash_attn": -1,
                       "is_pp_shared": 0, "n_gpu_layers": 99, "n_threads": 15,
                       "n_threads_batch": 15, "pp": 32, "tg": 48, "pl": pl, "n_kv": pl * 80,
                       "t_pp": t_pp, "speed_pp": pl * 32 / t_pp, "t_tg": t_tg,
                       "speed_tg": pl * 48 / t_tg, "t": t, "speed": pl * 80 / t})


def test_markdown_rows() -> None:
    rows = parse_batched_bench(MARKDOWN)
    assert [r["pl"] for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert rows[-1] == {"pp": 32, "tg": 48, "pl": 256, "n_kv": 20480, "t_pp": 6.112,
                        "speed_pp": 1340.31, "t_tg": 34.911, "speed_tg": 351.98, "t": 41.023,
                        "speed": 499.23}
    assert all(isinstance(rows[0][f], int) for f in ("pp", "tg", "pl", "n_kv"))
    # Generated tokens over prefill + decode: 256 x 48 / 41.023 s; neither S_TG nor S.
    assert output_tok_s(rows[-1]) == pytest.approx(299.5393, abs=1e-4)
    assert output_tok_s(rows[0]) == pytest.approx(48 / 1.833)


def test_jsonl_rows_read_as_the_table_does() -> None:
    text = "\n".join(["llama_model_loader: loaded meta data", jsonl_line(1, 0.131, 1.702),
                      jsonl_line(256, 6.112, 34.911)])
    rows = parse_batched_bench(text)
    assert [sorted(r) for r in rows] == [sorted(FIELDS)] * 2
    assert (rows[1]["pl"], rows[1]["speed_tg"]) == (256, pytest.approx(351.98, abs=0.01))
    assert output_tok_s(rows[1]) == pytest.approx(output_tok_s(parse_batched_bench(MARKDOWN)[-1]))


@pytest.mark.parametrize(("text", "message"), [
    ("main: loading\n", "peer.md: no llama-batched-bench rows (a markdown table with columns PP, "
                        "TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s, or its "
                        "JSONL)"),
    ("|    32 |     48 |    1 |     80 |\n", "peer.md, line 1: a table row of 10 columns"),
    ("\n|    32 |     48 |    x |     80 |    0.131 |   244.27 |    1.702 |    28.20 |    1.833 "
     "|    43.64 |", "peer.md, line 2: pl is not an integer: 'x'"),
    ('{"pp": 32, "tg": 48}', "peer.md, line 1: llama-batched-bench JSONL row lacks pl, n_kv, "
                             "t_pp, speed_pp, t_tg, speed_tg, t, speed"),
    ("{not json", "peer.md, line 1: not a JSON object (Expecting property name enclosed in "
                  "double quotes): '{not json'"),
])
def test_bad_output_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_batched_bench(text, "peer.md")
    assert str(error.value).startswith(message)
