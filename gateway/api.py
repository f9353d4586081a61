"""The small request/response types the handlers speak.

Handlers never see Starlette, Lambda events or Flask requests: each transport adapts to these.
The errors are `shared.api_errors` (the SDK's direct mode raises the same ones); they become
`{"error": {"code", "message"}}` with their status in exactly one place (`error_response`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shared.api_errors import (
    ApiError,
    BadRequest,
    Conflict,
    Gone,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
    Unauthorized,
    Unprocessable,
    UnsupportedMediaType,
)
from shared.events import ServerEvent

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


@dataclass(frozen=True, slots=True)
class ApiRequest:
    method: str
    path: str
    query: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""
    tenant: str = "default"
    # the body as it arrives, for a route with `streamed_body` (an upload): `body` is then empty, and the
    # handler reads this once; a transport that has the body whole passes it as one chunk (`one_chunk`)
    stream: AsyncIterator[bytes] | None = None
    # returns when the caller has gone (closed its connection), for a transport that can tell (HTTP); None where
    # it cannot (a Lambda invocation). Only for a route whose body was read whole.
    gone: Callable[[], Awaitable[None]] | None = None

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


EVENT_STREAM = "text/event-stream"


def negotiate(accept: str | None, offers: tuple[str, ...]) -> str:
    """The offer the `Accept` header prefers: by its q-value (the most specific range that matches it), then
    an offer named outright over one matched by a wildcard, then the order of `offers` (the server's
    preference). No header, or nothing acceptable: the first offer not refused outright (leniency over a
    406)."""
    if not accept:
        return offers[0]
    ranges: list[tuple[str, float]] = []
    for part in accept.split(","):
        kind, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = min(max(float(value), 0.0), 1.0)
                except ValueError:
                    q = 0.0
        if kind:
            ranges.append((kind.lower(), q))

    def rank(offer: str) -> tuple[float, int]:
        major = offer.split("/")[0]
        best = (-1, 0.0)  # (specificity, q)
        for kind, q in ranges:
            spec = 2 if kind == offer else 1 if kind == f"{major}/*" else 0 if kind == "*/*" else -1
            if spec > best[0]:
                best = (spec, q)
        return (best[1], best[0]) if best[0] >= 0 else (0.0, -1)

    scored = [(rank(o), -i, o) for i, o in enumerate(offers)]
    (q, _), _, chosen = max(scored)
    if q > 0:
        return chosen
    # nothing acceptable: the first offer the caller did not refuse outright (q=0), else the first
    return next((o for (oq, spec), _, o in scored if spec < 0), offers[0])


def wants_events(accept: str | None, stream: bool) -> bool:
    """Whether a submit is answered with its event stream: asked for with `stream: true` wherever the caller
    accepts events; without it only where the caller prefers events to JSON."""
    # named outright only: no header, or a wildcard (`*/*`, what most HTTP clients send), is JSON, the events
    # then read from GET /v1/requests/{id}/events
    if not accept or EVENT_STREAM not in accept.lower():
        return False
    offers = (EVENT_STREAM, "application/json") if stream else ("application/json", EVENT_STREAM)
    return negotiate(accept, (*offers, *MSGPACK_TYPES)) == EVENT_STREAM


def sse_data(event: ServerEvent) -> str:
    """An event's data line: JSON, or a string as it is (OpenAI's `[DONE]`)."""
    if isinstance(event.data, str):
        return event.data
    return json.dumps(event.data, separators=(",", ":"), allow_nan=False)


def sse_frame(event: ServerEvent) -> bytes:
    """One Server-Sent Event, as the wire carries it (no `id:`/`event:` line where they are empty)."""
    head = (f"id: {event.id}\n" if event.id else "") + (f"event: {event.event}\n" if event.event else "")
    return f"{head}data: {sse_data(event)}\n\n".encode()


@dataclass(slots=True)
class ApiResponse:
    status: int
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    # Server-Sent Events instead of a body: the app streams them; a transport that cannot stream (Lambda,
    # Cloud Functions) sends them all at once when the last one came (`collect_events`)
    events: AsyncIterator[ServerEvent] | None = None
    raw: bytes | None = None  # a body already rendered (the collected events, or the collected `stream`)
    # bytes instead of a body (a file's content): the app streams them; `collect_events` joins them
    stream: AsyncIterator[bytes] | None = None
    media_type: str | None = None  # of `stream` or `raw`; None: the events' text/event-stream
    # makes the event a transport that answers once ends `events` with when it cuts them at its longest wait (None:
    # an `error` event telling the caller to reconnect with its Last-Event-ID, as the native events can); built only
    # when a stream is cut
    cut: Callable[[], ServerEvent] | None = None

    def render(self, accept: str | None) -> tuple[bytes, str]:
        if self.raw is not None:
            return self.raw, self.media_type or EVENT_STREAM
        if self.body is None:
            return b"", "application/json"
        # most callers send `*/*` or JSON: parse the header only where it names msgpack (per response)
        if accept and "msgpack" in accept.lower() \
                and negotiate(accept, ("application/json", *MSGPACK_TYPES)) != "application/json":
            return msgpack.packb(self.body, use_bin_type=True), "application/msgpack"
        return json.dumps(self.body, separators=(",", ":"), allow_nan=False).encode(), "application/json"


async def collect_events(resp: ApiResponse, limit_s: float | None = None) -> ApiResponse:
    """A streamed response (events or bytes) rendered whole, for transports that answer once; its events those
    of the first `limit_s` seconds (`answered_once`)."""
    if resp.stream is not None:
        chunks = [chunk async for chunk in resp.stream]
        return ApiResponse(resp.status, headers=resp.headers, raw=b"".join(chunks), media_type=resp.media_type)
    if resp.events is None:
        return resp
    events = resp.events if limit_s is None else answered_once(resp.events, limit_s, resp.cut)
    frames = [sse_frame(event) async for event in events]
    return ApiResponse(resp.status, headers=resp.headers, raw=b"".join(frames))


async def answered_once(events: AsyncIterator[ServerEvent], limit_s: float,
                        cut: Callable[[], ServerEvent] | None = None) -> AsyncIterator[ServerEvent]:
    """An event stream held to `limit_s` seconds, for a transport that answers once (Lambda, Cloud Functions: the
    caller gets nothing until the answer is whole, and nothing at all past the function's own timeout): past it,
    the event `cut` makes ends it, or an `error` event telling the caller to reconnect with its Last-Event-ID for
    the rest, which loses nothing."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    try:
        while True:
            try:
                event = await asyncio.wait_for(anext(events), max(0.0, end - loop.time()))
            except StopAsyncIteration:
                return
            except TimeoutError:
                if cut is not None:
                    yield cut()
                    return
                yield ServerEvent("error", {"error": {
                    "code": "wait_exceeded", "message": f"this gateway answers once, with the events of its longest "
                                                       f"wait ({limit_s:g} s): reconnect with Last-Event-ID for the "
                                                       "rest"}}, "")
                return
            yield event
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def one_chunk(body: bytes) -> AsyncIterator[bytes]:
    """A whole body as the stream a `streamed_body` route reads."""
    if body:
        yield body


def error_response(exc: ApiError) -> ApiResponse:
    """The one place an error becomes a response: its status, its body, `Retry-After` if it has one."""
    return ApiResponse(exc.status, exc.body(), exc.headers())


__all__ = [
    "EVENT_STREAM",
    "MSGPACK_TYPES",
    "ApiError",
    "ApiRequest",
    "ApiResponse",
    "BadRequest",
    "Conflict",
    "Gone",
    "MethodNotAllowed",
    "NotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "ServiceUnavailable",
    "TooManyRequests",
    "Unauthorized",
    "Unprocessable",
    "UnsupportedMediaType",
    "answered_once",
    "collect_events",
    "error_response",
    "negotiate",
    "one_chunk",
    "sse_data",
    "sse_frame",
    "wants_events",
]
