"""Child processes whose lives end with their parent's: own session (a terminal's Ctrl+C reaches only
the parent, which stops them in order) and, on Linux, `PR_SET_PDEATHSIG` so that a SIGKILLed parent
takes them with it instead of leaving them orphaned."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for Popen: the child receives `sig` when this process dies (Linux; None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
