"""The functions the forced-tool-call tests offer (arguments: json_check's bounded schemas, so a
random model ends them), the question they ask, and the check of the calls that come back."""

from __future__ import annotations

import json
from typing import Any

from json_check import SCHEMAS, check

DESCRIBE = {"type": "function", "function": {
    "name": "describe", "description": "Describe a person", "parameters": SCHEMAS["person"]}}
TAG = {"type": "function", "function": {
    "name": "tag.items-v2", "description": "Tag items", "parameters": SCHEMAS["tags"]}}
SCHEMA_OF = {"describe": SCHEMAS["person"], "tag.items-v2": SCHEMAS["tags"]}
ASK = [{"role": "user", "content": "Describe Ada."}]


def check_calls(calls: Any, names: set[str]) -> None:
    """At least one call, each of a function in `names` with arguments its schema accepts."""
    assert calls
    for call in calls:
        assert call.function.name in names
        check(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
