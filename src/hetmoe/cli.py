"""Command line: generate, chat, serve, bench, calibrate, convert, info, sft, pull, ls, rm.

Help is rendered in click's plain style: typer's rich style labels every flag `<bool>`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from hetmoe import __version__, cli_batch, cli_convert, cli_engine, cli_models, cli_train
from hetmoe.chat_session import ChatSession
from hetmoe.cli_engine import EngineOptions, adapter_path, engine_options, named_adapters
from hetmoe.cli_exit import fail
from hetmoe.config import EngineConfig
from hetmoe.server.client import ChatClient, ServerError, remote_chat
from hetmoe.server.config import ServerConfig

# Commands import what they run inside their functions: `hetmoe --help` imports none of torch,
# transformers, rich, httpx, the engine or the loaders (tests/test_cli_basics.py).

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})
_DEFAULTS = EngineConfig()

# The model argument of every command that loads one; their engine options: cli_engine.py.
ModelArg = Annotated[str, typer.Argument(
    help="Checkpoint directory, GGUF file, preset (demo, demo-sparse, tiny-qwen3-moe, ...) or "
         "Hub model (org/name[@revision], org/name-GGUF[:QUANT])")]
MaxNewOpt = Annotated[int, typer.Option(help="Tokens to generate at most")]
TemperatureOpt = Annotated[float, typer.Option(help="0 = greedy")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off)")]
TopKOpt = Annotated[int, typer.Option(help="Sample among the k most likely (0 = off)")]
SeedOpt = Annotated[int | None, typer.Option(help="Sampling seed")]
StopOpt = Annotated[list[str] | None, typer.Option(metavar="TEXT",
                                                   help="Stop string (repeatable)")]
LoraOpt = Annotated[Path | None, typer.Option(
    help="PEFT LoRA adapter to apply: a directory or a Hub repo (org/name)")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hetmoe {__version__}")
        raise typer.Exit()


@app.callback()
def main(token: Annotated[str | None, typer.Option(
        help="Hugging Face token for Hub models of gated or private repos, for every command "
             "(default: HF_TOKEN, or the one `hf auth login` stored)")] = None,
         version: Annotated[bool, typer.Option(
             "--version", callback=_version, is_eager=True,
             help="Print hetmoe's version and exit")] = False) -> None:
    """hetmoe: MoE LLMs on one workstation, GPU and CPU as one machine."""
    if token:  # huggingface_hub reads HF_TOKEN at each request
        os.environ["HF_TOKEN"] = token


def checked_sampling(**sampling: Any) -> dict[str, Any]:
    """`sampling` (LLM.generate keywords), checked before any model loads: a bad value ends the
    command with a one-line message instead of after minutes of loading."""
    from hetmoe.engine.requests.sampler import sampling_params

    try:
        sampling_params(**{"stop": None, **sampling})
    except ValueError as exc:
        fail(exc)
    return sampling


@app.command()
@engine_options
def generate(
    model: ModelArg,
    prompt: Annotated[str, typer.Argument(help="Prompt text")],
    max_new_tokens: MaxNewOpt = 128,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    raw: Annotated[bool, typer.Option(
        "--raw", help="Send PROMPT as plain text, not as a user message in the chat template")
    ] = False,
    lora: LoraOpt = None,
    *,
    engine: EngineOptions,
) -> None:
    """Answer PROMPT, streamed to stdout.

    PROMPT goes to the model as one user message through its chat template when the tokenizer has
    one (what instruct models expect); with --raw, or without a template, it is continued as text.
    """
    sampling = checked_sampling(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop)
    llm = engine.load(model, lora=lora and adapter_path(lora))
    try:
        if raw or not llm.has_chat_template:
            pieces = llm.stream(prompt, **sampling)
        else:
            pieces = llm.stream_chat([{"role": "user", "content": prompt}], **sampling)
        for piece in pieces:
            typer.echo(piece, nl=False)
    except ValueError as exc:
        fail(exc)
    typer.echo()


@app.command()
@engine_options
def chat(
    model: ModelArg,
    system: Annotated[str | None, typer.Option(help="System message")] = None,
    max_new_tokens: MaxNewOpt = 512,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    url: Annotated[str | None, typer.Option(
        help="Chat with a running server (http://host:port) that serves MODEL")] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer key of the server at --url")] = None,
    lora: LoraOpt = None,
    *,
    engine: EngineOptions,
) -> None:
    """Chat with MODEL in the terminal.

    Answers stream as they are generated; Ctrl-C stops one, /exit or Ctrl-D quits. /clear
    forgets the conversation, /save FILE writes it as JSON; end a line with \\ to continue it,
    or write a message between two lines of three double quotes.
    """
    checked_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                     top_k=top_k, seed=seed)
    if url is not None:
        if engine.chat_template is not None:
            fail(ValueError("--chat-template applies to a model loaded here; the server at --url "
                            "renders with its own (hetmoe serve --chat-template FILE)"))

        client = ChatClient(url, api_key)
        try:
            client.check(model)  # a dead server or a wrong name ends here, not at each message
        except ServerError as exc:
            fail(exc)
        typer.echo(f"chat with {model} at {url}: type a message; /help lists the commands, "
                   "/exit quits")
        try:
            remote_chat(client, model, input,
                        lambda text: typer.echo(text, nl=False), system,
                        max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed)
        except ServerError as exc:
            fail(exc)
        return
    llm = engine.load(model, lora=lora and adapter_path(lora))
    typer.echo("chat: type a message; /help lists the commands, /exit quits")

    def answer(history: list[dict[str, str]]) -> str | None:
        pieces: list[str] = []
        stream = llm.stream_chat(history, max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, seed=seed)
        try:
            for piece in stream:
                typer.echo(piece, nl=False)
                pieces.append(piece)
        except ValueError as exc:  # e.g. the history outgrew the context window
            typer.echo(f"error: {exc}", err=True)
            return None
        except KeyboardInterrupt:  # Ctrl-C stops this answer; the session and history go on
            stream.close()  # cancels the request and frees its slot
            typer.echo(" [stopped]")
        else:
            typer.echo()
        return "".join(pieces)

    ChatSession(input, lambda text: typer.echo(text, nl=False), system).run(answer)


@app.command()
@engine_options
def serve(
    model: ModelArg,
    host: Annotated[str | None, typer.Option(help="Interface (default: 127.0.0.1 only)")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default: 8000; 0 = any)")] = None,
    api_key: Annotated[str | None, typer.Option(
        help="Require 'Authorization: Bearer KEY' on every route but /health")] = None,
    max_queue: Annotated[int | None, typer.Option(
        help="Requests that may wait for a slot before 429 (default: 64)")] = None,
    model_name: Annotated[str | None, typer.Option(
        help="Name clients send as `model` (default: MODEL as given)")] = None,
    max_batch: cli_engine.MaxBatchOpt = str(_DEFAULTS.max_batch),
    prefix_cache: Annotated[bool, typer.Option(
        "--prefix-cache/--no-prefix-cache",
        help="Reuse earlier requests' KV for prompts that start alike")] = _DEFAULTS.prefix_cache,
    prefill_chunk: Annotated[int, typer.Option(
        help="Prompt tokens prefilled per step while other requests decode (0 = a prompt at "
             "once)")] = _DEFAULTS.prefill_chunk or 0,
    prefill_resident_gib: Annotated[float, typer.Option(
        help="Deprecated: the former name of --gpu-expert-gib (GiB; used instead of it when "
             "> 0)")] = 0.0,
    lora: Annotated[list[str] | None, typer.Option(
        metavar="NAME=PATH",
        help="A PEFT LoRA adapter (directory or Hub repo org/name) that requests select with "
             "`model: NAME` "
             "(repeatable; the base model keeps its own name)")] = None,
    *,
    engine: EngineOptions,
) -> None:
    """Serve MODEL over an OpenAI-style API.

    OpenAI-compatible HTTP API with a chat page at /.
    """
    from hetmoe.server.app import serve as serve_app

    slots = cli_engine.batch_slots(max_batch)
    given: dict[str, Any] = dict(host=host, port=port, api_key=api_key, max_queue=max_queue,
                                 model_name=model_name)
    try:
        config = ServerConfig(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        fail(exc)
    if not prefill_resident_gib >= 0:
        fail(ValueError(f"--prefill-resident-gib must be >= 0, got {prefill_resident_gib}"))
    budget = engine.expert_bytes()
    if prefill_resident_gib > 0:
        typer.echo(f"--prefill-resident-gib is now --gpu-expert-gib (resident experts serve "
                   f"prefill and decode): {prefill_resident_gib} GiB", err=True)
        budget = int(prefill_resident_gib * 2**30)
    adapters = named_adapters(lora or [], config.model_name or model)
    llm = engine.load(model, max_batch=slots, prefix_cache=prefix_cache,
                      prefill_chunk=prefill_chunk or None, lora=adapters, gpu_expert_bytes=budget)
    serve_app(llm, config.model_name or model, config)


@app.command()
def bench(
    model: Annotated[str | None, typer.Argument(help="Checkpoint directory or preset")] = None,
    random_weights: Annotated[str | None, typer.Option(
        help="Real shape with random weights: qwen3-30b-a3b, deepseek-v2-lite, mixtral-8x7b, "
             "deepseek-v3-few-layers")] = None,
    experts: Annotated[str, typer.Option(
        help="cpu (ours), torch-cpu or accelerate (baselines)")] = "cpu",
    weight_format: Annotated[str, typer.Option(help="bf16, int8 or int4 experts")] = "bf16",
    deferred: Annotated[str, typer.Option(help="Expert Deferral values, e.g. 0,2,3")] = "0",
    defer_order: Annotated[str, typer.Option(
        help="Which experts --deferred defers: misses (each token's lowest-scored CPU misses "
             "only) or score (its lowest-scored, the paper's order)")] = _DEFAULTS.defer_order,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens before decode")] = 32,
    new_tokens: Annotated[int, typer.Option(help="Tokens decoded per run")] = 256,
    prefill: Annotated[str, typer.Option(help="Prefill lengths, e.g. 128,1024,4096")] = "128",
    eager: Annotated[bool, typer.Option(help="Also time eager decode, count launches")] = True,
    alternatives: Annotated[bool, typer.Option(
        help="With --eager: also time graph decode via the HF layers")] = True,
    trace: Annotated[Path | None, typer.Option(help="Chrome/Perfetto trace file")] = None,
    num_layers: Annotated[int | None, typer.Option(help="Fewer decoder layers")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results here")] = None,
    bandwidth_gib: Annotated[float, typer.Option(help="Read-bandwidth probe size")] = 2.0,
    gpu_expert_gib: Annotated[str, typer.Option(
        help="GiB of routed experts resident on the GPU (auto: what the GPU has left, as "
             "generate/chat/serve; 0: every expert on the CPU)")] = "auto",
) -> None:
    """Measure prefill and decode speed.

    Times MODEL, or a real shape with random weights, and prints a table (and JSON).
    """
    from hetmoe.bench.bench_config import BenchConfig
    from hetmoe.bench.harness import run_bench, table

    try:
        cfg = BenchConfig(
            shape=random_weights, model=model, experts=experts, weight_format=weight_format,
            deferred=_ints(deferred, "deferred"), defer_order=defer_order,
            prompt_len=prompt_len, new_tokens=new_tokens,
            prefill_lengths=_ints(prefill, "prefill"), eager=eager, alternatives=alternatives,
            trace=str(trace) if trace else None, num_layers=num_layers, bandwidth_gib=bandwidth_gib,
            gpu_expert_bytes=cli_engine.gpu_expert_bytes(gpu_expert_gib),
        )
        result = run_bench(cfg, log=lambda line: typer.echo(line, err=True))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(exc)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1))
    typer.echo(table([result]))


@app.command()
def calibrate(
    formats: Annotated[str, typer.Option(
        help="CPU expert formats to time: bf16, int8, int4, fp8")] = "bf16,int8,int4",
    device: Annotated[str | None, typer.Option(
        help="cuda[:N] also times pinned copies and GPU experts; cpu skips them (default: cuda "
             "if any)")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Profile file (default: machine_profile.json in the cache dir)")] = None,
) -> None:
    """Measure this machine's rates and store them.

    CPU read bandwidth, CpuMoE call overhead and expert FLOP/s per format (AMX where present),
    pinned copy bandwidth and the GPU's expert FLOP/s: where GPU prefill and the CPU+GPU split
    begin. The engine measures once by itself when no profile is stored; `hetmoe info` shows it.
    """
    from rich.console import Console
    from rich.table import Table

    from hetmoe import calibration
    from hetmoe.engine.model.model_setup import check_device

    try:
        chosen = calibration.check_formats([f.strip() for f in formats.split(",") if f.strip()])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--formats'") from None
    try:
        on = check_device(device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--device'") from None
    profile = calibration.measure(chosen, on, progress=lambda s: typer.echo(f"timing {s}",
                                                                             err=True))
    path = calibration.save(profile, out)
    table = Table("rate", "value", title=f"machine profile: {profile.machine}")
    for key, value in calibration.summary(profile).items():
        table.add_row(key, value)
    Console().print(table)
    typer.echo(f"saved to {path}")


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(
            f"--{option} takes comma-separated integers, got {text!r}") from None


app.command()(cli_convert.convert)
app.command(short_help="Print this machine's facts and rates, or MODEL's memory plan.")(
    cli_convert.info)
app.command()(cli_train.sft)
app.command()(cli_batch.batch)
app.command()(cli_models.pull)
app.command()(cli_models.ls)
app.command(short_help="Remove a cached Hub model (files, record, conversions).")(
    cli_models.rm)


if __name__ == "__main__":
    app()
