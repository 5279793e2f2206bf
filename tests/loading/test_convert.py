"""`hetmoe convert` and converted directories: convert then load equals a direct load bit for
bit, an interrupted conversion finishes as an uninterrupted one, bad files are named, the plan's
sizes are the written ones, and a full disk or a model too large is refused up front."""

from __future__ import annotations

import json
import random
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from hetmoe import LLM
from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.packed_layout import host_tensor
from hetmoe.loading import Checkpoint, CheckpointError
from hetmoe.loading.convert import ConvertOptions, convert
from hetmoe.loading.convert_plan import plan_convert
from hetmoe.loading.converted import MANIFEST, open_converted
from hetmoe.presets.tiny import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IDS = [0, 7, 42, 99, 123, 200, 301, 17]


def _packed(llm: LLM) -> list[torch.Tensor]:
    return [host_tensor(part).clone() for m in llm.model.modules() if isinstance(m, CpuExperts)
            for part in m.moe.packed_groups()]


def _converted(source: Path, out: Path, fmt: str = "bf16", **kw: object) -> Path:
    return convert(source, out, ConvertOptions(fmt, progress=False, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_then_load_equals_direct_load(family: str, tiny_dir, tmp_path: Path) -> None:
    source = tiny_dir(family, dtype=torch.bfloat16)
    out = _converted(source, tmp_path / "out")
    direct = LLM(source, device="cpu", progress=False)
    mapped = LLM(out, device="cpu", progress=False)
    assert torch.equal(mapped.logits(IDS), direct.logits(IDS))
    ours, theirs = _packed(mapped), _packed(direct)
    assert len(ours) == len(theirs) > 0
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    experts = next(m for m in mapped.model.modules() if isinstance(m, CpuExperts))
    assert all(p.read_only for p in experts.moe.packed_groups())
    with pytest.raises(RuntimeError, match="mapped read-only from a file"):
        experts.moe.load_expert(0, *(torch.zeros(s) for s in _expert_shapes(experts)))


def _expert_shapes(experts: CpuExperts) -> list[tuple[int, int]]:
    spec = experts.spec
    h, i = spec.hidden_size, spec.intermediate_size
    return [(i, h), (i, h), (h, i)]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_convert_equals_direct_load(fmt: str, tiny_dir, tmp_path: Path) -> None:
    source = tiny_dir("qwen3_moe", dtype=torch.bfloat16)
    out = _converted(source, tmp_path / "out", fmt)
    rules = tmp_path / "rules.yaml"
    rules.write_text(Path(_shipped("qwen3_moe")).read_text().replace(
        "kwargs: {experts: auto}", f"kwargs: {{experts: cpu, weight_format: {fmt}}}"))
    direct = LLM(source, device="cpu", rules=rules, progress=False)
    mapped = LLM(out, device="cpu", progress=False)  # the format comes from the manifest
    assert torch.equal(mapped.logits(IDS), direct.logits(IDS))
    assert all(torch.equal(a, b) for a, b in zip(_packed(mapped), _packed(direct), strict=True))
    moe = next(m for m in mapped.model.modules() if isinstance(m, CpuExperts)).moe
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["experts"]["format"] == moe.weight_format == fmt
    assert manifest["experts"]["group_size"] == moe.group_size == 32


def _shipped(family: str) -> str:
    from hetmoe.inject.rules import shipped_rules_path

    return str(shipped_rules_path(family))


def _records(out: Path) -> dict[str, object]:
    return json.loads((out / MANIFEST).read_text())["files"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interrupted_convert_resumes_to_the_same_result(seed: int, tiny_dir,
                                                        tmp_path: Path) -> None:
    source = tiny_dir("deepseek_v2", dtype=torch.bfloat16)
    whole = _converted(source, tmp_path / "whole", "int8")
    names = list(_records(whole))
    stop_after = random.Random(seed).randrange(len(names) - 1)
    seen: list[str] = []

    def crash(name: str) -> None:
        seen.append(name)
        if len(seen) > stop_after:
            raise KeyboardInterrupt(f"killed after {name}")

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _converted(source, out, "int8", on_file=crash)
    assert not (out / MANIFEST).exists()
    with pytest.raises(CheckpointError, match=r"out: an unfinished conversion \(no manifest"):
        LLM(out, device="cpu", progress=False)
    redone: list[str] = []
    _converted(source, out, "int8", on_file=redone.append)
    assert set(redone) == set(names) - set(seen)  # complete files were skipped
    assert _records(out) == _records(whole)
    assert not list(out.rglob("*.part")) and not (out / ".convert-state.json").exists()


def test_other_settings_in_the_same_directory_are_refused(tiny_dir, tmp_path: Path) -> None:
    source = tiny_dir("qwen3_moe", dtype=torch.bfloat16)
    out = _converted(source, tmp_path / "out")
    with pytest.raises(CheckpointError, match="holds a conversion with other settings"):
        _converted(source, out, "int8")


def _broken(tmp_path: Path, source: Path) -> Path:
    out = tmp_path / "out"
    if not out.exists():
        _converted(source, out, "int8")
    return out


@pytest.mark.parametrize("problem,match", [
    ("truncated", r"layer-000\.bin: truncated: \d+ bytes, the manifest says \d+"),
    ("corrupt", r"layer-001\.bin: corrupt: its first MiB does not match"),
    ("missing", r"model\.safetensors: missing \(the manifest lists it"),
    ("version", r"manifest\.json: format version 99, this hetmoe reads version 1"),
    ("foreign", r"manifest\.json: not a hetmoe converted-model manifest"),
])
def test_bad_files_are_refused_by_name(problem: str, match: str, tiny_dir,
                                       tmp_path: Path) -> None:
    out = _broken(tmp_path, tiny_dir("qwen3_moe", dtype=torch.bfloat16))
    layer0, layer1 = out / "experts/layer-000.bin", out / "experts/layer-001.bin"
    manifest = json.loads((out / MANIFEST).read_text())
    if problem == "truncated":
        layer0.write_bytes(layer0.read_bytes()[:-4096])
    elif problem == "corrupt":
        data = bytearray(layer1.read_bytes())
        data[100] ^= 0xFF
        layer1.write_bytes(bytes(data))
    elif problem == "missing":
        (out / "model.safetensors").unlink()
    else:
        manifest["version" if problem == "version" else "format"] = 99
        (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=match):
        LLM(out, device="cpu", progress=False)


def test_verify_finds_corruption_past_the_first_mib(tiny_dir, tmp_path: Path) -> None:
    source = tiny_dir("qwen3_moe", dtype=torch.bfloat16, hidden_size=256, moe_intermediate_size=256)
    out = _converted(source, tmp_path / "out")
    layer = out / "experts/layer-001.bin"
    assert layer.stat().st_size > (1 << 20)
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0x01
    layer.write_bytes(bytes(data))
    open_converted(out)  # the cheap checks pass
    with pytest.raises(CheckpointError, match=r"layer-001\.bin: corrupt: blake2b checksum"):
        LLM(out, device="cpu", verify=True, progress=False)


def test_shape_and_numa_mismatches_are_named(tiny_dir, tmp_path: Path) -> None:
    out = _broken(tmp_path, tiny_dir("qwen3_moe", dtype=torch.bfloat16))
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["layers"][0]["groups"].append(dict(manifest["layers"][0]["groups"][0]))
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"layer-000\.bin: packed for 2 NUMA groups, this "
                                              r"machine's CPU pool has 1"):
        LLM(out, device="cpu", progress=False)


def test_plan_sizes_are_the_written_sizes(tiny_dir, tmp_path: Path) -> None:
    source = tiny_dir("mixtral", dtype=torch.bfloat16)
    plan = plan_convert(Checkpoint.open(source), "int4", None)
    out = _converted(source, tmp_path / "out", "int4")
    assert {name: (out / name).stat().st_size for name in plan.file_sizes()} == \
        plan.file_sizes()
    mapped = LLM(out, device="cpu", progress=False)
    loaded = sum(m.moe.packed_bytes for m in mapped.model.modules() if isinstance(m, CpuExperts))
    groups = sum(p.bytes for m in mapped.model.modules() if isinstance(m, CpuExperts)
                 for p in m.moe.packed_groups())
    assert plan.packed_bytes == groups >= loaded > 0
    assert json.loads((out / MANIFEST).read_text())["experts"]["packed_bytes"] == groups


def test_full_disk_is_refused_with_the_bytes_needed(tiny_dir, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1000))
    with pytest.raises(CheckpointError, match=r"needs 0\.\d+ GB more on disk \(\d+ bytes\), the "
                                              r"file system has 0\.00 GB free"):
        _converted(tiny_dir("qwen3_moe", dtype=torch.bfloat16), tmp_path / "out")
    assert not list((tmp_path / "out").rglob("*.bin"))


def test_a_model_that_cannot_fit_is_refused_before_loading(
        tiny_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetmoe.loading import memory_plan

    monkeypatch.setattr(memory_plan, "host_available", lambda: 1000)
    with pytest.raises(ValueError, match=r"does not fit: host memory: needs 0\.\d+ GB, 0\.00 GB "
                                         r"available \[routed experts \(bf16, packed\)"):
        LLM(tiny_dir("qwen3_moe", dtype=torch.bfloat16), device="cpu", progress=False)


def test_an_fp8_checkpoint_converts_to_fp8_experts_by_default(tiny_dir, tmp_path: Path) -> None:
    """`hetmoe convert` of an FP8 checkpoint keeps its experts FP8 (as `LLM` does directly):
    mapped equals direct load, logits and packed bytes."""
    from typer.testing import CliRunner

    from hetmoe.cli import app

    source = tiny_dir("deepseek_v3", fp8=True, fp8_block=32)
    out = tmp_path / "out"
    done = CliRunner().invoke(app, ["convert", str(source), str(out)])
    assert done.exit_code == 0, done.output
    assert "experts: fp8, group 32 (an FP8 checkpoint" in done.output
    # The other FP8 weights are stored dequantized in the load dtype (bf16), which the converted
    # config names, so both load alike.
    direct = LLM(source, device="cpu", progress=False)
    mapped = LLM(out, device="cpu", progress=False)
    assert next(mapped.model.parameters()).dtype == torch.bfloat16
    moe = next(m for m in mapped.model.modules() if isinstance(m, CpuExperts)).moe
    assert moe.weight_format == "fp8" and moe.group_size == 32
    assert torch.equal(mapped.logits(IDS), direct.logits(IDS))
    assert all(torch.equal(a, b) for a, b in zip(_packed(mapped), _packed(direct), strict=True))
