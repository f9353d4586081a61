"""The one msgpack encode/decode pair for every wire message (see `shared.messages`), done by msgspec.

Envelope: {"v": schema version, "k": message kind, "d": fields}. The message types themselves are the
schema: msgspec encodes them and, on decode, checks every field against its annotation (enums by value,
nested messages, tuples) in one pass. Decoding checks the version and the kind and wraps every failure
in `CodecError`, so a bad entry in a stream is an error to handle, never a crash.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any, TypeVar

import msgspec

from shared.errors import CodecError, SchemaVersionError

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

M = TypeVar("M")


class _Envelope(msgspec.Struct):
    v: Any
    k: Any = None
    d: msgspec.Raw = msgspec.Raw()


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


def encode(msg: Any) -> bytes:
    return _ENCODER.encode({"v": SCHEMA_VERSION, "k": msg.KIND, "d": msg})


@cache
def _decoder(cls: type[M]) -> msgspec.msgpack.Decoder[M]:
    return msgspec.msgpack.Decoder(cls)


def decode(data: bytes, cls: type[M]) -> M:
    try:
        envelope = _ENVELOPE.decode(data)
    except msgspec.ValidationError as exc:
        raise CodecError(f"not a batchgate envelope: {exc}") from exc
    except (msgspec.DecodeError, TypeError) as exc:
        raise CodecError(f"not a msgpack message: {exc}") from exc
    if isinstance(envelope.v, bool) or not isinstance(envelope.v, int) or envelope.v not in SUPPORTED_VERSIONS:
        raise SchemaVersionError(f"schema version {envelope.v!r} not supported (this build reads 1)")
    kind = getattr(cls, "KIND", None)
    if envelope.k != kind:
        raise CodecError(f"expected a {kind!r} message, got {envelope.k!r}")
    try:
        return _decoder(cls).decode(envelope.d)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise CodecError(f"malformed {kind} message: {exc}") from exc


def decode_readable(blobs: Iterable[bytes], cls: type[M]) -> list[M]:
    """The messages among `blobs` this build can read; the others (another schema version's, say) left out."""
    out: list[M] = []
    for blob in blobs:
        try:
            out.append(decode(blob, cls))
        except CodecError:
            continue
    return out
