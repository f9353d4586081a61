"""The rules of an uploaded batch file (JSON Lines), checked while it streams, one line held at a time.

A file is accepted when:
- it is at most `max_bytes` long (else 413) and has at most `max_lines` lines (else 400);
- every line is one JSON object in UTF-8 (msgspec's decoder: invalid UTF-8 and lone surrogate escapes are
  refused), at most `max_line_bytes` long: a line becomes one request, whose body has the same limit;
- no line is empty or blank; the last line may end with a newline or not; a line may end with `\\r\\n`;
- it is not empty; a UTF-8 byte order mark before its first line (Windows editors write one) is not part of it.
What each object must hold (`custom_id`, `method`, `url`, `body`) is the Batch API's to check.

The errors name the line (1-based) and say what is wrong with it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator

import msgspec

from shared.api_errors import BadRequest, PayloadTooLarge

_SNIPPET = 120  # the characters of a decoder's message kept in an error
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark
_JSON_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


class LineCheck:
    """Counts the bytes and lines of a file as its chunks pass through `check` and refuses it (raising from
    the iteration, so a store writing from it keeps nothing) as soon as it breaks a rule."""

    def __init__(self, *, max_bytes: int, max_lines: int, max_line_bytes: int) -> None:
        self.max_bytes, self.max_lines, self.max_line_bytes = max_bytes, max_lines, max_line_bytes
        self.size = 0
        self.lines = 0  # complete lines checked so far (all of them once `check` has finished)
        self._pending = bytearray()  # the line being received (never longer than max_line_bytes)

    async def check(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            self.size += len(chunk)
            if self.size > self.max_bytes:
                raise PayloadTooLarge(f"the file is larger than the limit of {self.max_bytes} bytes",
                                      code="file_too_large")
            self._feed(chunk)
            yield chunk
        if self._pending:
            self._line(bytes(self._pending))
            self._pending.clear()
        if self.size == 0:
            raise BadRequest("the file is empty: send one JSON object per line", code="invalid_file")

    def _feed(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if self._pending:
                self._grow(chunk[start:end])
                line = bytes(self._pending)
                self._pending.clear()
            else:
                line = chunk[start:end]
                self._check_length(len(line))
            self._line(line)
            start = end + 1
        if start < len(chunk):
            self._grow(chunk[start:])

    def _grow(self, piece: bytes) -> None:
        self._check_length(len(self._pending) + len(piece))
        self._pending += piece

    def _check_length(self, n: int) -> None:
        if n > self.max_line_bytes:
            raise BadRequest(f"line {self.lines + 1} is longer than {self.max_line_bytes} bytes "
                             "(a line is one request, whose body has that limit)", code="invalid_file")

    def _line(self, line: bytes) -> None:
        number = self.lines + 1
        if number == 1:
            line = line.removeprefix(BOM)
        if number > self.max_lines:
            raise BadRequest(f"the file has more than {self.max_lines} lines", code="too_many_lines")
        if not line.strip():
            raise BadRequest(f"line {number} is empty: every line must be one JSON object", code="invalid_file")
        try:
            value = msgspec.json.decode(line)
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # UnicodeDecodeError: a ValueError
            raise BadRequest(f"line {number} is not valid JSON in UTF-8: {_why(line, exc)}",
                             code="invalid_file") from None
        if not isinstance(value, dict):
            raise BadRequest(f"line {number} is {_JSON_NAMES.get(type(value), 'not an object')}: every line must be "
                             "one JSON object", code="invalid_file")
        self.lines = number


_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _why(line: bytes, exc: Exception) -> str:
    """The decoder's message, except where it misleads: msgspec answers a lone UTF-16 surrogate escape ("\\ud800",
    which is no character) "Input data was truncated"."""
    if isinstance(exc, msgspec.DecodeError) and _LONE_SURROGATE.search(line):
        with contextlib.suppress(ValueError, RecursionError):
            json.loads(line)  # Python's decoder takes lone surrogates: if it reads the line, they are its fault
            return "it holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which is no character"
    return str(exc)[:_SNIPPET]
