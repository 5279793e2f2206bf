"""What an SFT run shows and leaves behind: a progress bar (loss, tokens/s, ETA), the loss curve
as a PNG and the step log as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@dataclass(frozen=True)
class StepLog:
    """One optimizer step."""

    step: int
    """1-based step number."""
    loss: float
    """Mean loss over the step's labeled tokens (all accumulated rows)."""
    lr: float
    """Learning rate the step used."""
    tokens: int
    """Tokens the step ran through the model (labeled or not)."""
    seconds: float
    """Wall time of the step."""

    @property
    def tokens_per_s(self) -> float:
        """Training throughput of the step."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class TrainProgress:
    """A rich progress bar over the optimizer steps: loss, tokens/s, elapsed and ETA."""

    def __init__(self, total: int, done: int = 0) -> None:
        self._bar = Progress(
            TextColumn("sft"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} tok/s"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        )
        self._task = self._bar.add_task("sft", total=total, completed=done, loss="-", speed="-")

    def __enter__(self) -> TrainProgress:
        self._bar.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._bar.stop()

    def __call__(self, log: StepLog) -> None:
        self._bar.update(self._task, completed=log.step, loss=f"{log.loss:.4f}",
                         speed=f"{log.tokens_per_s:,.0f}")


def write_log(path: Path, history: list[StepLog], summary: dict[str, Any]) -> None:
    """JSON: the run's summary (config, data, totals) and every step."""
    path.write_text(json.dumps({**summary, "steps": [asdict(s) for s in history]}, indent=1))


def plot_loss(path: Path, history: list[StepLog], title: str) -> None:
    """The loss per step as a PNG (matplotlib, no display needed)."""
    # Here: choosing the Agg backend at import would change it for a program importing hetmoe.
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s.step for s in history], [s.loss for s in history], marker="." if
            len(history) < 50 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (assistant tokens)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
