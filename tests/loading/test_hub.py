"""Hub names end to end against a local fake Hub (fake_hub.py, via HF_ENDPOINT): download once
into the HF cache, convert once, answer; no request on the next start; offline from the cache;
resumed after a kill; gated repos, full disks and unknown quants refused with their fix."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import typer
from fake_hub import GRANTED, FakeHub, serve, write_gguf
from typer.testing import CliRunner

from hetmoe import LLM
from hetmoe.cli import app
from hetmoe.loading.hub import fetch_model
from hetmoe.loading.hub_names import parse_hub_name

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
IDS = [1, 5, 9, 42, 7, 3]
GGUF = ["baby-Q8_0.gguf", "baby-F16.gguf", "baby-F32-00001-of-00002.gguf",
        "baby-F32-00002-of-00002.gguf"]


@pytest.fixture(scope="module")
def repos(tiny_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The baby safetensors checkpoint and a folder of its GGUF quants (Q8_0, F16, F32 split
    in two parts, plus the F32 as one file to compare with)."""
    source = tiny_dir("qwen3_moe")
    folder = tmp_path_factory.mktemp("gguf")
    write_gguf(source, folder / "baby-Q8_0.gguf", "Q8_0")
    write_gguf(source, folder / "baby-F16.gguf", "F16")
    assert [p.name for p in write_gguf(source, folder / "baby-F32.gguf", "F32", 14)] == GGUF[2:]
    whole = tmp_path_factory.mktemp("whole")
    write_gguf(source, whole / "baby-F32.gguf", "F32")
    return {"safetensors": source, "gguf": folder, "whole": whole / "baby-F32.gguf"}


@pytest.fixture()
def hub(repos: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[FakeHub]:
    """A fresh fake Hub with org/baby, org/baby-GGUF and the gated org/gated; empty caches."""
    import huggingface_hub.constants

    state = FakeHub()
    server = serve(state)
    state.put_dir("org/baby", repos["safetensors"])
    gguf_files = {name: (repos["gguf"] / name).read_bytes() for name in GGUF}
    state.put("org/baby-GGUF", {**gguf_files, "README.md": b"# baby\n"})
    state.put("org/gated", dict(state.repos["org/baby"].files), gated=True)
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path / "hetmoe"))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield state
    state.release.set()
    server.shutdown()


def _fetched(hub: FakeHub) -> list[str]:
    """Files downloaded (GET of resolve/...), in order."""
    return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path, _ in hub.requests
            if method == "GET" and "/resolve/" in path]


def test_generate_downloads_converts_answers_then_starts_without_a_request(
        hub: FakeHub, repos: dict[str, Path], tmp_path: Path) -> None:
    result = runner.invoke(app, ["generate", "org/baby", "Hello", "--max-new-tokens", "6",
                                 "--device", "cpu"])
    assert result.exit_code == 0, result.output
    # Only the model's files; answered like the local checkpoint converted the same way.
    assert sorted(_fetched(hub)) == sorted(p.name for p in repos["safetensors"].iterdir())
    local = runner.invoke(app, ["generate", str(repos["safetensors"]), "Hello",
                                "--max-new-tokens", "6", "--device", "cpu"])
    answer = result.stdout.splitlines()[-1]
    assert answer and answer == local.stdout.splitlines()[-1]
    commit = hub.repos["org/baby"].sha
    snapshot = tmp_path / "hf" / "hub" / "models--org--baby" / "snapshots" / commit
    assert (snapshot / "model.safetensors").is_file()
    converted = tmp_path / "hetmoe" / "converted" / "hub" / "org--baby" / commit
    assert [p.name for p in converted.iterdir()] == ["safetensors-bf16"]
    seen = len(hub.requests)
    again = runner.invoke(app, ["generate", "org/baby", "Hello", "--max-new-tokens", "6",
                                "--device", "cpu"])
    assert again.exit_code == 0, again.output
    assert len(hub.requests) == seen, hub.requests[seen:]
    assert again.stdout.splitlines()[-1] == answer
    assert "converting" not in again.stderr


def test_a_gguf_quant_split_in_parts_loads_as_the_whole_file(
        hub: FakeHub, repos: dict[str, Path]) -> None:
    split = LLM("org/baby-GGUF:f32", device="cpu", dtype="float32", progress=False)
    assert sorted(_fetched(hub)) == sorted(GGUF[2:])
    whole = LLM(repos["whole"], device="cpu", dtype="float32", progress=False)
    torch.testing.assert_close(split.logits(IDS), whole.logits(IDS), rtol=0, atol=0)
    q8 = LLM("org/baby-GGUF:Q8_0", device="cpu", dtype="float32", progress=False)
    assert _fetched(hub)[2:] == ["baby-Q8_0.gguf"]
    local = LLM(repos["gguf"] / "baby-Q8_0.gguf", device="cpu", dtype="float32", progress=False)
    torch.testing.assert_close(q8.logits(IDS), local.logits(IDS), rtol=0, atol=0)


def test_without_a_quant_the_largest_that_fits_is_picked_and_said(
        hub: FakeHub, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    sizes = {n: len(hub.repos["org/baby-GGUF"].files[n]) for n in GGUF}
    f16, q8 = sizes["baby-F16.gguf"], sizes["baby-Q8_0.gguf"]
    monkeypatch.setattr("hetmoe.loading.memory_plan.host_available", lambda: f16 + 1)
    model = fetch_model(parse_hub_name("org/baby-GGUF"), progress=False)  # type: ignore[arg-type]
    assert (model.quant, model.files) == ("F16", ("baby-F16.gguf",))
    err = capfd.readouterr().err
    assert "org/baby-GGUF: picked F16, the largest quant that fits in " in err
    assert f"Q8_0 {q8 / 1e9:.1f} GB" in err and "name another as org/baby-GGUF:QUANT" in err
    monkeypatch.setattr("hetmoe.loading.memory_plan.host_available", lambda: q8 - 1)
    with pytest.raises(ValueError, match=r"org/baby-GGUF: no GGUF quant fits in the .* GB of "
                                         r"free memory \(quants: Q8_0"):
        fetch_model(parse_hub_name("org/baby-GGUF"), refresh=True)  # type: ignore[arg-type]


def test_unknown_repo_quant_and_revision_are_named(hub: FakeHub) -> None:
    with pytest.raises(FileNotFoundError, match="org/nothing: no such model repo on http.*or "
                                                "it is private"):
        LLM("org/nothing", device="cpu", progress=False)
    with pytest.raises(ValueError, match=r"no quant 'Q4_K_M' in org/baby-GGUF \(quants: F16, "
                                         r"F32, Q8_0\)"):
        LLM("org/baby-GGUF:Q4_K_M", device="cpu", progress=False)
    with pytest.raises(ValueError, match="org/baby has no revision 'v9'"):
        LLM("org/baby@v9", device="cpu", progress=False)
    assert _fetched(hub) == []


def test_a_gated_repo_says_how_to_log_in_and_takes_a_token(
        hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    result = runner.invoke(app, ["generate", "org/gated", "Hi", "--device", "cpu"])
    assert result.exit_code == 1
    assert (f"error: org/gated is a gated repo (401): accept its terms at {hub.url}/org/gated "
            "with your account, then log in with `hf auth login`, or set HF_TOKEN (or pass "
            "--token)") in result.stderr
    monkeypatch.setenv("HF_TOKEN", "")  # restored after the test: --token sets it
    pulled = runner.invoke(app, ["--token", GRANTED, "pull", "org/gated", "--no-convert"])
    assert pulled.exit_code == 0, pulled.output
    assert f"org/gated: commit {hub.repos['org/gated'].sha}" in pulled.stdout


def test_a_disk_too_small_is_refused_before_any_download(
        hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("hetmoe.loading.hub.shutil.disk_usage", lambda _: usage(10**6, 0, 1000))
    need = sum(len(d) for d in hub.repos["org/baby"].files.values())
    with pytest.raises(ValueError, match=rf"org/baby: downloading 6 files needs {need} bytes "
                                         r".*; only 1000 bytes \(0.00 GB\) are free"):
        LLM("org/baby", device="cpu", progress=False)
    assert _fetched(hub) == []


def test_offline_resolves_from_the_cache_and_names_what_is_missing(
        hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"org/baby-GGUF:Q8_0: not in the cache .* and "
                                                r"HF_HUB_OFFLINE is set; run `hetmoe pull"):
        fetch_model(parse_hub_name("org/baby-GGUF:Q8_0"))  # type: ignore[arg-type]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    online = fetch_model(parse_hub_name("org/baby-GGUF:Q8_0"), progress=False)  # type: ignore
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = len(hub.requests)
    assert fetch_model(parse_hub_name("org/baby-GGUF:Q8_0")) == online  # type: ignore
    pulled = runner.invoke(app, ["pull", "org/baby-GGUF:Q8_0", "--no-convert"])
    assert pulled.exit_code == 0 and len(hub.requests) == seen, pulled.output
    assert "HF_HUB_OFFLINE is set; using the cached commit" in pulled.stderr
    (online.snapshot / "baby-Q8_0.gguf").unlink()
    with pytest.raises(FileNotFoundError, match=r"HF_HUB_OFFLINE is set and the cache lacks 1 "
                                                r"of its files \(commit .*\): baby-Q8_0.gguf"):
        fetch_model(parse_hub_name("org/baby-GGUF:Q8_0"))  # type: ignore[arg-type]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no network
    with pytest.raises(FileNotFoundError, match=r"the Hub is unreachable .* lacks 1 of its"):
        fetch_model(parse_hub_name("org/baby-GGUF:Q8_0"))  # type: ignore[arg-type]


_KILLED = """
import huggingface_hub.constants as c
c.DOWNLOAD_CHUNK_SIZE = 4096  # written as it arrives, not in 10 MB chunks
from hetmoe.loading.hub import fetch_model
from hetmoe.loading.hub_names import parse_hub_name
fetch_model(parse_hub_name("org/baby"), progress=False)
"""


def test_a_download_killed_midway_resumes_where_it_stopped(
        hub: FakeHub, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    data = hub.repos["org/baby"].files["model.safetensors"]
    hub.stall_once.add("model.safetensors")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED)],
                             env=dict(os.environ), stderr=subprocess.PIPE)
    blobs = tmp_path / "hf" / "hub" / "models--org--baby" / "blobs"
    deadline = time.monotonic() + 60
    while _partial(blobs) < len(data) // 4:  # the server sends half, then stalls
        assert child.poll() is None and time.monotonic() < deadline, child.stderr
        time.sleep(0.05)
    child.kill()
    child.wait()
    hub.release.set()
    kept = _partial(blobs)
    model = fetch_model(parse_hub_name("org/baby"), progress=False)  # type: ignore[arg-type]
    ranges = [r for m, path, r in hub.requests if m == "GET" and path.endswith("safetensors")]
    assert ranges == [None, f"bytes={kept}-"]
    assert f"hetmoe: model.safetensors: resuming after {kept} bytes" in capfd.readouterr().err
    assert (model.snapshot / "model.safetensors").read_bytes() == data


def _partial(blobs: Path) -> int:
    return sum(p.stat().st_size for p in blobs.glob("*.incomplete"))


def test_pull_ls_rm_round_trip_and_a_new_commit_is_converted_again(
        hub: FakeHub, tmp_path: Path) -> None:
    from hetmoe.loading.hub_cache import entries

    first = hub.repos["org/baby-GGUF"].sha
    pulled = runner.invoke(app, ["pull", "org/baby-GGUF:Q8_0", "--experts", "int4"])
    assert pulled.exit_code == 0, pulled.output
    assert f"org/baby-GGUF:Q8_0: commit {first}" in pulled.stdout
    converted = tmp_path / "hetmoe" / "converted" / "hub" / "org--baby-GGUF"
    assert (converted / first / "Q8_0-int4" / "manifest.json").is_file()
    seen = len(hub.requests)
    llm = LLM("org/baby-GGUF:q8_0", device="cpu", progress=False)  # the pulled layout, mapped
    assert llm.path == converted / first / "Q8_0-int4" and len(hub.requests) == seen
    rows = [(r.name, r.commit, r.layout, r.size) for r in entries()]
    gguf_bytes = len(hub.repos["org/baby-GGUF"].files["baby-Q8_0.gguf"])
    assert rows[0] == ("org/baby-GGUF:Q8_0", first, "GGUF Q8_0", gguf_bytes)
    assert rows[1][:3] == ("org/baby-GGUF:Q8_0", first, "converted int4") and rows[1][3] > 0
    listing = runner.invoke(app, ["ls"])
    assert "org/baby-GGUF:Q8_0" in listing.stdout and first[:12] in listing.stdout
    assert "converted int4" in listing.stdout
    assert f"{gguf_bytes / 1000:.1f} KB" in listing.stdout  # the GGUF's size on disk

    files = dict(hub.repos["org/baby-GGUF"].files)
    second = hub.put("org/baby-GGUF", {**files, "README.md": b"# baby, v2\n"})
    again = runner.invoke(app, ["pull", "org/baby-GGUF:Q8_0"])  # int4 as before
    assert again.exit_code == 0, again.output
    assert f"commit {second}" in again.stdout
    refs = tmp_path / "hf" / "hub" / "models--org--baby-GGUF" / "refs" / "main"
    assert refs.read_text() == second  # where transformers looks the revision up
    assert "baby-Q8_0.gguf" not in _fetched(hub)[1:]  # the same blob: not fetched again
    assert [p.name for p in converted.iterdir()] == [second]  # the old commit's layout went
    assert [p.name for p in (converted / second).iterdir()] == ["Q8_0-int4"]

    removed = runner.invoke(app, ["rm", "org/baby-GGUF"])
    assert removed.exit_code == 0 and "removed org/baby-GGUF:Q8_0" in removed.stdout
    assert "no Hub models in the cache" in runner.invoke(app, ["ls"]).stdout
    assert not (tmp_path / "hf" / "hub" / "models--org--baby-GGUF").exists()
    assert not converted.exists() or not any(converted.iterdir())
    missing = runner.invoke(app, ["rm", "org/baby-GGUF"])
    assert missing.exit_code == 1
    assert "org/baby-GGUF: not in the cache (cached: none)" in missing.stderr


def test_serve_lora_names_a_hub_adapter_repo(hub: FakeHub,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    from hetmoe.cli import named_adapters

    adapter = {"adapter_config.json": b'{"peft_type": "LORA"}',
               "adapter_model.safetensors": b"weights", "README.md": b"card"}
    commit = hub.put("org/persona-lora", adapter)
    named = named_adapters(["persona=org/persona-lora"], "org/baby")
    assert named is not None and named["persona"].endswith(f"snapshots/{commit}")
    wanted = ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in Path(named["persona"]).iterdir()) == wanted
    assert sorted(_fetched(hub)) == wanted
    with pytest.raises(typer.Exit):
        named_adapters(["x=org/baby"], "base")
    assert ("error: org/baby: not a PEFT LoRA adapter repo (needs adapter_config.json and "
            "adapter_model.safetensors; found: chat_template.jinja") in capfd.readouterr().err


def test_convert_and_info_take_hub_names(hub: FakeHub, tmp_path: Path) -> None:
    out = tmp_path / "out"
    converted = runner.invoke(app, ["convert", "org/baby-GGUF:Q8_0", str(out)])
    assert converted.exit_code == 0, converted.output
    assert "experts: int8, group 32 (Q8_0 experts" in converted.stderr
    assert (out / "manifest.json").is_file() and _fetched(hub) == ["baby-Q8_0.gguf"]
    info = runner.invoke(app, ["info", "org/baby"])
    assert info.exit_code == 0 and "memory on cpu" in info.stdout, info.output
    unknown = runner.invoke(app, ["info", "no/such-repo"])
    assert "error: no/such-repo: no such model repo on http" in unknown.stderr
