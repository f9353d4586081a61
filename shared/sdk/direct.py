"""The SDK's direct mode: straight into Redis, for callers inside the VPC (no HTTP hop).

It runs the same caller operations as the gateway (`shared.operations` over a `shared.queue_client`),
so a submit, get, wait or cancel answers with the same statuses, bodies and errors as over HTTP; only the
API key check is skipped (the caller names its tenant: it already holds the Redis credentials). Imports
no gateway, Starlette or uvicorn module.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import unquote

from shared import operations as ops
from shared.api_errors import ApiError, BadRequest, MethodNotAllowed, NotFound, PayloadTooLarge, unavailable
from shared.config import Settings
from shared.events import follow, parse_last_event_id
from shared.queue_client import QueueClient
from shared.redis_io import UNAVAILABLE
from shared.sdk.errors import Unavailable, error_for
from shared.sdk.reconnect import Reconnects
from shared.tenants import tenant_name_problem

_ROUTES = (
    ("POST", re.compile(r"^/v1/models/([^/]+)/requests$"), "submit"),
    ("POST", re.compile(r"^/v1/models/([^/]+)/requests:batch$"), "submit_batch"),
    ("GET", re.compile(r"^/v1/requests/([^/]+)$"), "get"),
    ("DELETE", re.compile(r"^/v1/requests/([^/]+)$"), "cancel"),
)


class DirectTransport:
    """What `AsyncBatchgateClient.direct()` sends its calls through instead of HTTP: (status, headers, body)."""

    def __init__(self, redis_url: str, *, tenant: str, key_prefix: str | None,
                 env: Mapping[str, str] | None) -> None:
        """`env`: the settings (the models file among them), else the process environment's, as every part of the
        deployment reads them; `key_prefix` over its BATCHGATE_KEY_PREFIX."""
        if problem := tenant_name_problem(tenant):  # as the CLI refuses it: the tenant names keys in Redis
            raise ValueError(problem)
        given = dict(os.environ if env is None else env)
        given["BATCHGATE_REDIS_URL"] = redis_url
        if key_prefix is not None:
            given["BATCHGATE_KEY_PREFIX"] = key_prefix
        settings = Settings.from_environ(given)
        self._queue = QueueClient(settings)
        self._tenant = tenant

    async def aclose(self) -> None:
        await self._queue.close()

    async def events(self, request_id: str, last_event_id: str | None, reconnects: Reconnects) -> AsyncIterator[Any]:
        """A request's events (`shared.events.ServerEvent`), read from Redis as the gateway's event stream
        reads them; resumed after a lost connection as `reconnects` says."""
        try:
            after = parse_last_event_id(last_event_id)
        except ValueError as exc:
            raise error_for(400, BadRequest(str(exc), code="invalid_last_event_id").body(), None) from exc
        sent = None
        while True:
            try:
                rec = await ops.visible(self._queue, self._tenant, request_id)
                async for ev in follow(self._queue, rec, after, sent):
                    after = parse_last_event_id(ev.id) if ev.id else after
                    if ev.event == "status" and isinstance(ev.data, dict):
                        sent = ev.data.get("status", sent)
                    reconnects.progress(ev.id or None, str(sent) if ev.event == "status" else None)
                    yield ev
                return
            except ApiError as exc:
                raise error_for(exc.status, exc.body(), None) from exc
            except UNAVAILABLE as exc:  # resumed where it left off, as the HTTP client resumes a dropped stream
                if (pause := reconnects.next_pause()) is None:
                    raise Unavailable(f"event stream of {request_id} lost: {exc!r}") from exc
                await asyncio.sleep(pause)

    async def request(self, method: str, path: str, body: bytes | None, params: dict[str, Any],
                      headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
        try:
            answer = await self._call(method, path, body, params, headers)
        except ApiError as exc:
            return exc.status, _lower(exc.headers()), exc.body()
        except UNAVAILABLE as exc:
            down = unavailable(exc)
            return down.status, _lower(down.headers()), down.body()
        return answer.status, _lower(answer.headers), answer.body

    async def _call(self, method: str, path: str, body: bytes | None, params: dict[str, Any],
                    headers: dict[str, str]) -> ops.Answer:
        q, tenant = self._queue, self._tenant
        name, arg = _route(method, path)
        wait = ops.wait_seconds(float(params.get("wait", 0.0)), q.settings.max_wait_s)
        if name == "get":
            return await ops.get(q, tenant, arg, wait=wait)
        if name == "cancel":
            return await ops.cancel(q, tenant, arg)
        spec = ops.model_spec(q, arg)
        sent = _as_sent(body, q.settings.max_body_bytes)
        if name == "submit_batch":
            return await ops.submit_batch(q, sent, spec, tenant)
        key = headers.get("idempotency-key")
        return await ops.submit(q, sent, spec, tenant, wait=wait,
                                idempotency_key=ops.check_idempotency_key(key) if key is not None else None)


def _route(method: str, path: str) -> tuple[str, str]:
    for verb, pattern, name in _ROUTES:
        if verb == method and (m := pattern.match(path)):
            return name, unquote(m.group(1))  # the segment as the client quoted it (`_seg`), as a server reads it
    if any(p.match(path) for _, p, _ in _ROUTES):
        raise MethodNotAllowed(f"{method} is not allowed on {path}")
    raise NotFound(f"no route {method} {path}")


def _as_sent(raw: bytes | None, max_bytes: int) -> Any:
    """The body as the gateway would receive it, from the JSON the client made of it (tuples lists, keys strings),
    size-limited."""
    if raw is not None and len(raw) > max_bytes:
        raise PayloadTooLarge(f"body exceeds the limit of {max_bytes} bytes")
    return None if raw is None else json.loads(raw)


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}
