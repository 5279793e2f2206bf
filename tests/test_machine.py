"""machine.py's provenance: the commit recorded in benchmark results."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hetmoe.machine import archived_commit, source_commit


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


def test_a_tree_git_archive_exported_names_its_commit(tmp_path: Path) -> None:
    """This repository's own .git_archival.txt and .gitattributes: `git archive` fills the
    commit in, which an exported tree then reports (an unexported placeholder: "unknown")."""
    root = Path(__file__).resolve().parent.parent
    assert source_commit(tmp_path) == "unknown"
    (tmp_path / ".git_archival.txt").write_text("node: $Format:%H$\n")
    assert source_commit(tmp_path) == "unknown"
    if (root / ".git").exists():  # a checkout: export this file as `git archive` does
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        tar = subprocess.run(["git", "-C", str(root), "archive", "HEAD", ".git_archival.txt"],
                             capture_output=True, check=True).stdout
        out = tmp_path / "exported"
        out.mkdir()
        subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
        assert source_commit(out) == head[:7]
    else:  # this tree was exported itself: its file names the commit
        assert len(archived_commit(root / ".git_archival.txt")) == 7
