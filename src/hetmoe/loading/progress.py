"""The loading progress bar: bytes read out of bytes to read, quiet when not on a terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@contextmanager
def byte_progress(
    total: int, description: str, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """Yields `advance(nbytes)`; draws a rich bar on stderr only if `enabled` and it is a TTY."""
    if not (enabled and sys.stderr.isatty()):
        yield lambda nbytes: None
        return

    columns = (
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)


@contextmanager
def step_progress(
    total: int, description: str, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """Yields `advance(steps)` for a count of `total` steps (tensors, layers); drawn like
    `byte_progress`, on stderr only if `enabled` and it is a TTY."""
    if not (enabled and sys.stderr.isatty()):
        yield lambda steps: None
        return

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda steps: bar.advance(task, steps)
