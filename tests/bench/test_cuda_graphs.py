"""bench/cuda_graphs.py on any machine: bad counts and a host without CUDA are refused with a
message before fn runs once; on a GPU (`pytest -m device`) a capture replays new inputs and
every timing is a positive number of milliseconds."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hetmoe.bench.cuda_graphs import capture, event_ms


def never() -> None:
    raise AssertionError("fn ran before the arguments were checked")


@pytest.mark.parametrize(("call", "message"), [
    (lambda: capture(never, warmup=-1), "capture: warmup must be an integer >= 0, got -1"),
    (lambda: capture(never, warmup=1.5),  # type: ignore[arg-type]
     "capture: warmup must be an integer >= 0, got 1.5"),
    (lambda: event_ms(never, 0), "event_ms: repeats must be an integer >= 1, got 0"),
    (lambda: event_ms(never, 3, warmup=-2), "event_ms: warmup must be an integer >= 0, got -2"),
])
def test_a_bad_count_is_refused_before_fn_runs(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        call()


@pytest.mark.parametrize("call", [lambda: capture(never), lambda: event_ms(never, 5, warmup=1)],
                         ids=["capture", "event_ms"])
def test_without_cuda_it_says_so_before_fn_runs(call: Callable[[], object],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU; torch sees none"):
        call()


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_a_capture_replays_new_inputs_and_times_them() -> None:
    x = torch.zeros(1024, device="cuda")
    calls = []

    def step() -> torch.Tensor:
        calls.append(torch.cuda.is_current_stream_capturing())
        return x * 2 + 1

    graph, out = capture(step, warmup=2)
    assert calls == [False, False, True]  # two warm-ups outside, then the capture
    x.copy_(torch.arange(1024, device="cuda"))
    graph.replay()
    assert torch.equal(out, torch.arange(1024, device="cuda") * 2.0 + 1)
    times = event_ms(graph.replay, 5, warmup=1)
    assert len(times) == 5 and all(t > 0 for t in times)
