"""Worker planning on made-up topologies: NUMA nodes, SMT siblings, the caller's core, virtual
groups. `pool_plan` takes (cpu, node, core) tuples, so multi-node cases run on any machine."""

from __future__ import annotations

import pytest

from hetmoe import _cpu_testing

TWO_NODES = [(cpu, cpu // 4, cpu) for cpu in range(8)]  # node 0: CPUs 0-3, node 1: CPUs 4-7
SMT_ONE_NODE = [(cpu, 0, cpu % 4) for cpu in range(8)]  # 4 cores, CPU c and c+4 are siblings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETMOE_THREADS", raising=False)
    monkeypatch.delenv("HETMOE_NUMA_GROUPS", raising=False)


def test_default_leaves_the_lowest_cpu_and_groups_per_node() -> None:
    plan = _cpu_testing.pool_plan(TWO_NODES)
    assert plan["worker_cpus"] == [1, 2, 3, 4, 5, 6, 7]
    assert plan["groups"] == [(0, 0, 3), (1, 3, 4)]
    assert plan["virtual_groups"] is False


def test_fewer_threads_spread_round_robin_over_nodes() -> None:
    plan = _cpu_testing.pool_plan(TWO_NODES, num_threads=4)
    assert plan["worker_cpus"] == [1, 2, 4, 5]
    assert plan["groups"] == [(0, 0, 2), (1, 2, 2)]


def test_all_cpus_asked_for_uses_the_callers_cpu_too() -> None:
    assert _cpu_testing.pool_plan(TWO_NODES, num_threads=8)["worker_cpus"] == list(range(8))


def test_one_cpu_per_core_before_smt_siblings() -> None:
    assert _cpu_testing.pool_plan(SMT_ONE_NODE, num_threads=3)["worker_cpus"] == [1, 2, 3]
    assert _cpu_testing.pool_plan(SMT_ONE_NODE, num_threads=5)["worker_cpus"] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "num_groups,groups",
    [
        (1, [(-1, 0, 7)]),  # one group over both nodes: no single node backs it
        (2, [(0, 0, 3), (1, 3, 4)]),  # divides over the nodes: split at the node boundary
        (4, [(0, 0, 2), (0, 2, 1), (1, 3, 2), (1, 5, 2)]),
        (3, [(0, 0, 3), (1, 3, 2), (1, 5, 2)]),  # does not divide: one range, sizes within 1
    ],
)
def test_virtual_groups(num_groups: int, groups: list[tuple[int, int, int]]) -> None:
    plan = _cpu_testing.pool_plan(TWO_NODES, num_groups=num_groups)
    assert plan["groups"] == groups
    assert plan["virtual_groups"] is True


def test_environment_is_read_like_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMOE_THREADS", "2")
    monkeypatch.setenv("HETMOE_NUMA_GROUPS", "2")
    plan = _cpu_testing.pool_plan(TWO_NODES)
    assert plan["worker_cpus"] == [1, 4]
    assert plan["groups"] == [(0, 0, 1), (1, 1, 1)]


def test_default_grows_to_the_forced_group_count_on_small_machines() -> None:
    plan = _cpu_testing.pool_plan([(0, 0, 0), (1, 0, 1)], num_groups=2)
    assert plan["worker_cpus"] == [0, 1]
    assert plan["groups"] == [(0, 0, 1), (0, 1, 1)]
