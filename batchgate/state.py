"""Where `batchgate up` leaves word of the running local stack (its Redis URL, key prefix and ports), so
that the operations commands (`keys`, `tenants`, `webhooks`) find it without being told. The file is
written once the stack is ready and removed when `up` stops; one whose process is gone is ignored."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def state_path(environ: Mapping[str, str]) -> Path:
    """`$BATCHGATE_STATE_DIR/up.json`, else `$XDG_STATE_HOME/batchgate/up.json`, else
    `~/.local/state/batchgate/up.json`."""
    base = environ.get("BATCHGATE_STATE_DIR")
    if base:
        return Path(base) / "up.json"
    xdg = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "batchgate" / "up.json"


def write_state(environ: Mapping[str, str], state: Mapping[str, Any]) -> Path:
    path = state_path(environ)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**state, "pid": os.getpid()}))
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    return path


def remove_state(environ: Mapping[str, str]) -> None:
    path = state_path(environ)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def read_state(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The running stack's state, or None when there is none (no file, or its `up` is gone)."""
    try:
        state = json.loads(state_path(environ).read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state if isinstance(state, dict) else None
