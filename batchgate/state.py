"""Where `batchgate up` leaves word of the running local stack (its Redis URL, key prefix and ports), so
that the operations commands (`keys`, `tenants`, `webhooks`) find it without being told. The file is
written once the stack is ready and removed when `up` stops; one whose process is gone (an `up` killed
outright) is ignored, and the operations commands say so."""

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


def recorded_state(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """What the state file says, whether or not its `up` still runs; None when there is no readable file."""
    try:
        state = json.loads(state_path(environ).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def is_running(state: Mapping[str, Any]) -> bool:
    """Whether the `up` that wrote `state` is still alive."""
    try:
        pid = int(state["pid"])
        if pid <= 0:  # 0 or -1 would signal a whole group
            return False
        os.kill(pid, 0)
    except PermissionError:
        return True  # alive, another user's
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return False
    return True


def read_state(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The running stack's state, or None when there is none (no file, or its `up` is gone)."""
    state = recorded_state(environ)
    return state if state is not None and is_running(state) else None
