"""structlog set-up: JSON lines in production, console on a TTY; request ids bound via contextvars."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import msgspec
import structlog

# Libraries that log a line per HTTP request at INFO (httpx: the dispatcher's every webhook attempt, its URL's query
# string, a receiver's token, included): their warnings only.
QUIET_LIBRARIES = ("httpx", "httpcore")


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """structlog for batchgate's own events; in JSON, the standard library's records (uvicorn's, redis-py's,
    transformers') go through the same renderer, one JSON line each, and progress bars are off: a pipeline that
    reads one JSON object per line reads every line."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = render_json if use_json else structlog.dev.ConsoleRenderer(colors=False)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(message)s")
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(logging.WARNING, getattr(logging, level.upper(), logging.INFO)))
    if use_json:
        _json_stdlib_records()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            UtcTimestamp(),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


_json_lines = False  # configure_logging chose JSON: libraries that print on their own are routed through it


def _json_stdlib_records() -> None:
    """The root handler renders standard library records as batchgate's JSON lines (their logger's name as
    `logger`); Hugging Face's and tqdm's progress bars are off (set before those libraries are imported, which
    read it then)."""
    global _json_lines
    _json_lines = True
    formatter = structlog.stdlib.ProcessorFormatter(
        processor=render_json,
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, UtcTimestamp(),
                           structlog.processors.format_exc_info])
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")


def adopt_transformers_logging() -> None:
    """Once transformers is imported (a worker loading its models): in JSON, its records (a load report's table, a
    warning) go through the root handler as JSON lines, not to the plain handler it installs for itself."""
    if not _json_lines:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


class UtcTimestamp:
    """structlog's `TimeStamper(fmt="iso", utc=True)` (`"timestamp": "2026-11-28T15:20:01.042137Z"`, always to the
    microsecond) at a third of its cost: the date and time to the second are formatted once a second. A line is
    logged for every request a gateway accepts: at thousands a second, its timestamp was a measurable share of
    the gateway's CPU."""

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")  # one attribute: threads that log read a consistent pair

    def __call__(self, _logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        second, text = self._second
        if int(now) != second:
            second = int(now)
            text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = (second, text)
        event_dict["timestamp"] = f"{text}.{int((now - second) * 1e6):06d}Z"  # < 1e6: now - second < 1
        return event_dict


_JSON = msgspec.json.Encoder(enc_hook=repr)  # a value JSON has no type for is logged as its repr, as structlog's
_STRUCTLOG_JSON = structlog.processors.JSONRenderer()


def render_json(logger: Any, method: str, event_dict: dict[str, Any]) -> str:
    """A JSON line, as structlog's `JSONRenderer` writes it (in the event's order; a value of no JSON type as its
    repr), encoded by msgspec at a twentieth of the cost; unlike it, text is UTF-8 rather than escaped, an enum is
    its value, and a NaN is null (JSON has none). An event msgspec cannot encode goes to structlog's renderer."""
    try:
        return _JSON.encode(event_dict).decode()
    except Exception:
        return _STRUCTLOG_JSON(logger, method, event_dict)  # type: ignore[return-value]


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
