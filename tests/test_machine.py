"""machine.py's provenance: the commit recorded in benchmark results."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hetmoe.machine import source_commit


def test_source_commit_is_this_checkouts_and_never_an_enclosing_repositorys(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    exported = repo / "exported"  # a tree copied into a checkout, without its own .git
    exported.mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert source_commit(repo) == head
    assert source_commit(exported) == "unknown"
    assert source_commit(tmp_path / "missing") == "unknown"
