"""structlog set-up: JSON lines in production, console on a TTY; request ids bound via contextvars."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )



class _ModuleLogger:
    """A `shared` module's logger. As structlog is configured where it is (the gateway, the worker, a program of
    your own); where nothing configured it (batchgate used as a library: the SDK's direct mode), the standard
    library's `logging` under the module's name, silent below WARNING unless the program says otherwise, never
    structlog's unconfigured default (a print to stdout, the caller's program's own output). Decided at each call,
    so a program may configure structlog after importing batchgate; nothing global is changed."""

    __slots__ = ("_configured", "_stdlib")

    def __init__(self, name: str) -> None:
        self._configured = structlog.get_logger(name)  # lazy: reads the configuration at its first use
        self._stdlib = structlog.wrap_logger(
            logging.getLogger(name), wrapper_class=structlog.stdlib.BoundLogger,
            processors=[structlog.contextvars.merge_contextvars, structlog.stdlib.filter_by_level,
                        structlog.processors.format_exc_info,
                        structlog.processors.KeyValueRenderer(key_order=["event"])])

    def __getattr__(self, method: str) -> Any:
        return getattr(self._configured if structlog.is_configured() else self._stdlib, method)


def get_logger(name: str) -> Any:
    """The logger of a module in `shared` (see `_ModuleLogger`)."""
    return _ModuleLogger(name)
