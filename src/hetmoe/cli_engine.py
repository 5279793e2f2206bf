"""The engine options of every command that loads a model here (generate, chat, serve), defined
once: `engine_options` adds them to a command's signature and hands the command one
`EngineOptions`, which loads the model; `--lora` values (`adapter_path`, `named_adapters`);
`--max-batch` (`MaxBatchOpt`, `batch_slots`) of the commands that take it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

import typer

from hetmoe.cli_exit import fail, load_llm
from hetmoe.config import DEFER_ORDERS, EngineConfig

if TYPE_CHECKING:
    from hetmoe.engine.engine import LLM

_DEFAULTS = EngineConfig()

MaxBatchOpt = Annotated[str, typer.Option(
    help="KV slots: requests decoded together (auto: as many as fit the memory the weights "
         "leave, at most 256)")]


def batch_slots(value: str) -> int | str:
    """`--max-batch` as `LLM`'s max_batch: "auto" or an integer >= 1, checked before any model
    work."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        fail(ValueError(f"--max-batch takes auto or an integer >= 1, got {value!r}"))
    return int(value)


def deferred_count(value: str) -> int | str:
    """`--deferred` as `EngineConfig.deferred`: "auto" or an integer >= 0."""
    if value == "auto":
        return value
    if not value.isdigit():
        fail(ValueError(f"--deferred takes auto or an integer >= 0, got {value!r}"))
    return int(value)


def deferral_order(value: str) -> str:
    """`--defer-order` as `EngineConfig.defer_order`, checked before any model work."""
    if value not in DEFER_ORDERS:
        fail(ValueError(f"--defer-order takes {' or '.join(DEFER_ORDERS)}, got {value!r}"))
    return value


def gpu_expert_bytes(gib: str) -> int | str:
    """`--gpu-expert-gib` as `EngineConfig.gpu_expert_bytes`: "auto" or GiB >= 0 in bytes."""
    if gib == "auto":
        return gib
    try:
        value = float(gib)
    except ValueError:
        value = -1.0
    if not value >= 0:
        fail(ValueError(f"--gpu-expert-gib takes auto or GiB >= 0, got {gib!r}"))
    return int(value * 2**30)


@dataclass(frozen=True)
class EngineOptions:
    """The command line's engine options (each field is the option of its name)."""

    rules: Annotated[Path | None, typer.Option(
        help="YAML rule file (default: the family's)")] = None
    """YAML rule file."""
    device: Annotated[str | None, typer.Option(
        help="cpu, cuda, cuda:N (default: cuda if any)")] = None
    """Device of the model's GPU modules."""
    dtype: Annotated[str, typer.Option(
        help="auto, float32, bfloat16 or float16")] = _DEFAULTS.dtype
    """Dtype of the non-expert weights."""
    max_seq_len: Annotated[int | None, typer.Option(
        help="Context window (default: model's, <=4096)")] = None
    """Context window."""
    experts: Annotated[str | None, typer.Option(
        help="Routed-expert backend: torch or cpu")] = None
    """Routed-expert backend."""
    deferred: Annotated[str, typer.Option(
        help="GPU decode with CPU experts: experts per token deferred to the next layer "
             "(0 = exact; auto = by this machine's measured step times, lowered when a probe's "
             "answers move)")] = str(_DEFAULTS.deferred)
    """Expert Deferral: a count or auto."""
    defer_order: Annotated[str, typer.Option(
        help="Which experts --deferred defers: misses (the default: only each token's "
             "lowest-scored CPU misses; experts resident on the GPU run at once) or score (its "
             "lowest-scored, the paper's order)")] = _DEFAULTS.defer_order
    """Expert Deferral's order."""
    prefill_experts: Annotated[str, typer.Option(
        help="GPU with CPU experts: where prefill runs the routed experts: auto (by this "
             "machine's measured costs, see hetmoe calibrate), cpu, gpu (streamed) or split "
             "(both at once)")] = _DEFAULTS.prefill_experts
    """Where prefill runs the routed experts."""
    gpu_expert_gib: Annotated[str, typer.Option(
        help="GPU decode with CPU experts: GiB of routed experts kept resident on the GPU and "
             "computed there (auto: what the GPU has left after the rest; 0: all on the "
             "CPU)")] = "auto"
    """Routed experts resident on the GPU, GiB or auto."""
    chat_template: Annotated[Path | None, typer.Option(
        help="Jinja chat template file replacing the model's (checked before loading)")] = None
    """Chat template file."""
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Print the injection report")] = False
    """Print the injection report."""

    def expert_bytes(self) -> int | str:
        """`--gpu-expert-gib` as `EngineConfig.gpu_expert_bytes` (a bad value ends the command)."""
        return gpu_expert_bytes(self.gpu_expert_gib)

    def load(self, model: str, **more: Any) -> LLM:
        """`model` loaded with these options and `more` LLM keywords (which take precedence);
        a user error ends the command with a one-line message."""
        options: dict[str, Any] = dict(
            dtype=self.dtype, max_seq_len=self.max_seq_len, experts=self.experts,
            deferred=deferred_count(self.deferred), defer_order=deferral_order(self.defer_order),
            prefill_experts=self.prefill_experts,
            chat_template=self.chat_template, verbose=self.verbose)
        if "gpu_expert_bytes" not in more:
            options["gpu_expert_bytes"] = self.expert_bytes()
        options.update(more)
        llm = load_llm(model, self.device, self.rules, **options)
        if options["deferred"] == "auto" and llm.deferral is not None:  # before any answer
            typer.echo(llm.deferral.describe(), err=True)
        if options.get("max_batch") == "auto" and llm.kv_fit is not None:  # what it chose
            typer.echo(llm.kv_fit.auto_line(), err=True)
        return llm


def engine_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` (whose parameter `engine` takes an `EngineOptions`) with each engine option as
    an option of its own, after the command's; typer reads the signature made here. A command
    parameter named as an engine option replaces it (`hetmoe batch --max-seq-len auto`): that
    field keeps its default in `engine`, and the command passes its own value to `load`."""
    own = inspect.signature(command, eval_str=True)
    kept = [p for p in own.parameters.values() if p.name != "engine"]
    hints = get_type_hints(EngineOptions, include_extras=True)  # Annotated[..., typer.Option]
    shared = [f for f in fields(EngineOptions) if f.name not in own.parameters]
    added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=hints[f.name]) for f in shared]

    @functools.wraps(command)
    def run(**given: Any) -> None:
        engine = EngineOptions(**{f.name: given.pop(f.name) for f in shared})
        command(**given, engine=engine)

    signature = own.replace(parameters=[*kept, *added])
    run.__signature__ = signature  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
    return run


def named_adapters(specs: list[str], base: str) -> dict[str, str] | None:
    """{name: path} of `--lora NAME=PATH` options (None: none), checked before loading."""
    named: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            fail(ValueError(f"--lora takes NAME=PATH, got {spec!r}"))
        if name == base or name in named:
            fail(ValueError(f"--lora name {name!r} is already the name of the base model or "
                            "of another adapter"))
        named[name] = str(adapter_path(path))
    return named or None


def adapter_path(path: str | Path) -> Path:
    """`path`, or the cached directory of the Hub LoRA adapter repo it names (org/name[@rev],
    fetched on first use)."""
    from hetmoe.loading.hub import fetch_named  # here: `hetmoe --help` never imports torch

    try:
        hub = fetch_named(path, adapter=True)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(exc)
    return Path(path) if hub is None else hub.snapshot
