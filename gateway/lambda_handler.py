"""AWS Lambda entry points (no torch, no transformers; Redis client created once per container).

- `http_handler`: API Gateway REST (v1) and HTTP (v2) APIs, Function URLs, ALB target groups: the same
  Starlette app, wrapped with Mangum (no hand-written event parsing).
- `direct_handler`: `aws lambda invoke` with `{"model", "input", "params", "timeout_s" | "deadline",
  "priority", "callback", "wait", "api_key"?}`: the submit handler's answer, with its HTTP status as
  `statusCode`.
  Without a timeout or deadline, the deadline is this invocation's remaining time minus a margin, so
  work the invoker cannot wait for is never computed.
- `sqs_handler`: one batch submit per model for the records of an SQS event; records that were not
  accepted are reported in `batchItemFailures` (enable ReportBatchItemFailures on the event source
  mapping), so SQS retries exactly those. The message id is each item's idempotency key: a redelivered
  message does not create a second request.

Direct and SQS invocations are authenticated by IAM; they act for `BATCHGATE_LAMBDA_TENANT` (default
`default`) unless the event (an SQS message, each its own) carries an `api_key`: then for that key's tenant,
and a key that is not one is refused.
"""

from __future__ import annotations

import asyncio
import binascii
import json
import math
import time
from collections import defaultdict
from typing import Any

import structlog
from mangum import Mangum

from gateway import routes
from gateway.api import ApiRequest, ApiResponse, BadRequest
from gateway.app import create_app
from gateway.service import GatewayService
from shared.config import Settings
from shared.logs import configure_logging
from shared.operations import wait_seconds

log = structlog.get_logger(__name__)
SETTINGS = Settings.from_environ()
configure_logging(SETTINGS.log_level, "json")
SERVICE = GatewayService(SETTINGS)  # module scope: one Redis pool per warm container, reused
APP = create_app(SETTINGS, service=SERVICE, answers_once=True)
_MANGUM = Mangum(APP, lifespan="off")


def http_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    try:
        return _MANGUM(_without_stage(event), context)
    except binascii.Error:  # a body flagged isBase64Encoded that is not base64: the caller's to fix, not a crash
        body = {"error": {"code": "bad_request", "message": "the body is flagged isBase64Encoded but is not base64"}}
        return {"statusCode": 400, "headers": {"content-type": "application/json"}, "body": json.dumps(body),
                "isBase64Encoded": False}


def _without_stage(event: dict[str, Any]) -> dict[str, Any]:
    """An HTTP API (v2) event of a named stage on its execute-api URL: its path begins with the stage
    (`/prod/v1/models`), which the app's routes do not, and Mangum strips only a base path fixed at start-up. The
    `$default` stage (and a Function URL) has none; a REST API (v1) event's path never holds it; nor does a custom
    domain's (its API mapping takes the place of the stage): there a stage named `v1` left `/v1/models` as
    `/models`, and every route answered 404."""
    ctx = event.get("requestContext") or {}
    http, prefix = ctx.get("http") or {}, f"/{ctx.get('stage') or '$default'}"
    path = str(http.get("path") or "")
    domain = str(ctx.get("domainName") or "")
    custom_domain = bool(domain) and ".execute-api." not in domain
    if (event.get("version") != "2.0" or prefix == "/$default" or custom_domain
            or not (path + "/").startswith(prefix + "/")):
        return event
    rest = path[len(prefix):] or "/"
    return {**event, "rawPath": rest, "requestContext": {**ctx, "http": {**http, "path": rest}}}


TENANT = SETTINGS.lambda_tenant
MARGIN_S = SETTINGS.lambda_margin_s
SUBMIT_KEYS = ("input", "params", "timeout_s", "deadline", "priority", "callback")


def _run(coro: Any) -> Any:
    # Mangum keeps one event loop per container; the direct and SQS handlers use the same one, so the
    # Redis connections (bound to their loop) survive between invocations.
    return asyncio.get_event_loop().run_until_complete(coro)


def _remaining_s(context: Any) -> float | None:
    getter = getattr(context, "get_remaining_time_in_millis", None)
    return getter() / 1000 if callable(getter) else None


def direct_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """The submit handler's answer as a dict with `statusCode`; never raises (an invoker would only see
    an unhandled-error payload, and its retry would submit again)."""
    try:
        return _direct(event, context)
    except Exception:
        log.exception("direct invocation failed")
        return {"statusCode": 500, "error": {"code": "internal", "message": "internal error"}}


def _wait_of(raw: Any) -> float:
    """The event's `wait` (a number, or a string of one) in seconds; checked as `?wait=` is."""
    try:
        value = float(raw)
    except OverflowError:  # an integer too large for a float
        value = math.inf
    except (TypeError, ValueError):
        raise BadRequest(f"wait must be a number of seconds, got {raw!r:.40}", code="invalid_wait") from None
    return wait_seconds(value, math.inf)


def _direct(event: dict[str, Any], context: Any) -> dict[str, Any]:
    if not isinstance(event, dict) or not isinstance(event.get("model"), str):
        return {"statusCode": 400,
                "error": {"code": "bad_request", "message": "event needs a `model` and an `input`"}}
    body = {k: event[k] for k in SUBMIT_KEYS if k in event}
    try:
        wanted_wait = _wait_of(event["wait"]) if "wait" in event else None
    except BadRequest as exc:
        return {"statusCode": 400, "error": {"code": exc.code, "message": exc.message}}
    remaining = _remaining_s(context)
    query: dict[str, str] = {}
    if remaining is not None:
        budget = remaining - MARGIN_S
        if "timeout_s" not in body and "deadline" not in body:
            spec = SETTINGS.model(event["model"])
            if budget <= (spec.min_timeout_s if spec else 0.0) + 0.05:  # none could finish: nothing is submitted
                return {"statusCode": 429, "error": {"code": "deadline_infeasible", "message":
                        f"this invocation has {remaining * 1000:.0f} ms left; nothing was submitted"}}
            body["deadline"] = time.time() + budget
        if wanted_wait is not None:
            query["wait"] = str(max(0.0, min(wanted_wait, budget)))
    elif wanted_wait is not None:
        query["wait"] = str(wanted_wait)
    resp = _dispatch("POST", f"/v1/models/{event['model']}/requests", body, event, query)
    return {"statusCode": resp.status, **(resp.body or {})}


def sqs_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    if not isinstance(event, dict):  # not an SQS event: no message to report, nothing to retry
        log.warning("sqs handler called without an SQS event", got=type(event).__name__)
        return {"batchItemFailures": []}
    records = event.get("Records") or []
    failures: list[dict[str, str]] = []
    # one batch submit per model and key (a message's `api_key` acts for its tenant, as a direct invocation's)
    by_model: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for rec in records:
        mid = rec.get("messageId", "") if isinstance(rec, dict) else ""
        try:
            msg = json.loads(rec.get("body") or "")
            model, key = msg["model"], msg.get("api_key") or ""
            if not isinstance(model, str) or not isinstance(key, str):
                raise TypeError("model")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            failures.append({"itemIdentifier": mid})
            continue
        item = {k: msg[k] for k in SUBMIT_KEYS if k in msg}
        item["idempotency_key"] = f"sqs:{mid}"
        by_model[(model, key)].append((mid, item))
    for (model, key), all_items in by_model.items():
        step = SETTINGS.max_batch_items
        for start in range(0, len(all_items), step):  # a batching window can deliver more than one call takes
            items = all_items[start:start + step]
            try:
                resp = _dispatch("POST", f"/v1/models/{model}/requests:batch",
                                 {"requests": [i for _, i in items]}, {"api_key": key})
                results = (resp.body or {}).get("results") if resp.status == 200 else None
            except Exception:  # these messages only: SQS retries them, the others of the batch stay done
                log.exception("sqs batch submit failed", model=model, messages=len(items))
                results = None
            if not isinstance(results, list) or len(results) != len(items):
                results = None
            for n, (mid, _) in enumerate(items):
                if results is None or results[n].get("status") not in (200, 202):
                    failures.append({"itemIdentifier": mid})
    return {"batchItemFailures": failures}


def _dispatch(method: str, path: str, body: Any, event: dict[str, Any],
              query: dict[str, str] | None = None) -> ApiResponse:
    headers = {"content-type": "application/json"}
    trusted = not event.get("api_key")
    if not trusted:
        headers["x-api-key"] = str(event["api_key"])
    req = ApiRequest(method, path, query=query or {}, headers=headers, body=json.dumps(body).encode(), tenant=TENANT)
    return _run(routes.handle(SERVICE, req, trusted_tenant=TENANT if trusted else None))
