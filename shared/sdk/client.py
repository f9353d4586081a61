"""Sync and async clients. Both speak HTTP (httpx); `AsyncBatchgateClient.direct()` speaks straight
to Redis through the shared caller operations the gateway runs too (for callers inside the VPC: no HTTP
hop; see `shared.sdk.direct`)."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from shared.idempotency_keys import KEY_RULE, valid_idempotency_key
from shared.sdk.errors import (
    BatchgateError,
    DeadlineInfeasible,
    InvalidRequest,
    RequestFailed,
    Unavailable,
    error_for,
)
from shared.sdk.reconnect import Reconnects

TERMINAL = frozenset({"succeeded", "failed", "expired", "cancelled"})
MAX_BATCH = 100
LONG_POLL_S = 25.0
STREAM_POLL_S = 5.0  # the sync client's `stream`: how long a long-poll may run on after the caller left


@dataclass(frozen=True)
class Submission:
    id: str
    status: str
    eta_ms: int | None = None
    queue_position: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Result:
    id: str
    status: str
    output: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    finish_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def of(cls, body: dict[str, Any]) -> Result:
        return cls(id=body["id"], status=body["status"], output=body.get("output"), error=body.get("error"),
                   finish_reason=body.get("finish_reason"), timings=body.get("timings") or {}, raw=body)


@dataclass(frozen=True)
class Event:
    """One event of a request (`events()`): `status` {id, status}, `delta` {index, text, token_ids}, or the
    final `done` (the request as `get` answers it). `id`: pass it as `last_event_id` to go on after it."""

    event: str
    data: dict[str, Any]
    id: str | None = None

    @property
    def text(self) -> str:
        return str(self.data.get("text", "")) if self.event == "delta" else ""


def parse_sse(lines: Iterable[str], state: dict[str, Any]) -> Iterator[Event]:
    """Events from Server-Sent Event lines (`state` carries a half-read event between calls)."""
    for line in lines:
        if not line:
            if "data" in state:
                yield Event(state.get("event", "message"), json.loads(state["data"]), state.get("id"))
            state.clear()
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            state[name] = value[1:] if value.startswith(" ") else value


_SUBMIT_ARGS = frozenset({"input", "params", "timeout_s", "deadline", "priority", "callback", "stream"})
# reconnects of an event stream after a dropped connection, a gateway's 502/503/504 or a stream that ended before its
# `done` (with Last-Event-ID): pauses from EVENT_RETRY_S, doubling up to EVENT_RETRY_MAX_S, for EVENT_RECONNECT_S in
# all since the stream last moved on (a gateway restarting takes seconds); the client's `reconnect_s` sets the last
EVENT_RETRY_S = 0.2
EVENT_RETRY_MAX_S = 2.0
EVENT_RECONNECT_S = 30.0


def _progress(reconnects: Reconnects, event: Event) -> None:
    reconnects.progress(event.id, str(event.data.get("status")) if event.event == "status" else None)


def _pause(reconnects: Reconnects, request_id: str, why: BaseException | None) -> float:
    """The pause before resuming a lost event stream; `Unavailable` once the reconnect budget is spent."""
    if (pause := reconnects.next_pause()) is None:
        lost = repr(why) if why is not None else "it ended before its done event"
        raise Unavailable(f"event stream of {request_id} lost: {lost}", code="stream_lost") from why
    return pause


def _json_or_none(r: httpx.Response) -> Any:
    """A response's JSON body; None for none, or for what is not JSON (a load balancer's HTML error page)."""
    try:
        return r.json() if r.content else None
    except ValueError:
        return None


class _Common:
    """Request building shared by the sync and async clients (deadlines, headers, parsing)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 lambda_context: Any = None, deadline_margin_s: float = 0.5, timeout_s: float = 60.0,
                 reconnect_s: float | None = None) -> None:
        """`reconnect_s`: how long `events()` goes on resuming a lost stream since it last moved on (0: never;
        default `EVENT_RECONNECT_S`)."""
        reconnect_s = EVENT_RECONNECT_S if reconnect_s is None else reconnect_s
        if not reconnect_s >= 0:
            raise ValueError(f"reconnect_s must be 0 or more, got {reconnect_s!r}")
        self.base_url = base_url.rstrip("/")
        self.reconnect_s = float(reconnect_s)
        self.api_key = api_key
        self.lambda_context = lambda_context
        self.deadline_margin_s = deadline_margin_s
        self.timeout_s = timeout_s

    def _headers(self, idempotency_key: str | None = None) -> dict[str, str]:
        h = {"accept": "application/json"}
        if self.api_key:
            h["authorization"] = f"Bearer {self.api_key}"
        if idempotency_key is not None:
            if not valid_idempotency_key(idempotency_key):  # the gateway's rule, checked before sending
                raise InvalidRequest(KEY_RULE, status=400, code="invalid_idempotency_key")
            h["idempotency-key"] = idempotency_key
        return h

    def _remaining_s(self) -> float | None:
        getter = getattr(self.lambda_context, "get_remaining_time_in_millis", None)
        return getter() / 1000 - self.deadline_margin_s if callable(getter) else None

    def _reconnects(self, last_event_id: str | None) -> Reconnects:
        return Reconnects(EVENT_RETRY_S, EVENT_RETRY_MAX_S, self.reconnect_s).resume_from(last_event_id)

    def _events_headers(self, last_event_id: str | None) -> dict[str, str]:
        h = {**self._headers(), "accept": "text/event-stream"}
        if last_event_id is not None:
            h["last-event-id"] = last_event_id
        return h

    def _body(self, input: dict[str, Any], params: dict[str, Any] | None, timeout_s: float | None,
              deadline: float | None, priority: str | None, callback: dict[str, Any] | None,
              stream: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"input": input}
        if stream:
            body["stream"] = True
        if params:
            body["params"] = params
        if priority:
            body["priority"] = priority
        if callback:
            body["callback"] = callback
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        elif deadline is not None:
            body["deadline"] = deadline
        else:
            left = self._remaining_s()
            if left is not None:
                if left <= 0:
                    raise DeadlineInfeasible("too little time left in this Lambda invocation to wait for a result; "
                                             "nothing was submitted", code="deadline_infeasible")
                body["deadline"] = time.time() + left
        return body

    def _wait_cap(self, wait: float | None) -> float | None:
        left = self._remaining_s()
        if wait is None or left is None:
            return wait
        return max(0.0, min(wait, left))

    def _not_done(self, request_id: str, status: str, timeout: float, cap: float | None) -> TimeoutError:
        """What `result` raises when the wait ended first; one cut short by a Lambda invocation's end says so."""
        if cap is not None and cap < timeout:
            return TimeoutError(f"request {request_id} still {status} after {cap:.1f} s, the time left in this Lambda "
                                f"invocation less deadline_margin_s (not the {timeout} s asked)")
        return TimeoutError(f"request {request_id} still {status} after {timeout} s")

    @staticmethod
    def _parse(status: int, headers: Any, body: Any) -> Any:
        if status >= 400:
            ra = headers.get("retry-after") if headers else None
            raise error_for(status, body, float(ra) if ra and ra.replace(".", "", 1).isdigit() else None)
        return body

    @staticmethod
    def _submission(body: dict[str, Any]) -> Submission | Result:
        if body.get("status") in TERMINAL:
            return Result.of(body)
        return Submission(body["id"], body["status"], body.get("eta_ms"), body.get("queue_position"), body)

    def _batch_bodies(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, it in enumerate(items):
            if not isinstance(it, dict) or "input" not in it:
                raise InvalidRequest(f"items[{i}]: each item is a submit body with an 'input' ({{'input': ..., "
                                     "'params': ...}), got " + (f"keys {sorted(it)}" if isinstance(it, dict)
                                                                  else type(it).__name__), code="invalid_request")
            body = self._body(it["input"], it.get("params"), it.get("timeout_s"), it.get("deadline"),
                              it.get("priority"), it.get("callback"), bool(it.get("stream")))
            # every other field as given: the gateway takes idempotency_key and names a field it does not know
            out.append({**{k: v for k, v in it.items() if k not in _SUBMIT_ARGS}, **body})
        return out

    @staticmethod
    def _batch_outcomes(resp: dict[str, Any]) -> list[Submission | BatchgateError]:
        out: list[Submission | BatchgateError] = []
        for r in resp["results"]:
            if r["status"] in (200, 202):  # a replayed item says where its request is (200: finished)
                out.append(Submission(r["id"], r.get("request_status") or "queued", r.get("eta_ms"),
                                      r.get("queue_position"), r))
            else:
                out.append(error_for(r["status"], r, (r.get("error") or {}).get("retry_after")))
        return out

    @staticmethod
    def _checked(result: Result) -> Result:
        if result.status != "succeeded":
            err = result.error or {}
            raise RequestFailed(f"request {result.id} {result.status}: {err.get('message', '')}", result)
        return result


def _seg(value: str) -> str:
    """A model name or request id as one path segment: a caller's `?`, `/` or `..` cannot change the route."""
    return quote(str(value), safe="")


def _json_body(value: Any) -> bytes | None:
    """A request body as JSON, or `InvalidRequest` where JSON cannot carry it (NaN, bytes), before anything is
    sent (the gateway refuses the same values)."""
    if value is None:
        return None
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"the request cannot be sent as JSON: {exc}", status=400, code="invalid_request") \
            from None


def _json_type(value: Any) -> dict[str, str]:
    return {} if value is None else {"content-type": "application/json"}


class AsyncBatchgateClient(_Common):
    def __init__(self, base_url: str = "http://127.0.0.1:8000", **kw: Any) -> None:
        transport = kw.pop("transport", None)
        self._direct: Any = kw.pop("direct", None)  # a `shared.sdk.direct.DirectTransport`: no HTTP at all
        super().__init__(base_url, **kw)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s + LONG_POLL_S,
                                       transport=transport)

    async def __aenter__(self) -> AsyncBatchgateClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._direct is not None:
            await self._direct.aclose()

    async def _request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                       headers: dict[str, str] | None = None) -> Any:
        if self._direct is not None:  # the body as HTTP would send it: what JSON cannot carry is refused the same way
            return self._parse(*await self._direct.request(method, path, _json_body(json), params or {},
                                                           headers or {}))
        try:
            r = await self._http.request(method, path, content=_json_body(json), params=params,
                                         headers={**(headers or self._headers()), **_json_type(json)})
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach batchgate: {exc!r}") from exc
        return self._parse(r.status_code, r.headers, _json_or_none(r))

    async def submit(self, model: str, input: dict[str, Any], *, params: dict[str, Any] | None = None,
                     timeout_s: float | None = None, deadline: float | None = None, priority: str | None = None,
                     callback: dict[str, Any] | None = None, idempotency_key: str | None = None,
                     wait: float | None = None, stream: bool = False) -> Submission | Result:
        """`stream`: tokens are published as they are decoded; read them with `events(id)`."""
        body = self._body(input, params, timeout_s, deadline, priority, callback, stream)
        q = {"wait": self._wait_cap(wait)} if wait else None
        out = await self._request("POST", f"/v1/models/{_seg(model)}/requests", json=body, params=q,
                                  headers=self._headers(idempotency_key))
        return self._submission(out)

    async def submit_many(self, model: str, items: Iterable[dict[str, Any]]) -> list[Submission | BatchgateError]:
        """Each item: a submit body ({"input", "params"?, ...}); one Submission or error per item, in order."""
        out: list[Submission | BatchgateError] = []
        items = list(items)
        for i in range(0, len(items), MAX_BATCH):
            chunk = self._batch_bodies(items[i:i + MAX_BATCH])
            out += self._batch_outcomes(await self._request("POST", f"/v1/models/{_seg(model)}/requests:batch",
                                                            json={"requests": chunk}))
        return out

    async def get(self, request_id: str) -> Result:
        return Result.of(await self._request("GET", f"/v1/requests/{_seg(request_id)}"))

    async def wait(self, request_id: str, timeout: float = 60.0) -> Result:
        """Long-poll until the request is terminal or `timeout` passes (returns its state either way)."""
        end = time.monotonic() + (self._wait_cap(timeout) or 0.0)
        while True:
            left = max(0.0, end - time.monotonic())
            res = Result.of(await self._request("GET", f"/v1/requests/{_seg(request_id)}",
                                                params={"wait": min(left, LONG_POLL_S)}))
            if res.done or left <= 0:
                return res

    async def result(self, request_id: str, timeout: float = 60.0) -> Result:
        """The finished result; raises RequestFailed if it failed, expired or was cancelled, TimeoutError if
        it is not done within `timeout`."""
        cap = self._wait_cap(timeout)
        res = await self.wait(request_id, timeout)
        if not res.done:
            raise self._not_done(request_id, res.status, timeout, cap)
        return self._checked(res)

    async def cancel(self, request_id: str) -> Result:
        return Result.of(await self._request("DELETE", f"/v1/requests/{_seg(request_id)}"))

    async def events(self, request_id: str, last_event_id: str | None = None) -> AsyncIterator[Event]:
        """The request's events until its `done` event: status changes, token deltas (of a request submitted
        with `stream=True`; else its whole output as one), the final result. A dropped connection is resumed
        where it left off (Last-Event-ID); so is a call given the `id` of the last event a caller had."""
        reconnects = self._reconnects(last_event_id)
        if self._direct is not None:
            async for ev in self._direct.events(request_id, last_event_id, reconnects):
                yield Event(ev.event, ev.data, ev.id)
            return
        while True:
            why: BaseException | None = None
            try:
                async with self._http.stream("GET", f"/v1/requests/{_seg(request_id)}/events",
                                             headers=self._events_headers(last_event_id)) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        self._parse(r.status_code, r.headers, _json_or_none(r))
                    state: dict[str, Any] = {}
                    async for line in r.aiter_lines():
                        for event in parse_sse([line], state):
                            last_event_id = event.id or last_event_id
                            _progress(reconnects, event)
                            yield event
                            if event.event == "done":
                                return
            except (httpx.TransportError, Unavailable) as exc:  # dropped, or a gateway's 502/503/504
                why = exc
            await asyncio.sleep(_pause(reconnects, request_id, why))

    async def stream(self, request_ids: Iterable[str], timeout: float = 300.0) -> AsyncIterator[Result]:
        """Results of many requests, in the order they finish."""
        tasks = [asyncio.ensure_future(self.wait(rid, timeout)) for rid in request_ids]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:
            for t in tasks:
                t.cancel()

    @classmethod
    def direct(cls, redis_url: str, *, tenant: str = "default", key_prefix: str | None = None,
               env: dict[str, str] | None = None, **kw: Any) -> AsyncBatchgateClient:
        """A client that goes straight into Redis (inside the VPC), through the same caller operations as the
        gateway (`shared.sdk.direct`), with the deployment's settings: `env`, else the process environment (its
        models file, callback allow-list, limits), as the gateway reads them; `key_prefix` over its
        BATCHGATE_KEY_PREFIX (default `bg`)."""
        from shared.sdk.direct import DirectTransport  # only direct mode needs redis

        return cls("http://direct", direct=DirectTransport(redis_url, tenant=tenant, key_prefix=key_prefix, env=env),
                   **kw)


class BatchgateClient(_Common):
    """The synchronous client (Lambda handlers, scripts). Same methods as the async one."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", **kw: Any) -> None:
        transport = kw.pop("transport", None)
        super().__init__(base_url, **kw)
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout_s + LONG_POLL_S, transport=transport)

    def __enter__(self) -> BatchgateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> Any:
        try:
            r = self._http.request(method, path, content=_json_body(json), params=params,
                                   headers={**(headers or self._headers()), **_json_type(json)})
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach batchgate: {exc!r}") from exc
        return self._parse(r.status_code, r.headers, _json_or_none(r))

    def submit(self, model: str, input: dict[str, Any], *, params: dict[str, Any] | None = None,
               timeout_s: float | None = None, deadline: float | None = None, priority: str | None = None,
               callback: dict[str, Any] | None = None, idempotency_key: str | None = None,
               wait: float | None = None, stream: bool = False) -> Submission | Result:
        body = self._body(input, params, timeout_s, deadline, priority, callback, stream)
        q = {"wait": self._wait_cap(wait)} if wait else None
        return self._submission(self._request("POST", f"/v1/models/{_seg(model)}/requests", json=body, params=q,
                                              headers=self._headers(idempotency_key)))

    def submit_many(self, model: str, items: Iterable[dict[str, Any]]) -> list[Submission | BatchgateError]:
        out: list[Submission | BatchgateError] = []
        items = list(items)
        for i in range(0, len(items), MAX_BATCH):
            chunk = self._batch_bodies(items[i:i + MAX_BATCH])
            out += self._batch_outcomes(self._request("POST", f"/v1/models/{_seg(model)}/requests:batch",
                                                      json={"requests": chunk}))
        return out

    def get(self, request_id: str) -> Result:
        return Result.of(self._request("GET", f"/v1/requests/{_seg(request_id)}"))

    def wait(self, request_id: str, timeout: float = 60.0) -> Result:
        res = self._wait_unless(request_id, timeout, None)
        assert res is not None
        return res

    def _wait_unless(self, request_id: str, timeout: float, stop: threading.Event | None,
                     poll_s: float = LONG_POLL_S) -> Result | None:
        """As `wait`, in long-polls of at most `poll_s`; None once `stop` is set between two of them."""
        end = time.monotonic() + (self._wait_cap(timeout) or 0.0)
        while stop is None or not stop.is_set():
            left = max(0.0, end - time.monotonic())
            res = Result.of(self._request("GET", f"/v1/requests/{_seg(request_id)}",
                                          params={"wait": min(left, poll_s)}))
            if res.done or left <= 0:
                return res
        return None

    def result(self, request_id: str, timeout: float = 60.0) -> Result:
        cap = self._wait_cap(timeout)
        res = self.wait(request_id, timeout)
        if not res.done:
            raise self._not_done(request_id, res.status, timeout, cap)
        return self._checked(res)

    def cancel(self, request_id: str) -> Result:
        return Result.of(self._request("DELETE", f"/v1/requests/{_seg(request_id)}"))

    def events(self, request_id: str, last_event_id: str | None = None) -> Iterator[Event]:
        """As `AsyncBatchgateClient.events`."""
        reconnects = self._reconnects(last_event_id)
        while True:
            why: BaseException | None = None
            try:
                with self._http.stream("GET", f"/v1/requests/{_seg(request_id)}/events",
                                       headers=self._events_headers(last_event_id)) as r:
                    if r.status_code >= 400:
                        r.read()
                        self._parse(r.status_code, r.headers, _json_or_none(r))
                    state: dict[str, Any] = {}
                    for line in r.iter_lines():
                        for event in parse_sse([line], state):
                            last_event_id = event.id or last_event_id
                            _progress(reconnects, event)
                            yield event
                            if event.event == "done":
                                return
            except (httpx.TransportError, Unavailable) as exc:  # dropped, or a gateway's 502/503/504
                why = exc
            time.sleep(_pause(reconnects, request_id, why))

    def stream(self, request_ids: Iterable[str], timeout: float = 300.0, concurrency: int = 16) -> Iterator[Result]:
        """Results of many requests, in the order they finish (long-polls on `concurrency` threads). Leaving the loop
        early returns at once, as the async client's does: the long-polls still out end within STREAM_POLL_S on
        daemon threads (nothing waits for them, not even the interpreter's exit), and no new one starts."""
        ids = list(request_ids)
        todo: queue.SimpleQueue[str] = queue.SimpleQueue()
        for rid in ids:
            todo.put(rid)
        done: queue.SimpleQueue[tuple[Result | None, BaseException | None]] = queue.SimpleQueue()
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    rid = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    done.put((self._wait_unless(rid, timeout, stop, STREAM_POLL_S), None))
                except BaseException as exc:  # handed to the caller's loop, which raises it
                    done.put((None, exc))

        for _ in range(max(1, min(concurrency, len(ids)))):
            threading.Thread(target=poll, name="batchgate-stream", daemon=True).start()
        try:
            for _ in ids:
                res, exc = done.get()
                if exc is not None:
                    raise exc
                assert res is not None
                yield res
        finally:
            stop.set()


__all__ = ["AsyncBatchgateClient", "BatchgateClient", "BatchgateError", "Event", "Result", "Submission"]
