"""hetmoe._cpu_testing holds the hooks only tests and benchmarks call; it shares hetmoe._cpu's
core library, so its pool=None is the process-wide pool that CpuMoE layers run on."""

from __future__ import annotations

import subprocess
import sys

from hetmoe import _cpu, _cpu_testing

TEST_HOOKS = ("pool_run_test", "pool_stress", "pool_overhead_us", "pool_plan",
              "numa_alloc_check", "loaded_library_path", "FlagCountJob")


def test_test_hooks_are_only_in_the_testing_module() -> None:
    for name in TEST_HOOKS:
        assert not hasattr(_cpu, name), name
        assert hasattr(_cpu_testing, name), name


def test_testing_hooks_run_on_the_process_wide_pool() -> None:
    """Threads of a fresh process: the pool's workers start once, at _cpu's first use; the
    testing module's job then runs on them (a second pool would start more)."""
    code = (
        "import os; from hetmoe import _cpu, _cpu_testing\n"
        "def threads(): return len(os.listdir('/proc/self/task'))\n"
        "before = threads(); workers = _cpu.pool_info()['threads']; started = threads() - before\n"
        "report = _cpu_testing.pool_run_test(2, 3)\n"
        "print(started, workers, threads() - before - started, all(report['counts']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    started, workers, more, ran = out.stdout.split()
    assert (started, more, ran) == (workers, "0", "True")
