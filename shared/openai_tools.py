"""OpenAI's function calling (`tools`, `tool_choice`) on the chat route, where the answer can be guaranteed.

`tool_choice` "required" or a named function holds the output to the call's JSON with structured output
(`shared.structured_output`): a named function's arguments (its `parameters` schema), or for "required" a list of
calls `[{"name", "arguments"}]` to the tools given. Any model then answers a call the client can parse. The tools
reach the model through its chat template (`input.tools`), as do the calls and tool results of earlier turns.
"none" answers text. "auto", the default with tools, leaves the choice to the model, so its calls must be told from
its text in its family's own format (`shared.tool_call_formats`, as vLLM's parsers of the same names read them):
served for a model whose file names its `tool_call_parser`, else a 400 naming `tool_choice`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from shared.params import MAX_TOOLS, FunctionName
from shared.tool_call_formats import FORMATS


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


@dataclass(frozen=True, slots=True)
class Calls:
    """How a chat answer becomes tool calls: one forced function's arguments, a list of calls ("required"), or
    the calls a model chose itself in its own format ("auto", `parser`)."""

    forced: str | None  # the named function; None: "required" or "auto"
    parser: str = ""  # "auto": the model's tool-call format
    single: bool = False  # "auto" with parallel_tool_calls false: the first call alone
    short_ids: bool = False  # the model's template takes call ids of 9 letters and digits only
    legacy: bool = False  # asked with the deprecated `functions`: one call, answered as `function_call`


FunctionDefs = Annotated[list[FunctionDef], Meta(max_length=MAX_TOOLS)]


def legacy_plan(functions: list[FunctionDef], function_call: str | ChosenFunction | None, parser: str = "") \
        -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None, Calls | None]:
    """`plan` for the deprecated `functions` and `function_call` ("none", "auto" or {"name"}): one call at most,
    answered as `function_call`. Errors name the deprecated parameters."""
    if function_call not in (None, "none", "auto") and not isinstance(function_call, ChosenFunction):
        raise ToolError("function_call", f"must be 'none', 'auto' or {{'name': ...}} (got {function_call!r})")
    if functions and function_call in (None, "auto") and not parser:
        raise ToolError("function_call", f"'auto' is not served here: {_NO_PARSER}. Give {{'name': ...}}: the answer "
                                         "is then a call that follows the function's parameters", True)
    choice = ToolChoice("function", function_call) if isinstance(function_call, ChosenFunction) else function_call
    try:
        tools, fmt, calls = plan([ToolDef("function", f) for f in functions], choice, False, parser)
    except ToolError as exc:
        param = re.sub(r"^tools(\[\d+\])\.function", r"functions\1", exc.param)
        param = param.replace("tool_choice.function", "function_call").replace("tool_choice", "function_call")
        raise ToolError(param.replace("tools", "functions"), exc.message.replace("tool_choice", "function_call"),
                        exc.unsupported) from None
    return tools, fmt, calls and dataclasses.replace(calls, single=True, legacy=True)


_NO_PARSER = "the model's tool-call format is not known (a model file's tool_call_parser names it)"


def plan(tools: list[ToolDef] | None, choice: str | ToolChoice | None, parallel: bool | None,
         parser: str = "") -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None, Calls | None]:
    """The native `input.tools` (for the chat template), the `params.response_format` that holds the output to the
    call (none for "auto"), and how to read the answer back; (None, None, None) without tools or with
    `tool_choice` "none". `parser`: the model's tool-call format ("": none, "auto" is refused)."""
    tools = tools or []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise ToolError(f"tools[{i}].type", f"only 'function' tools are served (got {tool.type!r})", True)
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":  # a call's arguments are a JSON object: anything else is no call a next turn can send
            raise ToolError(f"tools[{i}].function.parameters", f"invalid schema for function "
                            f"{tool.function.name!r}: it must be a JSON Schema of type 'object' (got {kind!r})")
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
    short = FORMATS[parser].short_ids if parser else False
    if isinstance(choice, ToolChoice):
        return native, {"type": "json_schema", "schema": _forced(tools, choice)}, \
            Calls(forced=choice.function.name, short_ids=short)
    if choice == "required":
        return native, {"type": "json_schema", "schema": _calls(tools, parallel)}, Calls(forced=None, short_ids=short)
    if choice == "auto" and parser:
        return native, None, Calls(forced=None, parser=parser, single=parallel is False, short_ids=short)
    if choice == "auto":
        raise ToolError("tool_choice", f"'auto' is not served here: {_NO_PARSER}. Give 'required' or {{'type': "
                                       "'function', 'function': {'name': ...}}: the answer is then a call that "
                                       "follows the function's parameters", True)
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


_ID_ALPHABET = string.ascii_letters + string.digits


def call_id(request_id: str, index: int, short: bool = False) -> str:
    """A call's id: `call_<request>_<index>`, or (`short`) 9 letters and digits drawn from the same."""
    if not short:
        return f"call_{request_id.removeprefix('req_')}_{index}"
    n = int.from_bytes(hashlib.sha256(f"{request_id}/{index}".encode()).digest()[:8], "big")
    return "".join(_ID_ALPHABET[(n >> (6 * i)) % len(_ID_ALPHABET)] for i in range(9))


def answer(calls: Calls, text: str, request_id: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """The answer's (`content`, `tool_calls`): a forced call's arguments as the model wrote them (whole, or cut by
    max_tokens, as OpenAI's); a list of calls, or its text where it was cut short and cannot be read; with "auto",
    the calls found in the model's format and the text before them, or the text alone."""
    if calls.forced is not None:
        made = [(calls.forced, text)]
    elif calls.parser:
        found = FORMATS[calls.parser].read(text)
        if found is None:
            return text, None
        content, made = found
        return content, _numbered(made[:1] if calls.single else made, request_id, calls.short_ids)
    else:
        try:
            made = [(str(c["name"]), json.dumps(c["arguments"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, None
    return None, _numbered(made, request_id, calls.short_ids)


def _numbered(made: list[tuple[str, str]], request_id: str, short: bool) -> list[dict[str, Any]]:
    return [{"id": call_id(request_id, i, short), "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(made)]


def finish(calls: Calls, reason: str) -> str:
    """OpenAI's finish_reason of an answer that made calls: `tool_calls` (`function_call` for the deprecated
    `functions`) for calls the model chose ("auto": every call read whole, even where the text ran on to max_tokens
    after them, as vLLM answers), `stop` for a forced function (as OpenAI answers), `length` when cut short."""
    chose = "function_call" if calls.legacy else "tool_calls"
    if calls.parser:
        return chose
    return chose if reason == "stop" and calls.forced is None else reason


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
