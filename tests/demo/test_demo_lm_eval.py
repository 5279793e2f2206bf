"""lm-evaluation-harness, the outside evaluator: `hetmoe serve demo` scored through its
`local-completions` (log-likelihood: prompt token ids, `echo`, `logprobs`, the tokenizer read from
the server's /tokenize) and `local-chat-completions` (greedy generate-until through the chat
template) gets the scores of lm-eval's own `hf` model on the dense SmolLM2 weights (the GGUF
read by transformers, with transformers' own tokenizer), on two local tasks (lm_eval_tasks.py).

`--experts torch` runs the experts in fp32 as the dense model does, so scores, every
log-likelihood (to 1e-3) and every generated answer agree. The default server (bf16 packed
experts when the C++ backend is built) is checked in the opt-in oracle only: bf16 rounding moves
log-likelihoods by up to 0.1, so a few greedy answers with near ties differ.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from lm_eval_tasks import ANSWER_TASK, CHOICE_TASK, write_tasks
from served import serve
from torch import nn

from hetmoe.presets import presets

if importlib.util.find_spec("lm_eval") is None:
    pytest.skip("needs lm-eval[api] (the test extras)", allow_module_level=True)

CI_EVERY = 8
"""The CI-sized run takes every 8th item (28 + 26 items, every kind of question)."""
POINTS = 0.5
"""Scores agree within half a point (of 100)."""
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    """No downloads: the tasks read local JSONL, the models local files."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        yield


@pytest.fixture(scope="module")
def hf_lm(gguf_path: Path, dense: nn.Module) -> Any:
    """lm-eval's `hf` model on the dense GGUF, fp32 on the CPU: the session's `dense` (what
    `HFLM(pretrained=folder, gguf_file=...)` loads, read once more there) and transformers'
    tokenizer of the same file."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return HFLM(pretrained=dense, tokenizer=tokenizer, device="cpu", batch_size=8)


@contextmanager
def serve_demo(demo_dir: Path, tmp: Path, *flags: str) -> Iterator[str]:
    """`hetmoe serve demo FLAGS` in a subprocess (the preset's cache entry is this session's
    build); yields its base URL once /health answers."""
    cached = tmp / "cache" / "models" / f"demo-v{presets()['demo'].version}"
    cached.mkdir(parents=True)
    for file in demo_dir.iterdir():
        (cached / file.name).symlink_to(file)
    (cached / ".complete").write_text("demo\n")
    with serve("demo", tmp / "serve.log", *flags,
               env={"HETMOE_CACHE_DIR": str(tmp / "cache")}) as url:
        yield url


def evaluate(model: Any, task: str, folder: Path, **options: Any) -> dict[str, Any]:
    """lm-eval's results and samples of `task` from the task files in `folder`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, tasks=[task],
                                  task_manager=TaskManager(include_path=str(folder)), **options)
    assert out is not None
    return {"scores": out["results"][task], "samples": out["samples"][task]}


def served_results(url: str, folder: Path) -> dict[str, dict[str, Any]]:
    """Both tasks against the server: log-likelihood through completions (tokenizer from the
    server), generate-until through chat completions; 8 requests in flight, so the answers come
    from the scheduler's batches (and in half the time of one at a time)."""
    choice = evaluate("local-completions", CHOICE_TASK, folder, model_args={
        "base_url": url + "/v1/completions", "model": "demo", "num_concurrent": 8})
    answer = evaluate("local-chat-completions", ANSWER_TASK, folder, apply_chat_template=True,
                      model_args={"base_url": url + "/v1/chat/completions", "model": "demo",
                                  "num_concurrent": 8})
    return {CHOICE_TASK: choice, ANSWER_TASK: answer}


def hf_results(hf_lm: Any, folder: Path) -> dict[str, dict[str, Any]]:
    return {CHOICE_TASK: evaluate(hf_lm, CHOICE_TASK, folder),
            ANSWER_TASK: evaluate(hf_lm, ANSWER_TASK, folder, apply_chat_template=True)}


def score_gaps(ours: dict[str, dict[str, Any]], ref: dict[str, dict[str, Any]]) -> dict:
    """|ours - ref| in points for each task's metrics, with both scores."""
    gaps = {}
    for task, metrics in ((CHOICE_TASK, ("acc,none", "acc_norm,none")),
                          (ANSWER_TASK, ("exact_match,last_word",))):
        for metric in metrics:
            a, b = (100 * float(r[task]["scores"][metric]) for r in (ours, ref))
            gaps[f"{task} {metric}"] = (abs(a - b), a, b)
    return gaps


def assert_same_items(ours: dict[str, dict[str, Any]], ref: dict[str, dict[str, Any]]) -> None:
    """Every choice's log-likelihood within LOGPROB_TOL and every answer's text equal."""
    for mine, theirs in zip(ours[CHOICE_TASK]["samples"], ref[CHOICE_TASK]["samples"],
                            strict=True):
        assert mine["doc"] == theirs["doc"]
        for (a, _), (b, _) in zip((r[0] for r in mine["resps"]), (r[0] for r in theirs["resps"]),
                                  strict=True):
            assert abs(a - b) <= LOGPROB_TOL, (mine["doc"], a, b)
    for mine, theirs in zip(ours[ANSWER_TASK]["samples"], ref[ANSWER_TASK]["samples"],
                            strict=True):
        assert mine["doc"] == theirs["doc"]
        assert mine["resps"] == theirs["resps"], mine["doc"]


def run_oracle(demo_dir: Path, hf_lm: Any, tmp: Path, every: int, *flags: str) -> dict:
    counts = write_tasks(tmp / "tasks", every)
    started = time.monotonic()
    with serve_demo(demo_dir, tmp, *flags) as url:
        ours = served_results(url, tmp / "tasks")
    served_s = time.monotonic() - started
    started = time.monotonic()
    ref = hf_results(hf_lm, tmp / "tasks")
    gaps = score_gaps(ours, ref)
    print(f"\nitems {counts}; served {served_s:.0f} s, hf {time.monotonic() - started:.0f} s")
    for name, (_, a, b) in gaps.items():
        print(f"  {name}: hetmoe {a:.2f}, hf {b:.2f}")
    return {"ours": ours, "ref": ref, "gaps": gaps, "counts": counts}


def test_lm_eval_scores_equal_hf_on_a_subset(demo_dir: Path, hf_lm: Any, tmp_path: Path) -> None:
    run = run_oracle(demo_dir, hf_lm, tmp_path, CI_EVERY, "--experts", "torch")
    assert run["counts"] == {CHOICE_TASK: 28, ANSWER_TASK: 26}
    assert all(gap <= POINTS for gap, _, _ in run["gaps"].values()), run["gaps"]
    assert_same_items(run["ours"], run["ref"])
    # The tasks have signal: SmolLM2 is right on most items, not all.
    assert 50 < run["gaps"][f"{CHOICE_TASK} acc,none"][2] < 100


@pytest.mark.oracle
def test_lm_eval_scores_equal_hf_on_all_items(demo_dir: Path, hf_lm: Any,
                                             tmp_path: Path) -> None:
    run = run_oracle(demo_dir, hf_lm, tmp_path, 1, "--experts", "torch")
    assert min(run["counts"].values()) >= 200
    assert all(gap <= POINTS for gap, _, _ in run["gaps"].values()), run["gaps"]
    assert_same_items(run["ours"], run["ref"])


@pytest.mark.oracle
def test_lm_eval_default_server_log_likelihood(demo_dir: Path, hf_lm: Any,
                                               tmp_path: Path) -> None:
    """`hetmoe serve demo` as a user starts it: the log-likelihood task's scores agree within
    half a point; greedy answers may differ on near ties (bf16 experts), so within 1.5 points."""
    run = run_oracle(demo_dir, hf_lm, tmp_path, 1)
    gaps = run["gaps"]
    assert gaps[f"{CHOICE_TASK} acc,none"][0] <= POINTS, gaps
    assert gaps[f"{CHOICE_TASK} acc_norm,none"][0] <= POINTS, gaps
    assert gaps[f"{ANSWER_TASK} exact_match,last_word"][0] <= 1.5, gaps
