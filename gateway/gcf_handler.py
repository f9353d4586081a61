"""Google Cloud Functions (functions-framework, a Flask request) onto the same routes and handlers.

Deploy the directory `scripts/build_gcf_source.sh` builds (its `main.py` names this entry point) with
`gcloud functions deploy ... --trigger-http --entry-point batchgate --source DIR`. The async handlers
run on one event loop in a background thread owned by this module, because the Flask server calling us may be
multi-threaded. The thread starts with the first request in each process: functions-framework's server (gunicorn)
imports this module and then forks its workers, and a thread started at import would not be in them (every request
waited forever on a loop no thread ran).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

from gateway import openapi, routes
from gateway.api import ApiRequest
from gateway.service import GatewayService
from shared.config import Settings
from shared.logs import configure_logging

SETTINGS = Settings.from_environ()
configure_logging(SETTINGS.log_level, "json")
SERVICE = GatewayService(SETTINGS)
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None  # this process's (pid, loop)
_loop_lock = threading.Lock()
_SPEC = openapi.document(SETTINGS)
_DOCUMENT = {"/openapi.json": (json.dumps(_SPEC), "application/json"),
             "/docs": (openapi.docs_page(_SPEC), "text/html")}


def _event_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop, its thread started on first use (again in a process forked after it)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="batchgate-gcf-loop", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


def batchgate(request: Any) -> Any:
    """The HTTP function (signature type `http`, the default: no functions-framework import needed). Answers as
    the HTTP gateway does: HEAD as GET (the server leaves the body out), a repeated query parameter's last value,
    an event stream's no-store and no-buffering headers."""
    from flask import Response

    head = request.method == "HEAD"
    if request.method in ("GET", "HEAD") and request.path in _DOCUMENT:  # the API document, as the gateway's app
        body, ctype = _DOCUMENT[request.path]
        return Response(body, status=200, mimetype=ctype)
    api_req = ApiRequest(
        method="GET" if head else request.method, path=request.path,
        query={k: values[-1] for k, values in request.args.lists()},
        headers={k.lower(): v for k, v in request.headers.items()},
        body=request.get_data(cache=False) if request.method in ("POST", "PUT", "PATCH") else b"",
    )
    resp = asyncio.run_coroutine_threadsafe(routes.handle(SERVICE, api_req), _event_loop()).result()
    body, ctype = resp.render(request.headers.get("accept"))
    headers = dict(resp.headers)
    if ctype.startswith("text/event-stream"):
        headers.setdefault("cache-control", "no-store")
        headers.setdefault("x-accel-buffering", "no")
    return Response(body, status=resp.status, headers=headers, mimetype=ctype)
