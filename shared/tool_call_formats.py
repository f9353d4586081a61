"""How model families write the tool calls they choose (OpenAI's `tool_choice: "auto"`), read as vLLM's parsers
of the same names read them; a model's file names its format (`tool_call_parser`):
- `hermes`: `<tool_call>{"name", "arguments"}</tool_call>` blocks (Hermes, Qwen 2.5 and 3, and their fine-tunes),
  after any text;
- `llama3_json`: an answer that is one JSON object `{"name", "parameters"}`, or several joined by `;` (Llama 3.1,
  3.2 and 3.3 with JSON tools);
- `mistral`: both of Mistral's forms. Before its v11 tokenizers, a JSON list of `{"name", "arguments"}` after
  `[TOOL_CALLS]` (Mistral 7B v0.3, Mixtral); from v11 on (Mistral Small 3.x, Ministral, Magistral, Devstral), each
  call as `[TOOL_CALLS]name[ARGS]{arguments}` (v11's `[CALL_ID]id` before `[ARGS]` taken too). These are control
  tokens, which the worker keeps in the text of a request that offers tools (`kept_tokens`), as vLLM does; call
  ids of 9 letters and digits, which Mistral's templates require when the calls come back.
- `pythonic`: an answer that is a Python list of calls with keyword arguments, `[get_weather(city="Rome")]`
  (Llama 3.2 with pythonic tools, ToolACE); `llama4_pythonic` the same, between Llama 4's `<|python_start|>` and
  `<|python_end|>` where it writes them.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.config import TOOL_CALL_PARSERS

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


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, around pythonic calls


def pythonic_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """An answer that is a Python list of calls by keyword, `[name(arg=value, ...), ...]`, each value a literal
    (strings, numbers, booleans, None, lists and dicts of them), Llama 4's tags around it taken (vLLM's `pythonic`
    and `llama4_pythonic`); None for anything else: text around the list, positional arguments, an expression
    that is not a literal, a call cut short."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):].replace(PYTHON_END, "").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        said = ast.parse(body, mode="eval").body
        if not isinstance(said, ast.List) or not said.elts:
            return None
        made = []
        for call in said.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return None
            if any(k.arg is None for k in call.keywords):  # **kwargs
                return None
            # as vLLM writes them (non-ASCII kept); an infinite number is no JSON: the answer stays text
            made.append((call.func.id, json.dumps({k.arg: _literal(k.value) for k in call.keywords},
                                                  ensure_ascii=False, allow_nan=False)))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return None, made


def _literal(node: ast.expr) -> Any:
    """A call's argument as JSON holds it (vLLM's: constants, lists and dicts; a signed number too)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, bool | int | float | str)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("a sign before what is not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):  # {**other}
            raise ValueError("a dict unpacked into another")
        return {_key(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {type(node).__name__}")


def _key(node: ast.expr | None) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    raise ValueError("a dict key that is not a string")


FORMATS: dict[str, CallFormat] = {
    # Hermes 2 Pro's tags are special tokens (Qwen's are text); Llama 3's python tag is one
    "hermes": CallFormat(hermes_calls, tag=HERMES_OPEN, kept=(HERMES_OPEN, HERMES_CLOSE)),
    "llama3_json": CallFormat(llama3_calls, leading=("{", PYTHON_TAG), kept=(PYTHON_TAG,)),
    "mistral": CallFormat(mistral_calls, tag=MISTRAL_TAG, leading=("[",), short_ids=True,
                          kept=(MISTRAL_TAG, MISTRAL_ARGS, MISTRAL_CALL_ID)),
    "pythonic": CallFormat(pythonic_calls, leading=("[",)),
    # Llama 4's tags are special tokens
    "llama4_pythonic": CallFormat(pythonic_calls, leading=("[", PYTHON_START), kept=(PYTHON_START, PYTHON_END)),
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
