"""Structured output: a generation constrained to a JSON Schema, any JSON object, a regular expression, one of a
list of strings, or a grammar (`params.response_format`).

The types below are the native API's `response_format` (OpenAI's JSON mode and `json_schema`, and vLLM's guided
decoding, map onto them). `grammar_of` turns one into an llguidance grammar. The worker compiles it against its
model's tokenizer and masks every step's logits with it (`gpu_worker.constraints`). A gateway installed with
llguidance (the `worker` extra; `batchgate up`) checks it at submit, so a schema or pattern that cannot constrain
anything is a 422 naming the field; one without it (the Lambda package: llguidance has no wheel for the Lambda's
glibc) leaves that check to the worker, which fails such a request with `invalid_input`.

JSON comes out in one style, `{"a": 1, "b": [2, 3]}`: no free whitespace between tokens, which a model can fill
forever (a known failure of unconstrained JSON whitespace); a schema's own `x-guidance` options override it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from shared.errors import ValidationError

MAX_GRAMMAR_CHARS = 65_536  # a pattern, a grammar, a schema (as JSON) or the choices, in all
MAX_CHOICES = 256
# llguidance's JSON compile options: the separators of `json.dumps`, nothing in between
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FIELD = "params.response_format"


class JsonObject(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="json_object"):
    """Any JSON object (OpenAI's JSON mode)."""


class JsonSchema(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="json_schema"):
    """A JSON value valid under `schema` (JSON Schema; `x-guidance` in it sets llguidance's JSON options)."""

    schema: dict[str, Any]


class Regex(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="regex"):
    """Text matching `pattern` whole (Rust `regex` syntax, as vLLM's guided_regex)."""

    pattern: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]


class Choice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="choice"):
    """Exactly one of `choices`."""

    choices: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1, max_length=MAX_CHOICES)]


class Grammar(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="grammar"):
    """Text of a context-free grammar: Lark syntax, or llama.cpp's GBNF (vLLM's guided_grammar), `start` or `root`
    its first rule."""

    grammar: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]


ResponseFormat = JsonObject | JsonSchema | Regex | Choice | Grammar


def grammar_of(fmt: ResponseFormat) -> str:
    """The llguidance grammar of a format (not yet checked: `checked` does). Raises ValueError for a schema or
    grammar that cannot even be read."""
    from llguidance import LLMatcher

    if isinstance(fmt, JsonObject):
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)  # type: ignore[arg-type]
    if isinstance(fmt, JsonSchema):
        return LLMatcher.grammar_from_json_schema(fmt.schema, defaults=JSON_STYLE)  # type: ignore[arg-type]
    if isinstance(fmt, Regex):
        return LLMatcher.grammar_from_regex(fmt.pattern)
    if isinstance(fmt, Choice):
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in fmt.choices))
    from llguidance.gbnf_to_lark import any_to_lark  # GBNF becomes Lark; Lark stays as it is

    return LLMatcher.grammar_from_lark(any_to_lark(fmt.grammar))


def checked(fmt: ResponseFormat, field: str = FIELD) -> str | None:
    """`grammar_of(fmt)`, or a ValidationError naming `field` and what is wrong with it; None where llguidance is
    not installed (the worker checks it then)."""
    if len(json.dumps(msgspec.to_builtins(fmt))) > MAX_GRAMMAR_CHARS:
        raise ValidationError(field, f"longer than {MAX_GRAMMAR_CHARS} characters as JSON")
    try:
        from llguidance import LLMatcher
    except ImportError:
        return None
    try:
        grammar = grammar_of(fmt)
    except BaseException as exc:  # llguidance's ValueError, the GBNF converter's, a panic in llguidance's Rust
        raise ValidationError(field, f"cannot be compiled: {reason_of(exc)}") from None
    if error := LLMatcher.validate_grammar(grammar):
        raise ValidationError(field, f"cannot be compiled: {one_line(error)}")
    return grammar


def from_wire(raw: Any) -> ResponseFormat:
    """The typed format of a wire dict the gateway checked (a typed value as it is)."""
    if isinstance(raw, dict):
        return msgspec.convert(raw, ResponseFormat)  # type: ignore[arg-type]
    return raw  # type: ignore[no-any-return]


def reason_of(exc: BaseException) -> str:
    """Why llguidance refused, in one line. pyo3's PanicException (a panic in its Rust) is no Exception, so callers
    catch BaseException: an interrupt or an exit is raised on."""
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        raise exc
    return one_line(str(exc)) or type(exc).__name__


def one_line(message: str) -> str:
    """llguidance's message in one line: its first, and the line naming the error (regex errors draw a caret)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    why = next((line for line in lines[1:] if line.startswith("error:")), "")
    return (" ".join(filter(None, [lines[0], why])) if lines else "invalid")[:500]
