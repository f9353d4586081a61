"""A streaming reader of `multipart/form-data` bodies (RFC 7578) over python-multipart's incremental parser.

The parts come one at a time, each part's data as the chunks the body arrives in, so a file part of any
length passes through without being held whole (Starlette's `request.form()` would spool it to a temporary
file first). Everything a caller can get wrong is a 4xx: another content type (415), no boundary, a body
that does not parse or ends before its closing boundary, too many parts or too long part headers (400).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.api import BadRequest, UnsupportedMediaType

MAX_PARTS = 16
MAX_HEADER_BYTES = 8192  # the headers of one part, together


def _invalid(message: str) -> BadRequest:
    return BadRequest(message, code="invalid_multipart")


@dataclass
class Part:
    name: str
    filename: str | None
    content_type: str
    _reader: MultipartReader = field(repr=False)
    done: bool = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The part's data as it arrives; read once (the body moves on)."""
        while not self.done:
            kind, data = await self._reader.next_event()
            if kind == "data":
                yield data
            elif kind == "part_end":
                self.done = True
            else:
                raise _invalid(f"malformed multipart body inside the part {self.name!r}")

    async def text(self, limit: int) -> str:
        """A small field's value, as UTF-8 text; a 400 when longer than `limit` bytes or not UTF-8."""
        value = bytearray()
        async for chunk in self.chunks():
            value += chunk
            if len(value) > limit:
                raise _invalid(f"the form field {self.name!r} is longer than {limit} bytes")
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise _invalid(f"the form field {self.name!r} is not UTF-8 text") from None


class MultipartReader:
    def __init__(self, content_type: str | None, body: AsyncIterator[bytes]) -> None:
        ctype, options = parse_options_header(content_type or "")
        if ctype != b"multipart/form-data":
            raise UnsupportedMediaType(f"content type {ctype.decode('latin-1')!r} not supported here; send "
                                       "multipart/form-data with the fields file and purpose")
        boundary = options.get(b"boundary")
        if not boundary:
            raise _invalid("multipart/form-data without a boundary parameter")
        self._events: deque[tuple[str, bytes]] = deque()
        self._body = body.__aiter__()
        self._exhausted = False

        def event(kind: str) -> Callable[..., None]:
            def on(data: bytes | None = None, start: int = 0, end: int = 0) -> None:
                self._events.append((kind, bytes(data[start:end]) if data is not None else b""))
            return on

        kinds = {"part_begin": "begin", "part_data": "data", "part_end": "part_end", "header_field": "header_field",
                 "header_value": "header_value", "header_end": "header_end",
                 "headers_finished": "headers_finished", "end": "eof"}
        callbacks = {f"on_{name}": event(kind) for name, kind in kinds.items()}
        try:
            self._parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        except (FormParserError, ValueError) as exc:
            raise _invalid(f"bad multipart boundary: {exc}") from None

    async def next_event(self) -> tuple[str, bytes]:
        while not self._events:
            if self._exhausted:
                raise _invalid("the multipart body ended before its closing boundary")
            try:
                chunk = await anext(self._body)
            except StopAsyncIteration:
                self._exhausted = True
                continue
            try:
                self._parser.write(chunk)
            except FormParserError as exc:
                raise _invalid(f"malformed multipart body: {str(exc)[:200]}") from None
        return self._events.popleft()

    async def parts(self) -> AsyncIterator[Part]:
        """The parts in order; a part its reader left unread is skipped before the next."""
        count = 0
        while True:
            kind, _ = await self.next_event()
            if kind == "eof":
                return
            if kind != "begin":
                continue
            count += 1
            if count > MAX_PARTS:
                raise _invalid(f"more than {MAX_PARTS} parts in the multipart body")
            part = await self._part()
            yield part
            async for _ in part.chunks():
                pass

    async def _part(self) -> Part:
        headers: dict[str, str] = {}
        name, value = bytearray(), bytearray()
        size = 0
        while True:
            kind, data = await self.next_event()
            size += len(data)
            if size > MAX_HEADER_BYTES:
                raise _invalid(f"the headers of a part are longer than {MAX_HEADER_BYTES} bytes")
            if kind == "header_field":
                name += data
            elif kind == "header_value":
                value += data
            elif kind == "header_end":
                headers[name.decode("latin-1").lower()] = value.decode("latin-1")  # as HTTP reads headers
                name, value = bytearray(), bytearray()
            elif kind == "headers_finished":
                break
            else:
                raise _invalid("malformed multipart body: a part without its headers")
        try:
            disposition, params = parse_options_header(headers.get("content-disposition", ""))
        except (ValueError, UnicodeError):
            disposition, params = b"", {}
        if disposition != b"form-data" or b"name" not in params:
            raise _invalid("every part needs Content-Disposition: form-data with a name")
        filename = params.get(b"filename")  # the bytes as sent: UTF-8 by RFC 7578 (what clients send)
        return Part(name=params[b"name"].decode("utf-8", "replace"),
                    filename=None if filename is None else filename.decode("utf-8", "replace"),
                    content_type=headers.get("content-type", ""), _reader=self)
