"""The machine profile: measured on tiny layers, stored, found again, and `hetmoe calibrate` /
`hetmoe info` around it."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hetmoe import _cpu, calibration
from hetmoe.calibration import MachineProfile
from hetmoe.cli import app

TINY: dict[str, Any] = dict(hidden=128, intermediate=64, experts=4, tokens=(4, 32),
                            read_bytes=2**24, repeats=2)
"""Sizes that keep a measurement in tens of milliseconds."""

runner = CliRunner()


@pytest.fixture(scope="module")
def profile() -> MachineProfile:
    return calibration.measure(calibration.FORMATS, torch.device("cpu"), **TINY)


@dataclasses.dataclass
class Cache:
    path: Path
    """An empty cache dir (HETMOE_CACHE_DIR)."""
    measured: list[tuple[str, ...]]
    """The formats of each `calibration.measure` call (made at TINY sizes)."""


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cache:
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path))
    cache = Cache(tmp_path, [])
    real = functools.partial(calibration.measure, **TINY)

    def counted(formats: Any = calibration.DEFAULT_FORMATS, device: Any = None,
                progress: Any = None) -> MachineProfile:
        cache.measured.append(tuple(formats))
        return real(formats, device, progress)

    monkeypatch.setattr(calibration, "measure", counted)
    return cache


def test_measured_rates_are_positive_and_finite(profile: MachineProfile) -> None:
    assert profile.machine == calibration.fingerprint(None)
    assert profile.cpu_threads == _cpu.pool_info()["threads"]
    when = datetime.fromisoformat(profile.measured_at)
    assert when.utcoffset() == timedelta(0)
    assert list(profile.cpu_flops) == list(calibration.FORMATS)
    for rate in (profile.cpu_read_bytes_s, profile.cpu_call_s, *profile.cpu_flops.values()):
        assert math.isfinite(rate) and rate > 0
    # Plausible magnitudes for any CPU: reads of 1-2000 GB/s, a call under 10 ms, kernels
    # between 1 GFLOP/s and 1 PFLOP/s.
    assert 1e9 < profile.cpu_read_bytes_s < 2e12
    assert profile.cpu_call_s < 1e-2
    assert all(1e9 < rate < 1e15 for rate in profile.cpu_flops.values())
    assert (profile.h2d_bytes_s, profile.d2h_bytes_s, profile.gpu_flops) == (None, None, None)


def test_measure_reports_each_step_and_checks_its_arguments() -> None:
    steps: list[str] = []
    assert calibration.measure(("int8",), None, steps.append, **TINY).cpu_int4_kernel is None
    assert steps == ["CPU read bandwidth", "CPU call overhead", "int8 experts on the CPU"]
    with pytest.raises(ValueError, match="formats must be among bf16, int8, int4, fp8 .*'int3'"):
        calibration.measure(("bf16", "int3"), **TINY)
    with pytest.raises(ValueError, match=r"tokens must be two increasing .* \(32, 4\)"):
        calibration.measure(("bf16",), **{**TINY, "tokens": (32, 4)})


def test_save_and_load_round_trip(profile: MachineProfile, tmp_path: Path) -> None:
    path = calibration.save(profile, tmp_path / "sub" / "profile.json")
    assert path == tmp_path / "sub" / "profile.json"
    assert json.loads(path.read_text())["version"] == calibration.PROFILE_VERSION
    assert calibration.load(path) == profile
    assert not list(path.parent.glob("*.tmp"))


def test_another_machine_or_version_is_not_used(profile: MachineProfile, tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    assert calibration.load(path) is None  # absent
    calibration.save(dataclasses.replace(profile, machine="another box"), path)
    assert calibration.load(path) is None
    calibration.save(profile, path)
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "version": calibration.PROFILE_VERSION - 1}))
    assert calibration.load(path) is None


@pytest.mark.parametrize(("text", "problem"), [
    ("{not json", "not a readable machine profile"),
    ("[1, 2]", "a machine profile is a JSON object, found list"),
    (f'{{"version": {calibration.PROFILE_VERSION}, "machine": "x"}}',
     "machine profile lacks field\\(s\\) measured_at, cpu_threads, "),
])
def test_a_corrupt_file_is_an_error_naming_it(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{path}: {problem}"):
        calibration.load(path)


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("cpu_read_bytes_s", -1.0, "field cpu_read_bytes_s must be a positive number, found -1.0"),
    ("cpu_call_s", None, "field cpu_call_s must be a positive number, found None"),
    ("cpu_threads", 0, "field cpu_threads must be a positive integer, found 0"),
    ("cpu_flops", {"bf16": "fast"}, "field cpu_flops must map formats to positive numbers"),
    ("gpu_flops", [1.0], "field gpu_flops must map formats to positive numbers"),
    ("cpu_int4_kernel", 5, "field cpu_int4_kernel must be a string or null, found 5"),
])
def test_a_wrong_field_is_an_error_naming_it(profile: MachineProfile, tmp_path: Path,
                                             field: str, value: object, problem: str) -> None:
    path = calibration.save(profile, tmp_path / "profile.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(ValueError, match=f"^{path}: {problem}"):
        calibration.load(path)


def test_current_measures_once_then_loads(cache: Cache) -> None:
    first = calibration.current(None)
    assert cache.measured == [calibration.DEFAULT_FORMATS]
    assert calibration.profile_path() == cache.path / "machine_profile.json"
    assert calibration.load() == first
    assert calibration.current(torch.device("cpu"), ("int8",)) == first
    assert cache.measured == [calibration.DEFAULT_FORMATS]
    # A format not stored yet: measured with the stored ones, so none is lost.
    second = calibration.current(None, ("fp8",))
    assert cache.measured[1] == ("fp8", "bf16", "int8", "int4")
    assert set(second.cpu_flops) == {"fp8", "bf16", "int8", "int4"}
    assert calibration.load() == second


def test_int4_kernel_names_the_amx_int4_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMX the AMX int4 kernel (HETMOE_AMX_INT4) names it; elsewhere the ISA's one kernel."""
    isa = _cpu.best_isa()
    assert calibration.int4_kernel() == (f"amx-{_cpu.amx_int4_kernel()}" if isa == "amx" else isa)
    monkeypatch.setenv("HETMOE_ISA", "avx2")  # the cap CpuMoE's layers obey
    assert calibration.int4_kernel() == "avx2"
    if isa != "amx":  # a cap this CPU lacks is refused, as a layer made under it would be
        monkeypatch.setenv("HETMOE_ISA", "amx")
        with pytest.raises(ValueError, match="ISA 'amx' was requested but this CPU/OS lacks"):
            calibration.int4_kernel()
    monkeypatch.delenv("HETMOE_ISA")
    monkeypatch.setattr(_cpu, "resolve_isa", lambda name: "amx")
    monkeypatch.setattr(_cpu, "amx_int4_kernel", lambda: "bf16")
    assert calibration.int4_kernel() == "amx-bf16"


@pytest.mark.parametrize(("stored_kernel", "named"), [
    ("amx-other", "are of the amx-other int4 kernel"),
    (None, "do not say which int4 kernel timed them (a file from before that field)")])
def test_int4_rates_of_another_kernel_are_measured_again(
        cache: Cache, profile: MachineProfile, caplog: pytest.LogCaptureFixture,
        stored_kernel: str | None, named: str) -> None:
    """int4 rates timed on another int4 kernel (HETMOE_AMX_INT4 changed), or in a file from
    before the kernel was recorded (no field), do not cover int4: measured again (with the
    stored formats) saying why; the other formats are still covered."""
    assert profile.cpu_int4_kernel == calibration.int4_kernel()
    path = calibration.save(dataclasses.replace(profile, cpu_int4_kernel="amx-other"))
    raw = json.loads(path.read_text())
    if stored_kernel is None:
        del raw["cpu_int4_kernel"]
    path.write_text(json.dumps(raw))
    stored = calibration.load()
    assert stored is not None and stored.cpu_int4_kernel == stored_kernel
    assert calibration.current(None, ("int8", "fp8")) == stored
    assert cache.measured == []
    with caplog.at_level(logging.INFO, logger="hetmoe.calibration"):
        fresh = calibration.current(None, ("int4",))
    assert cache.measured == [("int4", "bf16", "int8", "fp8")]
    assert fresh.cpu_int4_kernel == calibration.int4_kernel()
    assert caplog.records[0].getMessage() == (
        "measuring this machine's rates (int4, bf16, int8, fp8 experts), once: the stored int4 "
        f"rates {named}, this process runs {calibration.int4_kernel()} "
        "(`hetmoe calibrate` measures again)")
    assert calibration.current(None, ("int4",)) == fresh == calibration.load()
    assert len(cache.measured) == 1


def test_current_measures_again_for_another_pool_size(
        cache: Cache, profile: MachineProfile, caplog: pytest.LogCaptureFixture) -> None:
    calibration.save(dataclasses.replace(profile, cpu_threads=profile.cpu_threads + 7))
    with caplog.at_level(logging.INFO, logger="hetmoe.calibration"):
        assert calibration.current(None).cpu_threads == profile.cpu_threads
    assert cache.measured == [calibration.FORMATS]  # the stored profile's formats kept
    assert caplog.records[0].getMessage().endswith(
        f"once: the stored rates are of {profile.cpu_threads + 7} pool threads, this pool has "
        f"{profile.cpu_threads} (`hetmoe calibrate` measures again)")


def test_current_replaces_a_corrupt_file(cache: Cache, caplog: pytest.LogCaptureFixture) -> None:
    path = calibration.profile_path()
    path.write_text("{not json")
    with caplog.at_level(logging.INFO, logger="hetmoe.calibration"):
        profile = calibration.current(None)
    assert cache.measured == [calibration.DEFAULT_FORMATS]
    assert calibration.load() == profile
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages[0][0] == "WARNING"
    assert messages[0][1].startswith(f"{path}: not a readable machine profile")
    assert messages[-1][1].startswith("machine profile measured in ")
    assert messages[-1][1].endswith(f" s, saved to {path}")


def test_calibrate_writes_the_profile_and_info_shows_it(cache: Cache) -> None:
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert ("profile          none stored for this machine; `hetmoe calibrate` makes one"
            in result.stdout.splitlines())
    result = runner.invoke(app, ["calibrate", "--formats", "bf16,int4", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    path = cache.path / "machine_profile.json"
    assert f"saved to {path}" in result.stdout
    assert "timing int4 experts on the CPU" in result.stderr
    stored = calibration.load()
    assert stored is not None and list(stored.cpu_flops) == ["bf16", "int4"]
    rows = calibration.summary(stored)
    for key in ("cpu_read", "cpu_call", "cpu_bf16", "cpu_int4"):
        assert f"│ {key}" in result.stdout and rows[key] in result.stdout
    assert rows["cpu_call"].endswith(" µs") and rows["cpu_bf16"].endswith(" TFLOPS")
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert f"profile          {path}" in lines
    assert f"cpu_int4         {rows['cpu_int4']}" in lines
    assert f"cpu_read         {rows['cpu_read']}" in lines


def test_calibrate_out_writes_there(cache: Cache) -> None:
    out = cache.path / "elsewhere.json"
    result = runner.invoke(app, ["calibrate", "--formats", "int8", "--device", "cpu",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"saved to {out}" in result.stdout
    assert not calibration.profile_path().exists()
    stored = calibration.load(out)
    assert stored is not None and list(stored.cpu_flops) == ["int8"]


def test_info_names_a_corrupt_profile(cache: Cache) -> None:
    calibration.profile_path().write_text("[]")
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert (f"profile          unreadable ({calibration.profile_path()}: a machine profile is a "
            "JSON object, found list); `hetmoe calibrate` measures a new one") in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--formats", "bf16,int3"], "formats must be among bf16, int8, int4, fp8"),
    (["--formats", ","], "(at least one), got none"),
    (["--device", "tpu"], "device 'tpu' is not a device name torch knows"),
    (["--device", "mps"], "device 'mps': hetmoe runs on cpu or cuda[:N]"),
    pytest.param(["--device", "cuda"], "no CUDA GPU is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
])
def test_calibrate_refuses_bad_options_before_measuring(cache: Cache, args: list[str],
                                                        message: str) -> None:
    result = runner.invoke(app, ["calibrate", *args])
    assert result.exit_code == 2, result.output
    assert f"Error: Invalid value for '--{args[0][2:]}': " in result.output
    assert message in result.output
    assert cache.measured == []
    assert not calibration.profile_path().exists()


def test_info_prints_where_prefill_runs_from_the_profile(cache: Cache, profile: MachineProfile,
                                                          tiny_dir: Any) -> None:
    from hetmoe.cli_convert import PREFILL_LENGTHS
    from hetmoe.engine.placement.expert_split import describe_plan, layer_costs, plan_gpu_experts
    from hetmoe.loading.checkpoint import Checkpoint
    from hetmoe.loading.convert_plan import plan_convert

    path = tiny_dir("qwen3_moe")
    done = runner.invoke(app, ["info", str(path), "--device", "cpu"])
    assert done.exit_code == 0, done.output
    no_profile = ("prefill plan: needs this machine's profile with its GPU (`hetmoe calibrate "
                  "--device cuda`)" if torch.cuda.is_available() else
                  "prefill plan: no GPU here, so prefill runs the routed experts on the CPU")
    assert no_profile in done.output
    with_gpu = dataclasses.replace(
        profile, h2d_bytes_s=50e9, d2h_bytes_s=50e9, gpu_host_read_bytes_s=20e9,
        gpu_flops={f: 100e12 for f in profile.cpu_flops},
        gpu_expert_bytes_s={f: 60e9 for f in profile.cpu_flops})
    calibration.save(with_gpu)
    done = runner.invoke(app, ["info", str(path), "--device", "cpu"])
    assert done.exit_code == 0, done.output
    layer = plan_convert(Checkpoint.open(path), "bf16", None).layers[0]
    experts, hidden, intermediate = layer.shape
    costs = layer_costs(with_gpu, "bf16", hidden, intermediate,
                        sum(g["expert_bytes"] for g in layer.groups))
    top_k = int(Checkpoint.open(path).config.num_experts_per_tok)
    for tokens in PREFILL_LENGTHS:
        k = plan_gpu_experts(tokens, top_k, experts, costs)
        assert f"{tokens:>6} tokens  {describe_plan(k, experts)}" in done.output


def test_info_counts_the_placement_in_its_prefill_plan(cache: Cache, profile: MachineProfile,
                                                       tiny_dir: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from hetmoe.cli_convert import PREFILL_LENGTHS
    from hetmoe.engine.executor.prefill_planner import PrefillPlanner
    from hetmoe.engine.placement import placement_plan
    from hetmoe.engine.placement.expert_split import layer_costs
    from hetmoe.loading.checkpoint import Checkpoint
    from hetmoe.loading.convert_plan import plan_convert

    path = tiny_dir("qwen3_moe")
    calibration.save(dataclasses.replace(
        profile, h2d_bytes_s=50e9, d2h_bytes_s=50e9, gpu_host_read_bytes_s=20e9,
        gpu_flops={f: 100e12 for f in profile.cpu_flops},
        gpu_expert_bytes_s={f: 60e9 for f in profile.cpu_flops}))
    layer = plan_convert(Checkpoint.open(path), "bf16", None).layers[0]
    experts, hidden, intermediate = layer.shape
    size = sum(g["expert_bytes"] for g in layer.groups)
    layers = int(Checkpoint.open(path).config.num_hidden_layers)
    placed = placement_plan.plan_placement([experts] * layers, [size] * layers, 3 * size * layers)
    # As a GPU's `auto` budget would keep 3 experts of each layer (this machine may have none).
    monkeypatch.setattr(placement_plan, "planned_placement", lambda mem: placed)
    done = runner.invoke(app, ["info", str(path), "--device", "cpu"])
    assert done.exit_code == 0, done.output
    assert f"{placed.describe()} [--gpu-expert-gib auto]" in done.output
    assert "prefill plan (cost model, this machine's profile and the GPU experts above;" in (
        done.output)
    stored = calibration.load()
    assert stored is not None
    costs = layer_costs(stored, "bf16", hidden, intermediate, size)
    planner = PrefillPlanner(experts, int(Checkpoint.open(path).config.num_experts_per_tok),
                             layers, costs, refusal=lambda: "")
    planner.place(placed)
    assert planner.resident == (3,) * layers
    for tokens in PREFILL_LENGTHS:
        line = f"{tokens:>6} tokens  {planner.describe(planner.gpu_experts(tokens))}"
        assert line in done.output and "3 resident experts per layer on the GPU" in line


def test_info_prefill_plan_with_every_expert_resident_reads_no_profile(
        cache: Cache, tiny_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetmoe.engine.placement import placement_plan
    from hetmoe.loading.checkpoint import Checkpoint
    from hetmoe.loading.convert_plan import plan_convert

    path = tiny_dir("qwen3_moe")
    layer = plan_convert(Checkpoint.open(path), "bf16", None).layers[0]
    experts = layer.shape[0]
    size = sum(g["expert_bytes"] for g in layer.groups)
    layers = int(Checkpoint.open(path).config.num_hidden_layers)
    placed = placement_plan.plan_placement([experts] * layers, [size] * layers,
                                           experts * size * layers)
    assert placed.everything
    monkeypatch.setattr(placement_plan, "planned_placement", lambda mem: placed)
    loads: list[int] = []
    monkeypatch.setattr(calibration, "load", lambda: loads.append(1))  # must not be read
    done = runner.invoke(app, ["info", str(path), "--device", "cpu"])
    assert done.exit_code == 0, done.output
    assert f"{placed.describe()} [--gpu-expert-gib auto]" in done.output
    assert ("prefill plan: every routed expert resident on the GPU (above), so prefill computes "
            "them all there: no CPU expert work, nothing to stream") in done.output
    assert "tokens  " not in done.output and loads == []


def test_info_refuses_a_prefill_plan_from_another_int4_kernels_rates(
        cache: Cache, profile: MachineProfile, tiny_dir: Any) -> None:
    """`hetmoe info MODEL --experts int4` plans nothing from int4 rates another kernel timed (as
    `current` would measure them again), and the profile lines name the kernel."""
    path = tiny_dir("qwen3_moe")
    with_gpu = dataclasses.replace(
        profile, h2d_bytes_s=50e9, d2h_bytes_s=50e9, gpu_host_read_bytes_s=20e9,
        gpu_flops={f: 100e12 for f in profile.cpu_flops},
        gpu_expert_bytes_s={f: 60e9 for f in profile.cpu_flops})
    here = calibration.int4_kernel()
    assert with_gpu.cpu_int4_kernel == here
    assert f"TFLOPS ({here})" in calibration.summary(with_gpu)["cpu_int4"]
    for stored, shown in ((None, "do not say which int4 kernel timed them (a file from before "
                                 "that field)"),
                          ("another-kernel", "are of the another-kernel int4 kernel")):
        saved = dataclasses.replace(with_gpu, cpu_int4_kernel=stored)
        calibration.save(saved)
        done = runner.invoke(app, ["info", str(path), "--device", "cpu", "--experts", "int4"])
        assert done.exit_code == 0, done.output
        assert (f"prefill plan: the stored int4 rates {shown}, this process runs {here} "
                "(`hetmoe calibrate` measures them again)") in done.output
        assert calibration.summary(saved)["cpu_int4"].endswith(
            f"TFLOPS ({stored or 'kernel not recorded'})")
    calibration.save(with_gpu)
    done = runner.invoke(app, ["info", str(path), "--device", "cpu", "--experts", "int4"])
    assert done.exit_code == 0, done.output
    assert "prefill plan (cost model, this machine's profile" in done.output
