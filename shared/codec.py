"""The one msgpack encode/decode pair for every wire message (see `shared.messages`).

Envelope: {"v": schema version, "k": message kind, "d": fields}. Decoding checks both and wraps every
failure in `CodecError`, so a bad entry in a stream is an error to handle, never a crash.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from functools import cache
from typing import Any, TypeVar

import msgpack

from shared.errors import CodecError, SchemaVersionError

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

M = TypeVar("M")


def encode(msg: Any) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, "k": msg.KIND, "d": _to_wire(msg)}, use_bin_type=True)


def decode(data: bytes, cls: type[M]) -> M:
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CodecError(f"not a msgpack message: {exc}") from exc
    if not isinstance(envelope, dict) or "v" not in envelope:
        raise CodecError("not a batchgate envelope")
    if envelope["v"] not in SUPPORTED_VERSIONS:
        raise SchemaVersionError(f"schema version {envelope['v']!r} not supported (this build reads 1)")
    kind = getattr(cls, "KIND", None)
    if envelope.get("k") != kind:
        raise CodecError(f"expected a {kind!r} message, got {envelope.get('k')!r}")
    try:
        return _from_wire(cls, envelope.get("d"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CodecError(f"malformed {kind} message: {exc}") from exc


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_wire(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_wire(inner[0], value) if len(inner) == 1 else value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{tp.__name__} must be a map")
        hints = _hints(tp)
        kwargs = {
            f.name: _from_wire(hints[f.name], value[f.name])
            for f in dataclasses.fields(tp)
            if f.name in value
        }
        return tp(**kwargs)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(value)
    if origin is tuple:
        args = typing.get_args(tp)
        return tuple(_from_wire(args[0], v) for v in value) if args else tuple(value)
    if origin is list:
        (arg,) = typing.get_args(tp)
        return [_from_wire(arg, v) for v in value]
    return value
