"""submit/sync from several threads, deep queues, flag-started jobs on bound buffers, and the
sync of a process's first pool job."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import torch
from moe_oracle import make_experts, write_packed_groups

from hetmoe import _cpu
from hetmoe.experts import CpuMoE


def _layer() -> tuple[CpuMoE, list[tuple[torch.Tensor, ...]]]:
    w = make_experts(5, 128, 64, seed=21)
    moe = CpuMoE(5, 128, 64, "int4")
    moe.load(w.gate, w.up, w.down)
    g = torch.Generator().manual_seed(22)
    calls = []
    for i in range(24):
        q = 1 + (7 * i) % 40
        calls.append((torch.randn(q, 128, generator=g), torch.randint(-1, 5, (q, 3), generator=g),
                      torch.rand(q, 3, generator=g)))
    return moe, calls


def test_queued_submits_equal_forward() -> None:
    moe, calls = _layer()
    expected = [moe.forward(*c) for c in calls]
    pending = [moe.submit(*c) for c in calls]  # many jobs queued at once
    got = [moe.sync() for _ in pending]  # FIFO order
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    # Explicit handles may be synced in any order.
    pending = [moe.submit(*c) for c in calls[:6]]
    for i in (3, 0, 5, 1, 4, 2):
        assert torch.equal(moe.sync(pending[i]), expected[i])


def test_threads_submit_and_sync_concurrently() -> None:
    moe, calls = _layer()
    expected = [moe.forward(*c) for c in calls]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(first: int) -> None:
        try:
            for rnd in range(3):
                for i in range(first, len(calls), 4):
                    call = moe.submit(*calls[i])
                    results[(rnd, i)] = moe.sync(call)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 3 * len(calls)
    for (_, i), out in results.items():
        assert torch.equal(out, expected[i])


def test_flagged_jobs_read_the_bound_buffers_when_started() -> None:
    """`bind` fixes the buffers; each flag-started job computes on what they hold once its ready
    word is set (the test writes the words a GPU stream would)."""
    moe, calls = _layer()
    x, ids, wts = calls[5]
    out = torch.full_like(x, float("nan"))
    words = torch.zeros(2, 16, dtype=torch.int32)  # ready, done: a cache line each
    flags = _cpu.StreamFlags(words[0].data_ptr(), words[1].data_ptr())
    moe.bind(x, ids, wts, out)
    for scale in (1.0, 2.0):
        handle = moe.submit_flagged(flags)
        x.mul_(scale)  # written after the submit, before the ready word: this is computed
        words[0, 0] = 1
        moe.wait_flagged(handle)
        assert int(words[1, 0]) == 1
        words[1, 0] = 0
        assert torch.equal(out, moe.forward(x, ids, wts))


_FIRST_JOB = """
import json, sys, torch
from hetmoe.experts import CpuMoE
moe = CpuMoE(8, 256, 256)
moe.map_file(sys.argv[1], json.loads(sys.argv[2]))  # no pool job: nothing to pack
g = torch.Generator().manual_seed(5)
x = torch.randn(256, 256, generator=g).bfloat16()
ids = torch.stack([torch.randperm(8, generator=g) for _ in range(256)])
w = torch.rand(256, 8, generator=g)
call = moe.submit(x, ids, w)
got = moe.sync(call).clone()  # must be the finished output, taken before anything else runs
print(json.dumps({"handle": call.handle, "equal": torch.equal(got, moe.forward(x, ids, w))}))
"""


def test_sync_waits_for_the_pools_first_job(tmp_path: Path) -> None:
    # A layer mapped from a file runs no pool job to pack, so in a fresh process its first
    # submit is the pool's job 0; sync once took handle 0 for "nothing submitted" and returned
    # while the job still wrote its output (a converted model's heap corruption).
    w = make_experts(8, 256, 256, seed=4)
    moe = CpuMoE(8, 256, 256)
    moe.load(w.gate, w.up, w.down)
    path = tmp_path / "layer.bin"
    offsets = write_packed_groups(moe, path)
    run = subprocess.run([sys.executable, "-c", _FIRST_JOB, str(path), json.dumps(offsets)],
                         capture_output=True, text=True, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"handle": 0, "equal": True}
