"""OpenAI's function calling (`tools`, `tool_choice`) on the chat route, where the answer can be guaranteed.

`tool_choice` "required" or a named function holds the output to the call's JSON with structured output
(`shared.structured_output`): a named function's arguments (its `parameters` schema), or for "required" a list of
calls `[{"name", "arguments"}]` to the tools given. Any model then answers a call the client can parse. The tools
reach the model through its chat template (`input.tools`), as do the calls and tool results of earlier turns.
"none" answers text. "auto", the default with tools, leaves the choice to the model, so its calls must be told from
its text in its family's own format: served for a model whose file names its `tool_call_parser` (`hermes`: the
`<tool_call>{"name", "arguments"}</tool_call>` blocks of Hermes, Qwen 2.5 and 3, and their fine-tunes, as vLLM's
parser of that name reads them), else a 400 naming `tool_choice`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from shared.params import MAX_TOOLS, FunctionName


class FunctionDef(msgspec.Struct, frozen=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; a forced call always follows its parameters


class ToolDef(msgspec.Struct, frozen=True):
    type: str
    function: FunctionDef


ToolDefs = Annotated[list[ToolDef], Meta(max_length=MAX_TOOLS)]


class ChosenFunction(msgspec.Struct, frozen=True):
    name: str


class ToolChoice(msgspec.Struct, frozen=True):
    type: str
    function: ChosenFunction


class ToolError(ValueError):
    """A tools request that cannot be served: (OpenAI parameter, message, unsupported or merely invalid)."""

    def __init__(self, param: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.param, self.message, self.unsupported = param, message, unsupported


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# a call's body: up to its closing tag, or to the end (the last may be cut short)
_HERMES_CALL = re.compile(f"{re.escape(HERMES_OPEN)}(.*?)(?:{re.escape(HERMES_CLOSE)}|$)", re.S)


@dataclass(frozen=True, slots=True)
class Calls:
    """How a chat answer becomes tool calls: one forced function's arguments, a list of calls ("required"), or
    the calls a model chose itself in its own format ("auto", `parser`)."""

    forced: str | None  # the named function; None: "required" or "auto"
    parser: str = ""  # "auto": the model's tool-call format
    single: bool = False  # "auto" with parallel_tool_calls false: the first call alone


def plan(tools: list[ToolDef] | None, choice: str | ToolChoice | None, parallel: bool | None,
         parser: str = "") -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None, Calls | None]:
    """The native `input.tools` (for the chat template), the `params.response_format` that holds the output to the
    call (none for "auto"), and how to read the answer back; (None, None, None) without tools or with
    `tool_choice` "none". `parser`: the model's tool-call format ("": none, "auto" is refused)."""
    tools = tools or []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise ToolError(f"tools[{i}].type", f"only 'function' tools are served (got {tool.type!r})", True)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tools", "function names must differ from each other")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None, None, None
    if not tools:
        raise ToolError("tool_choice", "there are no tools to choose from")
    native = [{"type": "function", "function": {"name": t.function.name, "description": t.function.description or "",
                                                "parameters": t.function.parameters or {}}} for t in tools]
    if isinstance(choice, ToolChoice):
        return native, {"type": "json_schema", "schema": _forced(tools, choice)}, Calls(forced=choice.function.name)
    if choice == "required":
        return native, {"type": "json_schema", "schema": _calls(tools, parallel)}, Calls(forced=None)
    if choice == "auto" and parser:
        return native, None, Calls(forced=None, parser=parser, single=parallel is False)
    if choice == "auto":
        raise ToolError("tool_choice", "'auto' is not served here: the model's tool-call format is not known (a "
                                       "model file's tool_call_parser names it; batch lines never read calls from "
                                       "text). Give 'required' or {'type': 'function', 'function': {'name': ...}}: "
                                       "the answer is then a call that follows the function's parameters", True)
    raise ToolError("tool_choice", f"must be 'none', 'auto', 'required' or a named function (got {choice!r})")


def _forced(tools: list[ToolDef], choice: ToolChoice) -> dict[str, Any]:
    """The schema of a named function's arguments."""
    if choice.type != "function":
        raise ToolError("tool_choice.type", f"only 'function' (got {choice.type!r})", True)
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise ToolError("tool_choice.function.name", f"no tool is named {choice.function.name!r}")
    return _arguments(named[0])


def _calls(tools: list[ToolDef], parallel: bool | None) -> dict[str, Any]:
    """The schema of a list of calls to the tools (one call at most without `parallel_tool_calls`). Each tool's
    parameters sit in the root's `$defs` (their own `$ref`s rebased there: pydantic's nested models refer to
    `#/$defs/...` of their own root)."""
    defs = {f"tool_{i}": _rebased(_arguments(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)}
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "$defs": defs, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": [t.function.name]},
                                          "arguments": {"$ref": f"#/$defs/tool_{i}"}},
         "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]}}
    if parallel is False:
        calls["maxItems"] = 1
    return calls


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s ("#", "#/...") pointing into it again once it sits at `base`."""
    if isinstance(schema, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


def _arguments(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def call_id(request_id: str, index: int) -> str:
    return f"call_{request_id.removeprefix('req_')}_{index}"


def answer(calls: Calls, text: str, request_id: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """The answer's (`content`, `tool_calls`): a forced call's arguments as the model wrote them (whole, or cut by
    max_tokens, as OpenAI's); a list of calls, or its text where it was cut short and cannot be read; with "auto",
    the calls found in the model's format and the text before them, or the text alone."""
    if calls.forced is not None:
        made = [(calls.forced, text)]
    elif calls.parser:
        found = hermes_calls(text)
        if found is None:
            return text, None
        content, made = found
        return content, _numbered(made[:1] if calls.single else made, request_id)
    else:
        try:
            made = [(str(c["name"]), json.dumps(c["arguments"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, None
    return None, _numbered(made, request_id)


def _numbered(made: list[tuple[str, str]], request_id: str) -> list[dict[str, Any]]:
    return [{"id": call_id(request_id, i), "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(made)]


def hermes_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """The `<tool_call>{"name", "arguments"}</tool_call>` blocks of `text` as (the text before them, or None if
    blank; [(name, arguments as JSON)]); None where there is none, or one is not such a call (the text stands):
    arguments must be an object (or JSON text of one), as an assistant message sent back must hold them."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    made = []
    for body in _HERMES_CALL.findall(text, start):
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write them as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):  # a call the client could not send back on its next turn
            return None
        made.append((call["name"], json.dumps(arguments)))
    before = text[:start]
    return (before if before.strip() else None), made  # as streamed: the text before the first tag, unstripped


def held_back(text: str) -> int:
    """How many of `text`'s last characters could begin a `<tool_call>` tag: held back from a stream until known."""
    return next((n for n in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1)
                 if HERMES_OPEN.startswith(text[-n:])), 0)


def finish(calls: Calls, reason: str) -> str:
    """OpenAI's finish_reason of an answer that made calls: `tool_calls` for calls the model chose ("auto": every
    call read whole, even where the text ran on to max_tokens after them, as vLLM answers), `stop` for a forced
    function (as OpenAI answers), `length` when cut short."""
    if calls.parser:
        return "tool_calls"
    return "tool_calls" if reason == "stop" and calls.forced is None else reason


def message_calls(at: str, raw: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as the native message takes them: arguments parsed from their JSON
    text (chat templates render them as objects)."""
    out = []
    for j, call in enumerate(raw):
        where = f"{at}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(where, "must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}")
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except (ValueError, TypeError):
            raise ToolError(f"{where}.function.arguments", "must be a JSON object, as text") from None
        if not isinstance(arguments, dict):
            raise ToolError(f"{where}.function.arguments", "must be a JSON object, as text")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out
