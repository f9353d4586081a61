"""`batchgate gateway`: the Starlette app on uvicorn with uvloop.

On SIGTERM the gateway stops accepting connections and lets the requests in flight go on: a long-poll or an
event stream whose result comes within `shutdown_grace_s` less `RELEASE_MARGIN_S` gets it (the worker is
still running: `batchgate up` and a rolling deploy stop gateways first). Then the waiters still waiting are
released (`WaiterHub.release_all`): a long-poll answers the record as it stands, an event stream ends with an
`error` event telling its caller to reconnect with its Last-Event-ID, each a whole response, and uvicorn's
own limit (`shutdown_grace_s`) is never reached. sse-starlette's own drain, which cut every stream at the
first signal, is turned off.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from sse_starlette.sse import AppStatus
from starlette.types import ASGIApp

from gateway.app import create_app
from gateway.header_timeout import protocol_class
from gateway.service import GatewayService
from shared.config import Settings

RELEASE_MARGIN_S = 2.0  # between releasing the waiters and uvicorn's limit: time to answer them


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: GatewayService, grace_s: float) -> None:
        super().__init__(config)
        self.service = service
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        release = asyncio.get_running_loop().call_later(max(0.0, self.grace_s - RELEASE_MARGIN_S),
                                                        self.service.hub.release_all)
        try:
            await super().shutdown(sockets)
        finally:
            release.cancel()


def server_config(app: ASGIApp, settings: Settings) -> uvicorn.Config:
    """uvicorn as the gateway runs it: the header timeout's protocol, the keep-alive above the clients' own idle
    limit (so a client never reuses a connection the server is closing), the shutdown grace; the tests' in-process
    gateway uses it too."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, loop="auto",
                          http=protocol_class(settings.header_timeout_s), timeout_keep_alive=settings.keep_alive_s,
                          log_config=None, access_log=False, timeout_graceful_shutdown=settings.shutdown_grace_s)


def run_gateway(settings: Settings) -> None:
    app = create_app(settings)
    AppStatus.disable_automatic_graceful_drain()  # streams end through the hub's release instead (above)
    _Server(server_config(app, settings), app.state.service, settings.shutdown_grace_s).run()
