"""JSON schemas whose answers are bounded (a random model must end them) and a checker of the
subset of JSON Schema they use (jsonschema is not a dependency)."""

from __future__ import annotations

import re
from typing import Any

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "maxDigits": 3},  # outlines-core's digit bound
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "minItems": 1, "maxItems": 3},
        "done": {"type": "boolean"},
    },
    "required": ["tags", "done"],
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "maxDigits": 2},
        "owner": {
            "type": "object",
            "properties": {"login": {"type": "string", "pattern": "[a-z]{1,8}"},
                           "admin": {"type": "boolean"}},
            "required": ["login", "admin"],
        },
        "scores": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 4},
    },
    "required": ["id", "owner", "scores"],
}
SCHEMAS = {"person": PERSON, "tags": TAGS, "nested": NESTED}


def json_schema_format(name: str) -> dict[str, Any]:
    """OpenAI's `response_format` for the schema `name` of SCHEMAS."""
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def check(value: Any, schema: dict[str, Any], where: str = "$") -> None:
    """AssertionError naming the path where `value` breaks `schema`."""
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), f"{where}: {value!r} is not an object"
        properties = schema.get("properties", {})
        assert set(schema.get("required", ())) <= set(value), f"{where}: missing keys"
        unknown = set(value) - set(properties)
        assert not unknown, f"{where}: unknown keys {unknown}"
        for key, item in value.items():
            check(item, properties[key], f"{where}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{where}: {value!r} is not an array"
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
        for i, item in enumerate(value):
            check(item, schema["items"], f"{where}[{i}]")
    elif kind == "string":
        assert isinstance(value, str), f"{where}: {value!r} is not a string"
        assert len(value) <= schema.get("maxLength", len(value)), f"{where}: too long"
        assert re.fullmatch(schema.get("pattern", ".*"), value, re.S), f"{where}: {value!r}"
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r}"
        assert len(str(abs(value))) <= schema.get("maxDigits", 99), f"{where}: too many digits"
    elif kind == "boolean":
        assert isinstance(value, bool), f"{where}: {value!r} is not a boolean"
    else:
        raise AssertionError(f"{where}: the checker does not know type {kind!r}")
