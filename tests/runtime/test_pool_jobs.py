"""Jobs on the CPU thread pool: every task once per group per phase, phase order, queued submits
from several threads, exceptions. Uses a 2-worker pool with 2 virtual groups built here (so the
multi-group path runs on any machine with 2 CPUs) and the process-wide pool."""

from __future__ import annotations

import os
import threading
import time

import pytest

from hetmoe import _cpu, _cpu_testing

ALLOWED = len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def two_groups() -> _cpu.ThreadPool:
    if ALLOWED < 2:
        pytest.skip(f"needs 2 CPUs for 2 pinned workers, this process may use {ALLOWED}")
    return _cpu.ThreadPool(num_threads=2, num_groups=2)


@pytest.fixture(params=["global", "two_groups"])
def pool(request: pytest.FixtureRequest) -> _cpu.ThreadPool | None:
    """None selects the process-wide pool."""
    return None if request.param == "global" else request.getfixturevalue("two_groups")


@pytest.mark.parametrize("num_phases,tasks", [(1, 1), (3, 7), (4, 0), (2, 33), (0, 5)])
def test_every_task_runs_once_per_group_per_phase(pool, num_phases: int, tasks: int) -> None:
    groups = _cpu.pool_info(pool)["groups"]
    report = _cpu_testing.pool_run_test(num_phases, tasks, pool=pool)
    assert report["shape"] == (num_phases, groups, tasks)
    assert report["counts"] == [1] * (num_phases * groups * tasks)
    assert report["phases_ordered"] is True
    assert report["only_workers"] is True
    assert report["ids_valid"] is True


def test_two_group_pool_layout(two_groups: _cpu.ThreadPool) -> None:
    info = _cpu.pool_info(two_groups)
    assert info["threads"] == 2
    assert info["group_sizes"] == [1, 1]
    assert info["virtual_groups"] is True
    assert info["pinned_threads"] == 2
    assert len(set(info["worker_cpus"])) == 2
    assert set(info["worker_cpus"]) <= os.sched_getaffinity(0)


def test_global_pool_leaves_a_core_and_pins_inside_allowed_set() -> None:
    info = _cpu.pool_info()
    allowed = sorted(os.sched_getaffinity(0))
    assert info["allowed_cpus"] == len(allowed)
    assert info["pinned_threads"] == info["threads"] >= 1
    assert set(info["worker_cpus"]) <= set(allowed)
    assert len(set(info["worker_cpus"])) == info["threads"]
    sized_by_env = "HETMOE_THREADS" in os.environ or "HETMOE_NUMA_GROUPS" in os.environ
    if not sized_by_env and len(allowed) > 1:
        assert info["threads"] == len(allowed) - 1
        assert allowed[0] not in info["worker_cpus"]  # the caller's core
    assert sum(info["group_sizes"]) == info["threads"]


def test_queued_submits_from_several_threads(pool) -> None:
    # 4 callers x 100 jobs each: more than the 256-slot queue, so submit() also waits for room.
    results: list[dict] = []
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            results.append(_cpu_testing.pool_stress(100, 2, 3, pool=pool))
        except BaseException as exc:  # surfaced below, a thread cannot raise into the test
            errors.append(exc)

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert results == [{"jobs": 100, "correct": 100, "in_order": True}] * 4


def test_task_exception_propagates_with_context_and_pool_survives(pool) -> None:
    pattern = r"CPU pool job \d+ failed in phase 1, group 0, task 2: injected test failure"
    with pytest.raises(RuntimeError, match=pattern):
        _cpu_testing.pool_run_test(3, 4, fail_phase=1, fail_task=2, pool=pool)
    report = _cpu_testing.pool_run_test(2, 4, pool=pool)
    assert report["counts"] == [1] * (2 * report["shape"][1] * 4)


def test_bad_arguments_are_reported() -> None:
    with pytest.raises(ValueError, match="phases and tasks must be >= 0, got -1 and 2"):
        _cpu_testing.pool_run_test(-1, 2)
    expected = "need iters >= 1, tasks_per_group >= 0 and warmup >= 0, got 0, 0 and 200"
    with pytest.raises(ValueError, match=expected):
        _cpu_testing.pool_overhead_us(0)


def test_overhead_report_is_consistent(pool) -> None:
    report = _cpu_testing.pool_overhead_us(50, 2, pool=pool)
    assert report["iters"] == 50
    assert 0 < report["min_us"] <= report["median_us"] <= report["p90_us"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork of a multi-threaded process
def test_forked_child_gets_its_own_global_pool() -> None:
    parent_info = _cpu.pool_info()  # the parent's pool exists and its workers run
    pid = os.fork()
    if pid == 0:  # child: the parent's workers are gone; a fresh pool must serve this job
        try:
            report = _cpu_testing.pool_run_test(2, 3)
            ok = report["counts"] == [1] * (2 * report["shape"][1] * 3)
            os._exit(0 if ok and _cpu.pool_info()["threads"] == parent_info["threads"] else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the CPU pool")


def test_idle_workers_park_and_wake_for_the_next_job(two_groups: _cpu.ThreadPool) -> None:
    _cpu_testing.pool_run_test(1, 1, pool=two_groups)
    idle_s = _cpu.pool_info(two_groups)["idle_before_park_us"] * 1e-6
    deadline = time.monotonic() + 20 * idle_s
    while _cpu.pool_info(two_groups)["parked_threads"] < 2 and time.monotonic() < deadline:
        time.sleep(idle_s)
    assert _cpu.pool_info(two_groups)["parked_threads"] == 2
    report = _cpu_testing.pool_run_test(2, 3, pool=two_groups)  # the futex wake path
    assert report["counts"] == [1] * 12
    assert _cpu.pool_info(two_groups)["parked_threads"] == 0
