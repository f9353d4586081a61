"""`batchgate gateway`: the Starlette app on uvicorn with uvloop."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from shared.config import Settings


def run_gateway(settings: Settings) -> None:
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, loop="auto", http="auto", log_config=None,
                access_log=False, timeout_graceful_shutdown=10)
