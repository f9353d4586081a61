"""Checking what a caller sent against a schema type (msgspec), in one function.

`convert(raw, Type, path)` returns the typed value or raises `ValidationError` with the dotted field
path into the request body (`params.max_new_tokens`, `input.texts[0]`) and a message in plain words.
The type is the whole rule: its annotations and `msgspec.Meta` constraints are what is checked here
and what the OpenAPI document says. msgspec runs strict: a bool is not an integer, "8" is not a number,
8.5 is not an integer; NaN and infinities fail every bound, so each float carries one.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from shared.errors import ValidationError

T = TypeVar("T")

_AT = re.compile(r"^(?P<text>.*?)(?: - at `\$(?P<at>[^`]*)`)?$", re.S)
_KEY = re.compile(r"(?P<text>.*) - at `key` in `\$(?P<at>[^`]*)`", re.S)
_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "object": "an object", "array": "a list", "null": "null"}
_WORDS = {">=": "at least", "<=": "at most", ">": "greater than", "<": "less than"}


WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1  # msgpack's integers
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value: Any, path: str = "", *, item_lists: tuple[str, ...] = ()) -> None:
    """Every string in a caller's value (keys included) is valid Unicode: no lone UTF-16 surrogate, which
    JSON can spell (`"\\ud800"`) but UTF-8, msgpack and the tokenizers cannot carry; and every integer fits the
    64 bits msgpack carries (free-form JSON, a schema or a tool call's arguments, can hold any). Raises
    `ValidationError` naming the first such field (an item of one of `item_lists` is named at its list, as
    `convert` does)."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            field, message = path, "is not valid Unicode text (it holds a lone UTF-16 surrogate)"
            for name in item_lists:
                if field.startswith(name + "["):
                    field, message = name, f"item {field[len(name) + 1:].split(']')[0]}: {message}"
            raise ValidationError(field, message)
    elif type(value) is int and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        raise ValidationError(path, "out of range: an integer beyond 64 bits, which the wire cannot carry")
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _SURROGATE.search(k):
                raise ValidationError(path, "a field name is not valid Unicode text (it holds a lone UTF-16 "
                                            "surrogate)")
            check_text(v, join(path, str(k)), item_lists=item_lists)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            if isinstance(v, str | dict | list | tuple) or (type(v) is int and not WIRE_INT_MIN <= v <= WIRE_INT_MAX):
                check_text(v, f"{path}[{i}]", item_lists=item_lists)


def join(path: str, field: str) -> str:
    if not path:
        return field
    if not field or field.startswith("["):
        return path + field
    return f"{path}.{field}"


def convert(raw: Any, typ: type[T], path: str = "", *, item_lists: tuple[str, ...] = ()) -> T:
    """`raw` as a `typ`. An error on an item of one of `item_lists` (lists of short values, such as
    "params.stop") is reported at the list itself, naming the item."""
    try:
        return msgspec.convert(raw, typ, strict=True, str_keys=True)  # JSON's keys are strings: {"42": ...}
    except msgspec.ValidationError as exc:
        field, message = explain(str(exc), typ)
        field = join(path, field)
        for name in item_lists:
            if field.startswith(name + "["):
                field, message = name, f"item {field[len(name) + 1:].split(']')[0]}: {message}"
        raise ValidationError(field, message) from None


def explain(error: str, typ: Any) -> tuple[str, str]:
    """(field path, message) from a msgspec validation error raised while converting to `typ`; an object's key
    or value (msgspec names neither) is reported at the object: "every key must be ..."."""
    if key := _KEY.fullmatch(error):
        message = _explain(key.group("text"), typ)[1]
        if message.startswith("must be an integer, got"):  # a JSON object's keys are strings: "42" is read as 42
            message = "must be an integer (written as a string of digits)"
        return key.group("at").lstrip("."), "every key " + message
    at, message = _explain(error, typ)
    if at.endswith("[...]"):
        return at.removesuffix("[...]"), "every value " + message
    return at, message


def _explain(error: str, typ: Any) -> tuple[str, str]:
    m = _AT.match(error)
    text, at = (m.group("text"), (m.group("at") or "").lstrip(".")) if m else (error, "")
    if found := re.fullmatch(r"Object contains unknown field `(.+)`", text):
        names = sorted(f.name for f in _struct_fields(_type_at(typ, at)))
        return join(at, found.group(1)), f"unknown field (allowed: {', '.join(names)})"
    if found := re.fullmatch(r"Object missing required field `(.+)`", text):
        return join(at, found.group(1)), "required"
    if found := re.fullmatch(r"Expected `(.+?)`, got `(\w+)`", text):
        wanted = " or ".join(_NAMES.get(n, n) for n in found.group(1).split(" | "))
        return at, f"must be {wanted}, got {found.group(2)}"
    if found := re.fullmatch(r"Expected `(\w+)` of length (>=|<=) (\d+)", text):
        kind, op, n = found.groups()
        if kind == "str":
            return at, ("must be a non-empty string" if (op, n) == (">=", "1")
                        else f"must be {_WORDS[op]} {n} characters long")
        return at, ("must not be empty" if (op, n) == (">=", "1") else f"must hold {_WORDS[op]} {n} items")
    if found := re.fullmatch(r"Expected `\w+` (>=|<=|>|<) (\S+)", text):
        return at, f"must be {_WORDS[found.group(1)]} {found.group(2)}"
    if text.startswith("Invalid enum value"):
        values = _values(_type_at(typ, at))
        return at, f"must be one of: {', '.join(values)}" if values else "is not an allowed value"
    if text == "Number out of range":
        return at, "is out of range"
    return at, text[:1].lower() + text[1:]


def _members(t: mi.Type) -> list[mi.Type]:
    while isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        return [m for u in t.types for m in _members(u)]
    return [t]


def _type_at(typ: Any, at: str) -> list[mi.Type]:
    """The types a value at path `at` (e.g. "params.stop[0]") may have."""
    nodes = _members(mi.type_info(typ))
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", at):
        nxt: list[mi.Type] = []
        for node in nodes:
            if name and isinstance(node, mi.StructType | mi.DataclassType):
                nxt += [m for f in node.fields if f.name == name for m in _members(f.type)]
            elif index and isinstance(node, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
                nxt += _members(node.item_type)
        nodes = nxt
    return nodes


def _struct_fields(nodes: list[mi.Type]) -> list[mi.Field]:
    return [f for n in nodes if isinstance(n, mi.StructType | mi.DataclassType) for f in n.fields]


def _values(nodes: list[mi.Type]) -> list[str]:
    out: list[str] = []
    for n in nodes:
        if isinstance(n, mi.EnumType):
            out += [str(v.value) for v in n.cls]
        elif isinstance(n, mi.LiteralType):
            out += [str(v) for v in n.values]
    return out
