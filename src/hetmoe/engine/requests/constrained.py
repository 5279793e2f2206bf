"""Constrained decoding for `response_format`: the output is JSON (any object, or a document that
matches a JSON schema) or follows a regular expression the server builds (a forced tool call in
the chat template's format), through outlines-core's token index.

A format becomes a regular expression (outlines-core's `build_regex_from_schema`; `json_object` our
own, nested `JSON_OBJECT_NESTING` levels; `regex` is one already), the regex and the tokenizer's
vocabulary as bytes (engine/requests/token_bytes.py, built once per `Constraints`) an `Index`: for
each state of the regex's automaton, the tokens that keep the text on a path to a match. Indexes are
cached by format (least recently used out), so a repeated schema is built once. Each choice of a
request walks its own `JsonConstraint` over the index: before a draw its allowed tokens become a
mask on the logits' device (a bitmask of V/32 words copied there and unpacked); each token taken
advances the state.
EOS is allowed only in a final state, so a generation that ends with EOS is a whole document.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hetmoe.engine.requests.token_bytes import token_bytes

# outlines-core is imported where a format is used (the functions below), not here: the engine
# imports this module on every path, and a request without a format never needs the library
# (GPU hosts with a bare runtime environment run and test the engine without it).

JSON_OBJECT_NESTING = 2
"""Levels of a `json_object` answer: an object whose values may be arrays or objects of scalars
(a third level makes the automaton ~30x larger: 6.6 s instead of 0.2 s per index at 49K tokens)."""

INDEX_CACHE = 32
"""Indexes kept per tokenizer (one per distinct format)."""

_KINDS = ("json_object", "json_schema", "regex")


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's answer must be: `json_object` (a JSON object), `json_schema`, or
    `regex` (text the regular expression `pattern` matches in full)."""

    type: str
    """`json_object`, `json_schema` or `regex`."""
    schema: str | None = None
    """The JSON schema as JSON text (`json_schema` only), key order kept: it orders the
    properties of the answer."""
    name: str = ""
    """The schema's name (OpenAI's `json_schema.name`) or what the regex stands for, for
    messages."""
    pattern: str | None = None
    """The regular expression (`regex` only), in outlines-core's (Rust regex) syntax."""

    def __post_init__(self) -> None:
        if self.type not in _KINDS:
            raise ValueError(f"response_format: type must be 'text', 'json_object' or "
                             f"'json_schema', got {self.type!r}")
        if (self.schema is None) != (self.type != "json_schema"):
            raise ValueError("response_format: a schema goes with type 'json_schema' only")
        if (self.pattern is None) != (self.type != "regex"):
            raise ValueError("response_format: a pattern goes with type 'regex' only")

    @classmethod
    def of(cls, value: ResponseFormat | Mapping[str, Any] | None) -> ResponseFormat | None:
        """A format from OpenAI's `response_format` object: {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
        {"type": "text"} and None are free text (None)."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"response_format must be a dict like {{'type': 'json_object'}}, "
                             f"got {type(value).__name__}")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind != "json_schema":
            return cls(str(kind))
        given = value.get("json_schema")
        spec: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        schema = spec.get("schema")
        if not isinstance(schema, Mapping):
            raise ValueError("response_format: type 'json_schema' needs json_schema.schema, a "
                             f"JSON schema object; got json_schema={_short(given)}")
        return cls("json_schema", json.dumps(schema), str(spec.get("name") or ""))

    @property
    def label(self) -> str:
        """The format as messages name it."""
        if self.type == "regex":
            return self.name or "regex"
        return f"json_schema {self.name!r}" if self.name else self.type

    def regex(self) -> str:
        """The regular expression of the answers this format allows (ValueError naming
        `response_format` when outlines-core cannot follow the schema)."""
        if self.pattern is not None:
            return self.pattern
        if self.schema is None or json.loads(self.schema) == {"type": "object"}:
            return json_object_regex()  # the library's free-form object: ~10 s per index
        from outlines_core.json_schema import build_regex_from_schema

        try:
            return str(build_regex_from_schema(self.schema))
        except Exception as exc:  # the library's message says what it cannot follow
            raise ValueError(f"response_format: {self.label}: outlines-core cannot follow this "
                             f"schema: {exc}") from None


def json_object_regex(nesting: int = JSON_OBJECT_NESTING) -> str:
    """A JSON object whose values nest at most `nesting` levels deep (arrays or objects)."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, WHITESPACE

    ws = WHITESPACE
    value = f"{STRING}|{NUMBER}|{BOOLEAN}|{NULL}"
    for level in range(nesting):
        member = f"{STRING}{ws}:{ws}({value})"
        obj = rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"
        if level == nesting - 1:
            return obj
        array = rf"\[{ws}(({value})({ws},{ws}({value}))*)?{ws}\]"
        value = f"{value}|{array}|{obj}"
    raise ValueError(f"nesting must be >= 1, got {nesting}")


@dataclass(frozen=True)
class CompiledFormat:
    """A format's index over one vocabulary; `start()` gives each choice its own walk."""

    index: Any
    """outlines_core.Index"""
    eos_token_ids: tuple[int, ...]
    """Tokens that end the answer, allowed in final states only."""
    vocab_size: int
    """Width of the logits the masks apply to."""

    def start(self) -> JsonConstraint:
        """A fresh walk from the initial state."""
        return JsonConstraint(self)


class JsonConstraint:
    """One choice's state in a compiled format: which tokens may come next."""

    def __init__(self, compiled: CompiledFormat) -> None:
        from outlines_core import Guide

        self.compiled = compiled
        self.guide = Guide(compiled.index, max_rollback=0)
        self._bits = torch.zeros((compiled.vocab_size + 31) // 32, dtype=torch.int32)  # [V/32]

    def allowed(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [V] on `device`: True for the tokens that may come next."""
        bits = self._bits
        self.guide.write_mask_into(bits.data_ptr(), bits.numel(), bits.element_size())
        final = self.guide.is_finished() or not bool(bits.any())  # a dead end may only end
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        words = bits.to(device)
        allowed = ((words[:, None] >> shifts) & 1).bool().view(-1)[:self.compiled.vocab_size]
        if final:
            eos = torch.tensor(self.compiled.eos_token_ids, dtype=torch.long, device=device)
            allowed[eos] = True
        return allowed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [V] with every token that may not come next at -inf (on their device)."""
        return logits.masked_fill(~self.allowed(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        """Moves past `token` (an end-of-sequence token ends the answer: no move)."""
        if token not in self.compiled.eos_token_ids:
            self.guide.advance(token, return_tokens=False)


class Constraints:
    """Compiled formats over one tokenizer's vocabulary (built at the first format, once)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], vocab_size: int,
                 where: str = "the model") -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.vocab_size = vocab_size
        self._where = where
        self._vocabulary: Any = None
        self._indexes: collections.OrderedDict[ResponseFormat, CompiledFormat] = (
            collections.OrderedDict())
        # Builds run outside the lock: a long one never holds up another request's hit.
        self._lock = threading.Lock()

    def compile(self, fmt: ResponseFormat) -> CompiledFormat:
        """`fmt`'s index (cached); ValueError naming `response_format` when the schema cannot
        be followed or no answer can be spelled with this vocabulary."""
        with self._lock:
            hit = self._indexes.get(fmt)
            if hit is not None:
                self._indexes.move_to_end(fmt)
                return hit

        from outlines_core import Index

        regex = fmt.regex()
        try:
            index = Index(regex, self.vocabulary())
        except Exception as exc:  # e.g. a character no token spells
            raise ValueError(f"response_format: {fmt.label}: outlines-core could not build its "
                             f"index: {exc}") from None
        compiled = CompiledFormat(index, self.eos_token_ids, self.vocab_size)
        with self._lock:
            self._indexes[fmt] = compiled
            while len(self._indexes) > INDEX_CACHE:
                self._indexes.popitem(last=False)
        return compiled

    def vocabulary(self) -> Any:
        """The tokenizer's outlines_core.Vocabulary (built once)."""
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = self._build_vocabulary()
            return self._vocabulary

    def _build_vocabulary(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"response_format needs a tokenizer; {self._where} has none")
        if not self.eos_token_ids:
            raise ValueError(f"response_format needs an end-of-sequence token; {self._where} "
                             "has none")
        from outlines_core import Vocabulary

        spelled = token_bytes(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return Vocabulary(self.eos_token_ids[0], spelled)


def compile_format(constraints: Constraints | None,
                   fmt: ResponseFormat | None) -> CompiledFormat | None:
    """`fmt` compiled by `constraints` (None: free text); a format without constraints (a
    scheduler built without them) is a ValueError."""
    if fmt is None:
        return None
    if constraints is None:
        raise ValueError("response_format is not served here (no tokenizer vocabulary)")
    return constraints.compile(fmt)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
