"""A chat template from a file (`--chat-template FILE`, `LLM(..., chat_template=FILE)`), read and
compiled before any model loads, so a wrong path or a broken template costs no loading time."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_chat_template(path: str | os.PathLike[str]) -> str:
    """The Jinja text of the chat template file `path`, checked to compile as transformers
    compiles templates; ValueError naming the file and what is wrong with it."""
    file = Path(path).expanduser()
    where = f"chat template {str(file)!r}"
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{where}: is a directory, not a Jinja template file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if not text.strip():
        raise ValueError(f"{where}: the file is empty")
    try:
        _compile(text)
    except Exception as exc:  # jinja2's TemplateSyntaxError / TemplateAssertionError
        line = getattr(exc, "lineno", None)
        at = f" (line {line})" if line else ""
        raise ValueError(f"{where}: not a valid Jinja template{at}: {exc}") from None
    return text


def set_chat_template(tokenizer: Any, template: str, source: str, model: Path) -> None:
    """Gives `tokenizer` the checked `template` read from `source`; ValueError when the model at
    `model` has no tokenizer to render it with."""
    if tokenizer is None:
        raise ValueError(f"chat template {source!r}: {model} has no tokenizer to render it with")
    tokenizer.chat_template = template


def chat_ids(tokenizer: Any, messages: Sequence[dict[str, Any]],
             tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of `messages` rendered by `tokenizer`'s chat template with the generation
    prompt, `tools` as the template's `tools`: THE rendering of `LLM.chat_prompt` (and so of the
    API's routes), also used by `hetmoe batch` to size a job before the model loads."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _compile(text: str) -> None:
    """Compiles `text` in transformers' template environment (its filters and extensions)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a release without the helper: jinja2's sandbox, as transformers uses
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string(text)
        return
    _compile_jinja_template(text)
