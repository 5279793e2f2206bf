"""What this machine has: the facts `hetmoe info` prints and benchmarks record."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from hetmoe import __version__


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def numa_nodes() -> list[str]:
    """NUMA nodes with their CPU lists, from sysfs (one entry when sysfs has none)."""
    root = Path("/sys/devices/system/node")
    nodes = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    if not nodes:
        return [f"node0: cpus 0-{(os.cpu_count() or 1) - 1}"]
    return [f"{n.name}: cpus {(n / 'cpulist').read_text().strip()}" for n in nodes]


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page modes, e.g. "enabled=madvise defrag=madvise" (the
    weights ask for huge pages with madvise; "never" leaves them on 4 KiB pages)."""
    root = Path("/sys/kernel/mm/transparent_hugepage")
    modes = []
    for name in ("enabled", "defrag"):
        try:
            text = (root / name).read_text()
        except OSError:
            return "unknown (no sysfs entry)"
        chosen = text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()
        modes.append(f"{name}={chosen}")
    return " ".join(modes)


def huge_page_bytes() -> int:
    """Bytes of this process's anonymous memory on transparent huge pages (0 when unknown)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def machine_report() -> dict[str, str]:
    """Facts about CPU, ISA, NUMA, GPU and library versions, as printable strings."""
    # The C++ extension may be absent (cpu_backend.unavailable): imported when reported.
    from hetmoe._cpu import AMX_EMULATION, cpu_features

    feats = cpu_features()
    isa = [name for name in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni") if feats[name]]
    if AMX_EMULATION:
        amx = "EMULATED in plain C++ (a developer build for testing: no timing means anything)"
    elif not feats["amx_tile"]:
        amx = "not in this CPU (prefill's expert matmuls run on AVX-512/AVX2, several times slower)"
    elif feats["amx_permitted"]:
        amx = "yes, OS permission granted"
    else:
        amx = "in the CPU but NO OS permission (the kernel refused arch_prctl): not used"
    report = {
        "hetmoe": __version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "isa": " ".join(isa) or "x86-64 baseline only",
        "amx": amx,
        "numa": "; ".join(numa_nodes()),
        "huge_pages": transparent_huge_pages(),
        "kernel": platform.release(),
    }
    try:  # a report, not a requirement: a missing library is a line of it
        import torch

        report["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            report["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
        else:
            report["gpu"] = "none (everything runs on the CPU device)"
    except ImportError:
        report["torch"] = "not installed"
    try:  # as torch above
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        report["transformers"] = "not installed"
    return report


ARCHIVAL = ".git_archival.txt"
"""At the repository root: `node: $Format:%H$`, which `git archive` replaces by the commit
(.gitattributes `export-subst`), so a tree exported that way still names its commit."""


def source_commit(root: Path) -> str:
    """The short commit of the checkout whose root is `root` (it must hold `.git` itself), or of
    a tree `git archive` exported (its ARCHIVAL file), else "unknown": an exported tree or an
    installed package never reports the commit of some repository around it."""
    if not (root / ".git").exists():
        return archived_commit(root / ARCHIVAL)
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def archived_commit(path: Path) -> str:
    """The short commit `git archive` wrote into `path` (`node: <40 hex digits>`), or "unknown"
    (no such file, or an unexported one still holding the `$Format` placeholder)."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if key.strip() == "node" and len(value) == 40 and set(value) <= set("0123456789abcdef"):
            return value[:7]
    return "unknown"
