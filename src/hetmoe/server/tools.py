"""Tool calling for chat completions: which tools the chat template renders, the history as the
template takes it, the reply a forced choice constrains, and the model's text turned into OpenAI
`tool_calls` (whole; streamed by tool_stream.py).

`tool_choice`: `none` renders no tools and parses nothing; `auto` renders every tool and parses
the answer; a named function renders only that tool; `required` and a named function constrain
the reply to calls (of that function) whose arguments match the function's `parameters`
(tool_grammar.py), as vLLM does; a choice the format cannot constrain is not, and a reply
without a valid call (of that function) is a 422, streamed as an error chunk.
`parallel_tool_calls: false` returns an answer's first call only. A call that does not parse
leaves the answer as text (`finish_reason` from generation); parsed calls end it with
`tool_calls`. A template that renders no tools gets the generic format (tool_generic.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hetmoe.engine.requests.constrained import ResponseFormat
from hetmoe.server.errors import APIError
from hetmoe.server.tool_generic import GENERIC, generic_turns, template_format, with_tool_prompt
from hetmoe.server.tool_grammar import ForcedReply, forced_calls
from hetmoe.server.tool_parsers import ParsedOutput, ToolCall, ToolFormat
from hetmoe.server.tool_protocol import ToolChoice, ToolDef

if TYPE_CHECKING:
    from hetmoe.server.protocol import ChatCompletionRequest, ChatMessage


class ChatRenderer(Protocol):
    """What `render_chat` uses of the server's model (`ModelService`; `hetmoe batch` sizes its
    job with a tokenizer alone before the model loads)."""

    def render(self, turns: Sequence[dict[str, Any]],
               tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of chat turns (and tools) through the model's chat template."""
        ...

    def text_ids(self, prompt: str, special_tokens: bool = True) -> list[int]:
        """Token ids of raw text (with or without the tokenizer's usual special tokens)."""
        ...


def template_text(tokenizer: Any) -> str | None:
    """A tokenizer's chat template as text (named templates, `default` and `tool_use`, joined:
    tools are parsed by the format any of them writes)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools as rendered and parsed."""

    form: ToolFormat
    tools: list[dict[str, Any]]
    """The tools given to the chat template."""
    choice: str
    """`auto`, `required` or the name of the one function to call."""
    parallel: bool
    reply: ForcedReply | None = None
    """The constrained reply of a `required` or named choice (None: not constrained)."""
    prompted: bool = False
    """The tools go into the system message: the template renders none (tool_generic.py)."""

    @property
    def prefix(self) -> str:
        """Call syntax the prompt ends with: the answer continues it."""
        return self.reply.prefix if self.reply is not None else ""

    def parse(self, text: str) -> ParsedOutput | None:
        """The answer's calls (None: the answer stays text); `text` is what the model wrote,
        after the `prefix`."""
        offered = {tool["function"]["name"] for tool in self.tools}
        if self.reply is not None:
            text = self.reply.prefix + text + self.reply.suffix
        parsed = self.form.parse(text, offered)
        if parsed is not None and not self.parallel:
            parsed = ParsedOutput(parsed.content, parsed.calls[:1])
        return parsed

    def missing_call(self, text: str) -> APIError:
        """The 422 of a `required` or named choice the answer did not follow."""
        wanted = "a tool call" if self.choice == "required" else f"a call of {self.choice!r}"
        shown = text if len(text) <= 200 else text[:197] + "..."
        return APIError(422, f"tool_choice {self.choice!r}: the model answered without "
                        f"{wanted}; its answer was {shown!r}", "tool_choice")

    def ids(self, count: int) -> list[str]:
        """Fresh ids for `count` calls."""
        return [self.form.new_id() for _ in range(count)]

    def forced(self) -> ResponseFormat | None:
        """The format a `required` or named choice constrains the reply to (None: `auto`, or
        a choice the format cannot constrain)."""
        return self.reply.format if self.reply is not None else None

    def constrained(self) -> ToolPlan:
        """This plan with its forced reply; a 400 naming `tools` when a function's parameters
        cannot be followed."""
        if self.choice == "auto" or self.form.grammar is None:
            return self
        label = "a tool call" if self.choice == "required" else f"a call of {self.choice!r}"
        try:
            reply = forced_calls(self.form.grammar, self.tools, self.parallel, label)
        except ValueError as exc:
            raise APIError(400, f"field 'tools': tool_choice {self.choice!r} constrains the "
                           f"reply to the functions' parameters; {exc}", "tools") from None
        return dataclasses.replace(self, reply=reply)


def refuse_unserved(body: ChatCompletionRequest) -> None:
    """400s naming fields this server does not serve rather than ignoring them."""
    if body.functions is not None or body.function_call is not None:
        field = "functions" if body.functions is not None else "function_call"
        raise APIError(400, f"field '{field}': deprecated by OpenAI and not served; send "
                       "'tools' and 'tool_choice' instead", field)


def plan_tools(body: ChatCompletionRequest, template: str | None) -> ToolPlan | None:
    """A chat completion's tool plan (None: a plain chat), or a 400 naming the field at fault;
    a JSON `response_format` cannot be a tool call, so it refuses `required` / named calls."""
    refuse_unserved(body)
    plan = make_plan(body.tools, body.tool_choice, body.parallel_tool_calls is not False,
                     template)
    fmt = body.response_format
    if plan is not None and plan.choice != "auto" and fmt is not None and fmt.type != "text":
        raise APIError(400, f"field 'response_format': a {fmt.type} answer cannot be the tool "
                       f"call that tool_choice {plan.choice!r} demands; drop one of them",
                       "response_format")
    return plan


def make_plan(offered: Sequence[ToolDef] | None, choice: ToolChoice | None, parallel: bool,
              template: str | None) -> ToolPlan | None:
    """The plan of `offered` tools under `choice` for a model with chat `template` (None: no
    tools), or a 400 naming the field at fault."""
    if not offered:
        if choice is not None and choice != "none":
            raise APIError(400, "field 'tool_choice': needs 'tools' to choose from", "tool_choice")
        return None
    names = [tool.function.name for tool in offered]
    if len(set(names)) != len(names):
        raise APIError(400, "field 'tools': function names must be unique", "tools")
    if choice == "none":
        return None
    form, prompted = template_format(template)
    if form is None:
        raise APIError(400, "field 'tools': no tool-call parser knows this model's chat "
                       "template (known: Qwen/Hermes <tool_call>, Mistral [TOOL_CALLS], "
                       "DeepSeek-V3/V3.1 tool-call tokens; a template that renders no tools "
                       "gets generic JSON calls)", "tools")
    tools = [tool.template_dict() for tool in offered]
    if choice is None or isinstance(choice, str):
        return ToolPlan(form, tools, choice or "auto", parallel, None, prompted).constrained()
    name = choice.function.name
    if name not in names:
        raise APIError(400, f"field 'tool_choice': function {name!r} is not among 'tools' "
                       f"({', '.join(names)})", "tool_choice")
    named = [t for t in tools if t["function"]["name"] == name]
    return ToolPlan(form, named, name, False, None, prompted).constrained()


def render_chat(service: ChatRenderer, messages: Sequence[ChatMessage],
                plan: ToolPlan | None) -> list[int]:
    """Prompt ids of the messages (and the plan's tools) through the chat template, then the
    forced reply's prefix; earlier calls' arguments go as objects, or as JSON text to a template
    that cannot take objects."""
    rendered = plan.tools if plan is not None and not plan.prompted else None
    try:
        try:
            ids = service.render(_turns(messages, plan, False), rendered)
        except Exception:
            if not any(m.tool_calls for m in messages):
                raise
            ids = service.render(_turns(messages, plan, True), rendered)
    except Exception as exc:  # a template may reject a role order; that is the client's input
        message = f"field 'messages': the chat template cannot render them: {exc}"
        raise APIError(400, message, "messages") from None
    if plan is not None and plan.prefix:
        ids += service.text_ids(plan.prefix, special_tokens=False)
    return ids


def _turns(messages: Sequence[ChatMessage], plan: ToolPlan | None,
           text_arguments: bool) -> list[dict[str, Any]]:
    """The turns for the template: with the tool prompt when the template renders no tools,
    calls and results as JSON text in the generic format."""
    turns = template_messages(messages, text_arguments)
    if plan is None or not plan.prompted:
        return turns
    if plan.form is GENERIC:
        turns = generic_turns(turns)
    return with_tool_prompt(turns, plan.tools, plan.form)


def template_messages(messages: Sequence[ChatMessage],
                      text_arguments: bool = False) -> list[dict[str, Any]]:
    """The history as chat templates take it. Arguments of earlier calls go as objects (the
    transformers convention), or as JSON text with `text_arguments` (DeepSeek's templates join
    them as strings)."""
    turns: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                arguments: Any = call.function.arguments
                if not text_arguments:
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass  # not JSON: the template gets the text the client sent
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            turn["tool_calls"] = calls
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            turn["name"] = m.name
        turns.append(turn)
    return turns


def tool_calls_json(calls: Sequence[ToolCall], ids: Sequence[str]) -> list[dict[str, Any]]:
    """`message.tool_calls` of a chat.completion."""
    return [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c, i in zip(calls, ids, strict=True)]
