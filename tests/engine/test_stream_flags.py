"""The CPU side of the ready/done flag protocol (csrc/runtime/stream_flags.h), without a GPU:
the test writes the words a GPU stream would write (ready := 1, and done := 0 after its wait)."""

from __future__ import annotations

import time

import pytest
import torch

from hetmoe import _cpu, _cpu_testing
from hetmoe.experts.cpu_moe import CpuMoE

TASKS = 3


@pytest.fixture(scope="module")
def pool() -> _cpu.ThreadPool:
    return _cpu.ThreadPool(num_threads=2, num_groups=1)


class Words:
    """Int32 words on their own cache lines, as the GPU side would see them: ready, done and
    (for a job with deferred experts) the deferred part's done, `late_flags`."""

    def __init__(self) -> None:
        self.mem = torch.zeros(3, 16, dtype=torch.int32)  # [ready, done, late done] x 64 bytes
        self.flags = _cpu.StreamFlags(self.mem[0].data_ptr(), self.mem[1].data_ptr())
        self.late_flags = _cpu.StreamFlags(self.mem[0].data_ptr(), self.mem[2].data_ptr())

    def gpu_ready(self) -> None:
        self.mem[0, 0] = 1

    def gpu_consume_done(self) -> None:
        assert int(self.mem[1, 0]) == 1
        self.mem[1, 0] = 0


def test_job_waits_for_ready_then_sets_done_and_replays_without_reset(pool) -> None:
    words = Words()
    job = _cpu_testing.FlagCountJob(words.flags, TASKS, pool=pool)
    for round_ in range(1, 4):
        handle = job.submit()
        time.sleep(0.05)
        assert job.count == TASKS * (round_ - 1), "the job ran before its ready word was set"
        assert words.flags.done == 0
        words.gpu_ready()
        job.wait(handle)
        assert job.count == TASKS * round_
        assert (words.flags.ready, words.flags.done) == (0, 1)  # ready consumed, done set
        words.gpu_consume_done()


def test_jobs_queued_ahead_run_in_order_one_ready_each(pool) -> None:
    words = Words()
    job = _cpu_testing.FlagCountJob(words.flags, TASKS, pool=pool)
    handles = [job.submit() for _ in range(3)]  # a step's jobs, queued before it starts
    for i, handle in enumerate(handles, start=1):
        words.gpu_ready()
        job.wait(handle)
        assert job.count == TASKS * i
        words.gpu_consume_done()
    assert (words.flags.ready, words.flags.done) == (0, 0)


def test_abort_releases_a_waiting_job_and_reset_clears_the_words(pool) -> None:
    words = Words()
    job = _cpu_testing.FlagCountJob(words.flags, TASKS, pool=pool)
    handle = job.submit()
    time.sleep(0.02)
    words.flags.abort()
    job.wait(handle)  # returns: the job gave up waiting for its ready word
    assert job.count == 0
    assert words.flags.done == 1  # a stream waiting on done is let through
    words.flags.reset()
    assert (words.flags.ready, words.flags.done) == (0, 0)
    handle = job.submit()
    words.gpu_ready()
    job.wait(handle)
    assert job.count == TASKS


def test_failed_job_still_sets_done_and_wait_reports_it(pool) -> None:
    words = Words()
    job = _cpu_testing.FlagCountJob(words.flags, TASKS, pool=pool)
    job.fail = True
    handle = job.submit()
    words.gpu_ready()
    with pytest.raises(RuntimeError, match=r"failed in phase 0, group 0, task 0: injected "
                                           r"flag-job failure"):
        job.wait(handle)
    assert words.flags.done == 1


def test_prepare_runs_before_build_and_during_the_job_ahead(pool) -> None:
    """A built job's prepare step runs once before its build step; the worker that built the
    job ahead prepares it while that job's tasks still run (here: a task of the job ahead waits
    until it has)."""
    ahead, behind = Words(), Words()
    first = _cpu_testing.FlagCountJob(ahead.flags, TASKS, pool=pool)
    second = _cpu_testing.FlagCountJob(behind.flags, TASKS, pool=pool)
    first.watch(second)
    handles = [first.submit(), second.submit()]
    time.sleep(0.02)
    assert (first.prepared, second.prepared) == (1, 0)  # the first builder waits for ready
    ahead.gpu_ready()
    first.wait(handles[0])
    assert first.saw_watch_prepared and second.prepared == 1
    behind.gpu_ready()
    second.wait(handles[1])
    assert (first.count, second.count) == (TASKS, TASKS)
    assert (first.unprepared_builds, second.unprepared_builds) == (0, 0)


def test_failed_prepare_skips_the_job_but_sets_done(pool) -> None:
    words = Words()
    job = _cpu_testing.FlagCountJob(words.flags, TASKS, pool=pool)
    job.fail_prepare = True
    handle = job.submit()
    with pytest.raises(RuntimeError, match=r"failed in its prepare step: injected prepare "
                                           r"failure"):
        job.wait(handle)
    assert job.count == 0 and words.flags.done == 1 and words.flags.ready == 0
    words.gpu_consume_done()
    job.fail_prepare = False
    handle = job.submit()
    words.gpu_ready()
    job.wait(handle)
    assert job.count == TASKS


def test_words_are_checked() -> None:
    mem = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(ValueError, match="ready and done must be on different cache lines"):
        _cpu.StreamFlags(mem[0:].data_ptr(), mem[1:].data_ptr())
    with pytest.raises(ValueError, match="must be 4-byte aligned words"):
        _cpu.StreamFlags(mem.data_ptr() + 2, mem[16:].data_ptr())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a CUDA driver")
def test_gpu_side_without_a_cuda_driver_says_so() -> None:
    words = Words()
    assert not _cpu.stream_memops_available()
    with pytest.raises(RuntimeError, match=r"no CUDA driver \(libcuda\) with cuStreamWriteValue32"):
        words.flags.signal_ready_on(0)


def test_cpu_moe_flag_job_matches_forward_and_reports_routing_errors() -> None:
    torch.manual_seed(0)
    e, h, i, q, k = 4, 64, 32, 2, 2
    moe = CpuMoE(e, h, i, threads=2)
    moe.load(torch.randn(e, i, h) * 0.1, torch.randn(e, i, h) * 0.1, torch.randn(e, h, i) * 0.1)
    x, out = torch.randn(q, h), torch.full((q, h), float("nan"))
    ids = torch.tensor([[0, 3], [2, -1]])
    weights = torch.rand(q, k)
    want = moe.forward(x, ids, weights)
    words = Words()
    moe.bind(x, ids, weights, out)
    handle = moe.submit_flagged(words.flags)
    words.gpu_ready()
    moe.wait_flagged(handle)
    assert torch.equal(out, want)
    words.gpu_consume_done()
    ids[0, 0] = 9  # what a broken router would have copied in
    handle = moe.submit_flagged(words.flags)
    words.gpu_ready()
    with pytest.raises(RuntimeError, match=r"failed in its build step: expert_ids\[0, 0\] = 9 is "
                                         r"out of range \[0, 4\)"):
        moe.wait_flagged(handle)
    assert words.flags.done == 1


@pytest.mark.parametrize("fmt,group,q", [("bf16", None, 1), ("bf16", None, 4), ("int8", 128, 1),
                                         ("int4", 32, 3), ("bf16", None, 5)])
def test_flag_job_reads_inputs_written_after_submit(fmt: str, group: int | None, q: int) -> None:
    """A decode job (q <= 4) is made before its ready word and routed after it: x, ids and
    weights written between submit and ready are the ones computed (q = 5: made after ready)."""
    torch.manual_seed(1)
    e, h, i, k = 6, 256, 256, 3
    moe = CpuMoE(e, h, i, fmt, group_size=group, threads=2)
    moe.load(torch.randn(e, i, h) * 0.1, torch.randn(e, i, h) * 0.1, torch.randn(e, h, i) * 0.1)
    moe.set_gpu_experts(torch.tensor([False, False, False, False, True, False]))
    x, out = torch.zeros(q, h), torch.full((q, h), float("nan"))
    ids, weights = torch.zeros(q, k, dtype=torch.int64), torch.zeros(q, k)
    words = Words()
    moe.bind(x, ids, weights, out)
    for step in range(3):
        handle = moe.submit_flagged(words.flags)
        time.sleep(0.01)  # the job is made and waits for its ready word
        x.copy_(torch.randn(q, h))
        ids.copy_(torch.stack([torch.randperm(e)[:k] for _ in range(q)]))
        ids[0, -1] = -1 if step == 1 else ids[0, -1]
        weights.copy_(torch.rand(q, k))
        words.gpu_ready()
        moe.wait_flagged(handle)
        words.gpu_consume_done()
        torch.testing.assert_close(out, moe.forward(x, ids, weights), rtol=0, atol=0)


@pytest.mark.parametrize("fmt,group,q,d", [("bf16", None, 1, 2), ("int8", 128, 1, 3),
                                           ("int4", 32, 3, 1), ("bf16", None, 5, 2)])
def test_deferred_flag_job_chains_the_late_slots(fmt: str, group: int | None, q: int,
                                                 d: int) -> None:
    """With deferral one job computes the first k - d slots into out (done word), then the last
    d into late_out (second done word): each equals forward on its slots alone, bit for bit."""
    torch.manual_seed(2)
    e, h, i, k = 8, 256, 256, 4
    moe = CpuMoE(e, h, i, fmt, group_size=group, threads=2)
    moe.load(torch.randn(e, i, h) * 0.1, torch.randn(e, i, h) * 0.1, torch.randn(e, h, i) * 0.1)
    _cpu_testing.set_profile(moe._layer, True)
    x, out, late = torch.zeros(q, h), torch.zeros(q, h), torch.zeros(q, h)
    ids, weights = torch.zeros(q, k, dtype=torch.int64), torch.zeros(q, k)
    words = Words()
    mem, flags, late_flags = words.mem, words.flags, words.late_flags
    moe.bind(x, ids, weights, out)
    for _ in range(2):
        handle = moe.submit_flagged(flags, d, late_flags, late)
        x.copy_(torch.randn(q, h))
        ids.copy_(torch.stack([torch.randperm(e)[:k] for _ in range(q)]))
        weights.copy_(torch.rand(q, k))
        mem[0, 0] = 1
        moe.wait_flagged(handle)
        assert mem[1:, 0].tolist() == [1, 1]
        mem[1:, 0] = 0
        now, later = ids.clone(), ids.clone()
        now[:, k - d:], later[:, :k - d] = -1, -1
        torch.testing.assert_close(out, moe.forward(x, now, weights), rtol=0, atol=0)
        torch.testing.assert_close(late, moe.forward(x, later, weights), rtol=0, atol=0)
    # per round: the job's two parts, then the two forwards
    rows = _cpu_testing.take_timeline(moe._layer)
    assert len(rows) == 8
    for first, second in (rows[0:2], rows[4:6]):
        assert first[0] <= first[1] <= first[2] <= second[0] <= second[2]  # ready, built, done
        picked, made, claimed = first[-3:]  # the prepare step, then the build step
        assert 0 < picked <= made <= claimed <= first[0]
        assert second[-3:] == [0, 0, 0]


def test_deferred_flag_job_errors_set_both_done_words() -> None:
    moe = CpuMoE(4, 64, 32, threads=2)
    moe.load(torch.randn(4, 32, 64), torch.randn(4, 32, 64), torch.randn(4, 64, 32))
    x, out, late = torch.randn(1, 64), torch.zeros(1, 64), torch.zeros(1, 64)
    ids, weights = torch.tensor([[0, 1, 7]]), torch.rand(1, 3)  # 7: a broken late slot
    words = Words()
    mem, flags, late_flags = words.mem, words.flags, words.late_flags
    moe.bind(x, ids, weights, out)
    handle = moe.submit_flagged(flags, 1, late_flags, late)
    mem[0, 0] = 1
    with pytest.raises(RuntimeError, match=r"expert_ids\[0, 2\] = 7 is out of range \[0, 4\)"):
        moe.wait_flagged(handle)
    assert mem[1:, 0].tolist() == [1, 1]  # a stream waiting on either word goes on
    for bad, message in ((3, r"deferred must be in \[0, 3\)"), (1, "need late_flags and late_out")):
        with pytest.raises(ValueError, match=message):
            moe.submit_flagged(flags, bad, None if bad == 1 else late_flags, late)
    with pytest.raises(ValueError, match=r"late_out must be a contiguous CPU tensor like the bound "
                                         r"out \(\(1, 64\), torch.float32\)"):
        moe.submit_flagged(flags, 1, late_flags, torch.zeros(2, 64))


def test_flag_job_needs_bound_buffers() -> None:
    moe = CpuMoE(2, 32, 32, threads=2)
    with pytest.raises(RuntimeError, match=r"submit_flagged: call bind\(x, ids, "):
        moe.submit_flagged(Words().flags)


def test_loaded_library_lookup_binds_only_what_is_loaded() -> None:
    """The lookup behind the CUDA bindings: an already-loaded library exporting the symbol is
    found (libc with malloc); a missing symbol or library gives ''."""
    path = _cpu_testing.loaded_library_path("libc.so", "malloc")
    assert "libc.so" in path
    assert _cpu_testing.loaded_library_path("libc.so", "hetmoe_no_such_symbol") == ""
    assert _cpu_testing.loaded_library_path("libhetmoe-not-loaded", "malloc") == ""
