"""OpenAI's function calling (`tools`, `tool_choice`) on the chat route, where the answer can be guaranteed.

`tool_choice` "required" or a named function holds the output to the call's JSON with structured output
(`shared.structured_output`): a named function's arguments (its `parameters` schema), or for "required" a list of
calls `[{"name", "arguments"}]` to the tools given. Any model then answers a call the client can parse. The tools
reach the model through its chat template (`input.tools`), as do the calls and tool results of earlier turns.
"none" answers text. "auto", the default with tools, leaves the choice to the model, so its calls must be told from
its text in its family's own format, as vLLM's parsers of the same names read them: served for a model whose file
names its `tool_call_parser`, else a 400 naming `tool_choice`:
- `hermes`: `<tool_call>{"name", "arguments"}</tool_call>` blocks (Hermes, Qwen 2.5 and 3, and their fine-tunes),
  after any text;
- `llama3_json`: an answer that is one JSON object `{"name", "parameters"}`, or several joined by `;` (Llama 3.1,
  3.2 and 3.3 with JSON tools);
- `mistral`: both of Mistral's forms. Before its v11 tokenizers, a JSON list of `{"name", "arguments"}` after
  `[TOOL_CALLS]` (Mistral 7B v0.3, Mixtral); from v11 on (Mistral Small 3.x, Ministral, Magistral, Devstral), each
  call as `[TOOL_CALLS]name[ARGS]{arguments}` (v11's `[CALL_ID]id` before `[ARGS]` taken too). These are control
  tokens, which the worker keeps in the text of a request that offers tools (`kept_tokens`), as vLLM does; call
  ids of 9 letters and digits, which Mistral's templates require when the calls come back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from shared.config import TOOL_CALL_PARSERS
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


_JSON = json.JSONDecoder()
PYTHON_TAG = "<|python_tag|>"  # Llama 3's, before a call (a special token: usually gone from the decoded text)
MISTRAL_TAG = "[TOOL_CALLS]"  # Mistral's, before the list of calls, or before each call from v11 (likewise)
MISTRAL_ARGS, MISTRAL_CALL_ID = "[ARGS]", "[CALL_ID]"  # v11 on: between a call's name and its arguments
# a function name as OpenAI takes it, then v11's call id if written, then [ARGS] (its absence tolerated, as vLLM)
_MISTRAL_NAMED = re.compile(rf"\s*([A-Za-z0-9_.:-]{{1,64}})\s*(?:{re.escape(MISTRAL_CALL_ID)}[A-Za-z0-9]*)?\s*"
                            rf"(?:{re.escape(MISTRAL_ARGS)})?\s*")

Read = Callable[[str], "tuple[str | None, list[tuple[str, str]]] | None"]


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a model family writes the calls it chooses: `read` gives an answer's (the text before the calls, or None
    if blank; [(name, arguments as JSON)]), or None where it holds no call (the text stands). For a stream: `tag`
    opens calls anywhere in the text; an answer that begins with one of `leading` (blanks aside) may be calls from
    its start."""

    read: Read
    tag: str = ""
    leading: tuple[str, ...] = ()
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's chat templates refuse others)
    kept: tuple[str, ...] = ()  # control tokens the calls are written with: kept in the text when tools are offered


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


def _call(said: Any, *, bare: bool = False) -> tuple[str, str] | None:
    """A call the model wrote, `{"name", "arguments"}` (or `"parameters"`, Llama's word), as (name, arguments as
    JSON); None where it is not one. Arguments must be an object (or JSON text of one, as some models write them),
    as an assistant message sent back must hold them. A `bare` call (no tag around it: any JSON answer could look
    like one) must name its arguments, so an answer such as `{"name": "Alice", "age": 30}` stays text."""
    if not isinstance(said, dict) or not isinstance(said.get("name"), str):
        return None
    if bare and "arguments" not in said and "parameters" not in said:
        return None
    arguments = said.get("arguments", said.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):  # a call the client could not send back on its next turn
        return None
    return said["name"], json.dumps(arguments)


def hermes_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """The `<tool_call>{"name", "arguments"}</tool_call>` blocks of `text` (the last may lack its closing tag) and
    the text before the first; None where there is none, or one is not a call."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    made = []
    for body in _HERMES_CALL.findall(text, start):
        try:
            call = _call(json.loads(body))
        except ValueError:
            return None
        if call is None:
            return None
        made.append(call)
    before = text[:start]
    return (before if before.strip() else None), made  # as streamed: the text before the first tag, unstripped


def llama3_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """An answer that is calls alone, `{"name", "parameters"}` objects joined by `;` (after `<|python_tag|>`, where
    it was kept); None for anything else."""
    rest = text.strip().removeprefix(PYTHON_TAG).lstrip()
    if not rest.startswith("{"):
        return None
    made = []
    while rest:
        try:
            said, end = _JSON.raw_decode(rest)
        except ValueError:
            return None
        if (call := _call(said, bare=True)) is None:
            return None
        made.append(call)
        rest = rest[end:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        rest = rest[1:].lstrip()
    return None, made


def mistral_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """Mistral's calls, the text before the first `[TOOL_CALLS]` being content: a JSON list of `{"name",
    "arguments"}` after it (before v11), or each call after a tag of its own as `name[ARGS]{arguments}` (v11 on);
    text the model wrote after its calls is not read (as vLLM's parser). With the tags dropped, an answer that is
    such a list alone. None for anything else, calls cut short included."""
    before, tag, body = text.partition(MISTRAL_TAG)
    if not tag:
        before, body = "", text
    made = _mistral_list(body, tagged=bool(tag))
    if made is None and tag:
        made = _mistral_named(body.split(MISTRAL_TAG))
    if made is None:
        return None
    return (before if before.strip() else None), made


def _mistral_list(body: str, *, tagged: bool) -> list[tuple[str, str]] | None:
    body = body.strip()
    try:
        said, end = _JSON.raw_decode(body) if body.startswith("[") else (None, 0)
    except ValueError:
        return None
    if not isinstance(said, list) or not said or (body[end:].strip() and not tagged):  # tagged: text after ignored
        return None
    made = []
    for c in said:
        if (call := _call(c, bare=not tagged)) is None:
            return None
        made.append(call)
    return made


def _mistral_named(pieces: list[str]) -> list[tuple[str, str]] | None:
    """v11's calls, one per piece (what followed each `[TOOL_CALLS]`): `name[ARGS]{arguments}`, any text after the
    arguments ignored (as after a list)."""
    made = []
    for piece in pieces:
        named = _MISTRAL_NAMED.match(piece)
        if named is None:
            return None
        try:
            arguments = _JSON.raw_decode(piece, named.end())[0]
        except ValueError:
            return None
        if (call := _call({"name": named.group(1), "arguments": arguments})) is None:
            return None
        made.append(call)
    return made


FORMATS: dict[str, CallFormat] = {
    # Hermes 2 Pro's tags are special tokens (Qwen's are text); Llama 3's python tag is one
    "hermes": CallFormat(hermes_calls, tag=HERMES_OPEN, kept=(HERMES_OPEN, HERMES_CLOSE)),
    "llama3_json": CallFormat(llama3_calls, leading=("{", PYTHON_TAG), kept=(PYTHON_TAG,)),
    "mistral": CallFormat(mistral_calls, tag=MISTRAL_TAG, leading=("[",), short_ids=True,
                          kept=(MISTRAL_TAG, MISTRAL_ARGS, MISTRAL_CALL_ID)),
}
assert set(FORMATS) == set(TOOL_CALL_PARSERS), "shared.config names the formats read here"


def kept_tokens(parser: str) -> tuple[str, ...]:
    """The control tokens a model whose file names `parser` writes its calls with: what the worker keeps in the text
    of a request that offers tools ("auto": the calls are read from it), where decoding drops special tokens."""
    fmt = FORMATS.get(parser)
    return fmt.kept if fmt is not None else ()


def streamable(parser: str, held: str, sent: bool) -> int:
    """How many of `held`'s first characters (an "auto" answer's text not yet streamed; `sent`: some was) may go
    out as content now: none from where calls begin, or may begin (a tag's possible start held back until known;
    an answer's start, until it shows whether it is calls)."""
    fmt = FORMATS[parser]
    if not sent and fmt.leading:
        start = held.lstrip()
        if not start or any(start.startswith(lead) or lead.startswith(start) for lead in fmt.leading):
            return 0
    if not fmt.tag:
        return len(held)
    at = held.find(fmt.tag)
    if at >= 0:
        return at
    return len(held) - next((n for n in range(min(len(held), len(fmt.tag) - 1), 0, -1)
                             if fmt.tag.startswith(held[-n:])), 0)


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
