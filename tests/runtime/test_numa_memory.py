"""numa_alloc / numa_free through the self-check: placement, alignment, argument errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmoe import _cpu_testing


def test_pages_land_on_the_requested_node() -> None:
    report = _cpu_testing.numa_alloc_check(4 << 20, node=0)  # 4 MiB: the huge-page advice path too
    assert report == {"aligned": True, "huge_page_aligned": True, "page_nodes": [0, 0, 0]}


@pytest.mark.parametrize("size", [2 << 20, (5 << 20) + 12345])
def test_large_mappings_start_on_a_huge_page(size: int) -> None:
    # A mapping of 2 MiB or more starts on a 2 MiB boundary (else its head is 4 KiB pages), and
    # numa_free releases the trimmed mapping whole (the self-check frees it: no crash, no leak).
    for _ in range(3):
        report = _cpu_testing.numa_alloc_check(size, node=-1)
        assert report["huge_page_aligned"] is True
        assert min(report["page_nodes"]) >= 0


@pytest.mark.parametrize("alignment", [64, 4096])
def test_unplaced_small_allocation_is_aligned_and_usable(alignment: int) -> None:
    report = _cpu_testing.numa_alloc_check(100, node=-1, alignment=alignment)
    assert report["aligned"] is True
    assert len(report["page_nodes"]) == 3 and min(report["page_nodes"]) >= 0


def test_zero_bytes_gives_no_memory() -> None:
    assert _cpu_testing.numa_alloc_check(0) == {"aligned": True, "huge_page_aligned": True,
                                        "page_nodes": []}


def test_bad_alignment_is_refused() -> None:
    with pytest.raises(ValueError, match=r"alignment must be a power of two up to the page size"):
        _cpu_testing.numa_alloc_check(64, node=0, alignment=100)


def test_missing_node_is_refused() -> None:
    missing = 1 + max(
        [int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*")] or [0]
    )
    with pytest.raises(ValueError, match=f"NUMA node {missing} does not exist on this machine"):
        _cpu_testing.numa_alloc_check(64, node=missing)
