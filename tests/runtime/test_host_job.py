"""The CUDA host-function path: C entry points that submit / wait a pool job.

Without a GPU the entry points are called through ctypes from a plain thread, as the CUDA callback
thread would call them; with one, they run from a real stream and from a replayed CUDA graph."""

from __future__ import annotations

import ctypes
import gc
import re
import subprocess
import sys
import threading

import pytest
import torch

from hetmoe import _cpu

HostFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def run_on_foreign_thread(job: _cpu.CountingHostJob, rounds: int) -> None:
    """submit then wait, `rounds` times, from a thread that is neither the caller nor a worker."""
    submit, wait = HostFn(job.submit_fn), HostFn(job.wait_fn)

    def body() -> None:
        for _ in range(rounds):
            submit(job.user_data)
            wait(job.user_data)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_host_entry_points_run_the_job_each_round() -> None:
    groups = _cpu.pool_info()["groups"]
    job = _cpu.CountingHostJob(5)
    run_on_foreign_thread(job, rounds=3)
    assert job.count == 3 * 5 * groups
    assert job.take_error() == ""


def test_host_entry_points_keep_the_first_error() -> None:
    job = _cpu.CountingHostJob(4)
    job.fail = True
    run_on_foreign_thread(job, rounds=2)
    error = job.take_error()
    assert error.startswith("HostJob wait: CPU pool job ")
    assert "phase 0, group 0, task 0: injected host-job failure" in error
    assert job.take_error() == ""  # taken
    job.fail = False
    run_on_foreign_thread(job, rounds=1)
    assert job.take_error() == ""


def test_job_keeps_its_pool_alive() -> None:
    pool = _cpu.ThreadPool(num_threads=1, num_groups=1)
    job = _cpu.CountingHostJob(3, pool=pool)
    del pool
    gc.collect()
    run_on_foreign_thread(job, rounds=2)
    assert job.count == 6


def test_negative_task_count_is_refused() -> None:
    with pytest.raises(ValueError, match="tasks_per_group must be >= 0, got -1"):
        _cpu.CountingHostJob(-1)


def test_launch_without_cuda_runtime_says_why() -> None:
    # In a process that never imported torch (a CUDA build of torch loads libcudart even
    # without a GPU), so no CUDA runtime is loaded on any machine.
    script = (
        "import sys; from hetmoe import _cpu\n"
        "assert 'torch' not in sys.modules\n"
        "print(_cpu.cuda_host_available(), repr(_cpu.cuda_runtime_path()))\n"
        "try:\n"
        "    _cpu.CountingHostJob(1).launch(0)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, timeout=120)
    available, error = done.stdout.splitlines()[:2]
    assert available == "False ''"
    assert re.search(r"no CUDA runtime \(libcudart\) is loaded", error), error


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_functions_on_a_stream_and_in_a_cuda_graph() -> None:
    assert _cpu.cuda_host_available() is True
    assert "libcudart" in _cpu.cuda_runtime_path()
    groups = _cpu.pool_info()["groups"]
    job = _cpu.CountingHostJob(3)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        job.launch(stream.cuda_stream)
    stream.synchronize()
    assert job.count == 3 * groups

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        job.launch(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    assert job.count == 3 * groups * 5  # 1 stream run + 4 replays (capture runs nothing)
    assert job.take_error() == ""
