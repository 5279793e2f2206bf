"""Pool sizing from arguments and the environment (HETMOE_THREADS, HETMOE_NUMA_GROUPS).

`_cpu.ThreadPool()` reads the environment at construction, so most cases build a pool in-process
under monkeypatch; the process-wide pool is built once per process, so its case runs in a child."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hetmoe import _cpu

ALLOWED = len(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(ALLOWED < 2, reason=f"needs 2 CPUs, this process may use {ALLOWED}")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETMOE_THREADS", raising=False)
    monkeypatch.delenv("HETMOE_NUMA_GROUPS", raising=False)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_threads_env_must_be_a_positive_integer(monkeypatch, value: str) -> None:
    monkeypatch.setenv("HETMOE_THREADS", value)
    with pytest.raises(
        ValueError, match=f"HETMOE_THREADS must be a positive integer, got '{value}'"
    ):
        _cpu.ThreadPool()


def test_threads_env_beyond_allowed_cpus(monkeypatch) -> None:
    monkeypatch.setenv("HETMOE_THREADS", str(ALLOWED + 1))
    expected = (
        f"HETMOE_THREADS={ALLOWED + 1} asks for more worker threads than the {ALLOWED} CPUs "
        "this process may use"
    )
    with pytest.raises(ValueError, match=expected):
        _cpu.ThreadPool()


def test_argument_beyond_allowed_cpus_names_the_argument() -> None:
    with pytest.raises(ValueError, match=rf"ThreadPool\(num_threads={ALLOWED + 1}\) asks for more"):
        _cpu.ThreadPool(num_threads=ALLOWED + 1)


def test_numa_groups_env_must_be_a_positive_integer(monkeypatch) -> None:
    monkeypatch.setenv("HETMOE_NUMA_GROUPS", "two")
    with pytest.raises(
        ValueError, match="HETMOE_NUMA_GROUPS must be a positive integer, got 'two'"
    ):
        _cpu.ThreadPool()


def test_more_groups_than_threads(monkeypatch) -> None:
    monkeypatch.setenv("HETMOE_NUMA_GROUPS", "3")
    monkeypatch.setenv("HETMOE_THREADS", "1")
    expected = (
        r"HETMOE_NUMA_GROUPS=3 needs at least 3 worker threads, the pool has 1 "
        r"\(set HETMOE_THREADS\)"
    )
    with pytest.raises(ValueError, match=expected):
        _cpu.ThreadPool()


@needs_two
def test_numa_groups_env_splits_workers(monkeypatch) -> None:
    monkeypatch.setenv("HETMOE_NUMA_GROUPS", "2")
    pool = _cpu.ThreadPool()  # default size grows to the group count when the CPUs allow it
    info = _cpu.pool_info(pool)
    assert info["groups"] == 2
    assert info["virtual_groups"] is True
    assert sum(info["group_sizes"]) == info["threads"] >= 2
    assert max(info["group_sizes"]) - min(info["group_sizes"]) <= 1


def test_arguments_override_environment(monkeypatch) -> None:
    monkeypatch.setenv("HETMOE_THREADS", "abc")  # not read: the argument wins
    info = _cpu.pool_info(_cpu.ThreadPool(num_threads=1, num_groups=1))
    assert (info["threads"], info["groups"], info["group_sizes"]) == (1, 1, [1])


@needs_two
def test_global_pool_reads_environment_in_a_fresh_process() -> None:
    code = (
        "import json; from hetmoe import _cpu, _cpu_testing; info = _cpu.pool_info(); "
        "report = _cpu_testing.pool_run_test(2, 3); "
        "print(json.dumps({'info': info, 'counts': report['counts'], 'shape': report['shape']}))"
    )
    env = {**os.environ, "HETMOE_NUMA_GROUPS": "2", "HETMOE_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["info"]["groups"] == 2
    assert result["info"]["group_sizes"] == [1, 1]
    assert result["shape"] == [2, 2, 3]
    assert result["counts"] == [1] * 12


def test_global_pool_reports_bad_environment_in_a_fresh_process() -> None:
    env = {**os.environ, "HETMOE_THREADS": "many"}
    out = subprocess.run(
        [sys.executable, "-c", "from hetmoe import _cpu; _cpu.pool_info()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "ValueError: HETMOE_THREADS must be a positive integer, got 'many'" in out.stderr
