"""A deadline for a request's headers, on uvicorn's HTTP protocols.

uvicorn closes a keep-alive connection that sits idle between requests, but not one that opened and never
finished its headers: a client sending them a byte at a time (or nothing at all) holds a connection, a file
descriptor and a slot of the accept backlog for as long as it likes, and a few hundred of them deny the
gateway to everyone (slowloris). Here a connection gets `timeout_s` from the moment it opens, and from the
first byte of each later request on it, to finish that request's headers (trickling bytes does not extend
it); else it is answered 408 and closed, as nginx's `client_header_timeout` does. The body has its own
deadline, `BATCHGATE_BODY_TIMEOUT_S`, kept by the app.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
             b"content-length: 44\r\n\r\nthe request's headers did not arrive in time")


class _HeaderDeadline:
    """The timer; the protocol subclasses below arm it where a request's headers begin and disarm it where
    they end."""

    headers_timeout_s = 10.0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    _headers_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._headers_timer is None:  # once per request: more bytes do not push the deadline back
            self._headers_timer = self.loop.call_later(self.headers_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_late(self) -> None:
        self._headers_timer = None
        if not self.transport.is_closing():
            self.transport.write(TIMED_OUT)
            self.transport.close()


class H11HeaderDeadline(_HeaderDeadline, H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11_impl.h11.IDLE:  # a request begun, its headers not all here yet
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def _httptools_class() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is optional (uvicorn's "standard" extra): h11 then
        return None

    class HttpToolsHeaderDeadline(_HeaderDeadline, HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HttpToolsHeaderDeadline


def protocol_class(timeout_s: float, impl: str = "auto") -> type[Any]:
    """uvicorn's HTTP protocol (`impl`: "auto" is httptools where installed, as uvicorn's own choice, else
    h11) with the headers' deadline of `timeout_s`."""
    base = _httptools_class() if impl in ("auto", "httptools") else None
    if base is None and impl == "httptools":
        raise RuntimeError("httptools is not installed")
    cls = base or H11HeaderDeadline
    return type(cls.__name__, (cls,), {"headers_timeout_s": timeout_s})
