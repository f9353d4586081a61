"""A compute loop's thread and inbox: commands in from other threads, one round after another on its
own thread (or in turns on a host's thread shared with other loops: `gpu_worker.turns`), and a crash
reported, never swallowed. What a round does is the subclass's (`gpu_worker.model_loop.ModelLoop`).
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Callable
from typing import Protocol

import structlog

from gpu_worker.commands import Command
from gpu_worker.outcomes import Emitted

log = structlog.get_logger(__name__)


class ComputeHost(Protocol):
    """A thread that runs several loops in turns (`gpu_worker.turns.SharedComputeThread`)."""

    def wake(self) -> None: ...

    def start(self) -> None: ...

    def join(self, timeout: float | None = None) -> bool: ...


class ThreadedLoop(abc.ABC):
    def __init__(self, name: str, engine: str) -> None:
        self.name = name  # the model (metrics and logs are labelled by it)
        self.engine = engine
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._host: ComputeHost | None = None  # set when this loop shares a thread with others
        # told, on this loop's thread, each round whether it has work (the worker shares CPU cores by it)
        self.on_work: Callable[[bool], None] | None = None
        self._emit: Callable[[list[Emitted]], None] = lambda items: None
        self._on_crash: Callable[[], None] = lambda: None
        self.stopped = False
        self.crashed: BaseException | None = None

    # --- thread --------------------------------------------------------------------------------
    def attach(self, host: ComputeHost) -> None:
        """Run on `host`'s thread, taking turns with the other engines there, instead of a thread of its own."""
        self._host = host

    def submit(self, cmd: Command) -> None:
        self._inbox.put(cmd)
        if self._host is not None:
            self._host.wake()

    def emit(self, items: list[Emitted]) -> None:
        self._emit(items)

    def start(self) -> None:
        if self._host is not None:
            self._host.start()
            return
        self._thread = threading.Thread(target=self._run, name=f"model-loop-{self.name}-{self.engine}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        if self._host is not None:
            return self._host.join(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        try:
            self._started()
            while not self.stopped:
                self._iterate()
        except BaseException as exc:  # the worker notices and exits non-zero; entries get reclaimed
            self.crashed = exc
            log.exception("model loop crashed", model=self.name)
            self._on_crash()
        finally:
            self.stopped = True

    def _receive(self, *, block: bool, timeout: float) -> None:
        try:
            cmd = self._inbox.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    # --- what a round is: the subclass's ----------------------------------------------------------
    @abc.abstractmethod
    def _started(self) -> None:
        """Called once on the loop's own thread before the first round."""

    @abc.abstractmethod
    def _iterate(self, block: bool = True) -> float | None:
        """One round; with nothing to do, wait for a command if `block`, else return how long it could."""

    @abc.abstractmethod
    def _apply(self, cmd: Command) -> None:
        """Act on one command from the inbox."""
