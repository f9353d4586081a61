"""Long-poll and sync-wait: one shared pub/sub connection per process (a gateway, or an SDK client in
direct mode), many waiters.

A waiter subscribes to its request's "done" channel and waits for the confirmation before it reads
the record, so a result written after that read always produces an event it will see; a result
written before it is in the record. If the pub/sub connection drops, every waiter is woken to
re-read its record (events may have been missed while disconnected). No sleep loops: waiters block
on events; the listener blocks on the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shared.logs import get_logger
from shared.records import RECORD_EVENT
from shared.redis_io import UNAVAILABLE, pubsub_of, raise_if_cancelling

log = get_logger(__name__)

SUBSCRIBE_TIMEOUT_S = 2.0
# A channel nobody waits on any more stays subscribed this long, then leaves with the others of its time in one
# UNSUBSCRIBE (at most UNSUBSCRIBE_BATCH channels a command; more leave at once). A waiter for it meanwhile (a
# long-poll right after its submit) finds it subscribed already. Channels to subscribe are sent together too: all
# those asked for in one turn of the event loop, in one SUBSCRIBE.
UNSUBSCRIBE_AFTER_S = 0.25
UNSUBSCRIBE_BATCH = 512


DELTA = b"d"  # a streaming request's worker publishes b"d" + the encoded delta on its done channel


@dataclass(eq=False)
class Subscription:
    channel: str
    event: asyncio.Event = field(default_factory=asyncio.Event)
    # woken by something other than new token deltas (a result, a reconnect): the record needs reading
    record_due: bool = True
    # messages may have been missed (a new subscription, a reconnect): the delta stream needs reading
    missed: bool = True
    deltas: list[bytes] = field(default_factory=list)  # deltas that came with their wake-ups, in order
    record: bytes | None = None  # the terminal record a done event carried (`shared.records.RECORD_EVENT`)
    released: bool = False  # the gateway is shutting down: answer with what there is, wait no more

    def take_record(self) -> bytes | None:
        record, self.record = self.record, None
        return record

    def take_record_due(self) -> bool:
        due, self.record_due = self.record_due, False
        return due

    def take_deltas(self) -> tuple[list[bytes], bool]:
        """The deltas received since the last call, and whether some may have been missed."""
        out, missed = self.deltas, self.missed
        self.deltas, self.missed = [], False
        return out, missed

    def raise_if_released(self) -> None:
        if self.released:
            raise Released

    async def wait(self, timeout: float) -> bool:
        """True if woken (event or reconnect) before `timeout`; clears the event for the next wait. Returns at
        once once released."""
        if self.released:
            return True
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except TimeoutError:
            return False
        self.event.clear()
        return True


class SubscriptionUnavailable(Exception):
    """The hub could not confirm a subscription (Redis down or slow)."""


class Released(Exception):
    """The gateway is shutting down: a stream ends here, its caller reconnects (to another gateway)."""


class WaiterHub:
    def __init__(self, redis: aioredis.Redis, heartbeat_channel: str) -> None:
        self._redis = redis
        self._heartbeat = heartbeat_channel
        self._pubsub: aioredis.client.PubSub | None = None
        self._subs: dict[str, set[Subscription]] = {}
        self._confirm: dict[str, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._idle: dict[str, None] = {}  # subscribed at Redis, nobody waiting: left by the next UNSUBSCRIBE
        self._unsubscribing: asyncio.TimerHandle | None = None
        self._to_send: dict[str, None] = {}  # asked for in this turn of the loop: one SUBSCRIBE for all
        self.released = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="waiter-hub")

    async def ensure_started(self) -> None:
        """Start on first use: serverless adapters run no lifespan, and the task must live in the loop that
        serves requests (it sleeps with the loop between invocations of a warm container)."""
        if self._task is None or self._task.done():
            await self.start()

    async def close(self) -> None:
        if self._unsubscribing is not None:
            self._unsubscribing.cancel()
            self._unsubscribing = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()

    def release_all(self) -> None:
        """Shutting down: wake every waiter, now and from now on; each answers with what it has (a long-poll
        the record as it stands, an event stream an `error` event to reconnect with its Last-Event-ID)."""
        self.released = True
        for subs in self._subs.values():
            for sub in subs:
                sub.released = True
                sub.event.set()

    @property
    def waiting(self) -> int:
        return sum(len(s) for s in self._subs.values())

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: str):  # type: ignore[no-untyped-def]
        sub = Subscription(channel, released=self.released)
        # subscribed already: by another waiter, or left idle by one that finished (still confirmed, still live)
        idle = channel in self._idle
        self._idle.pop(channel, None)
        first = channel not in self._subs and not idle
        self._subs.setdefault(channel, set()).add(sub)
        try:
            if first or channel in self._confirm:
                await self._confirmed(channel, send=first)
            yield sub
        finally:
            subs = self._subs.get(channel)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[channel]
                    if self._confirm.pop(channel, None) is None and self._connected.is_set():
                        self._leave_later(channel)

    async def _confirmed(self, channel: str, *, send: bool) -> None:
        fut = self._confirm.get(channel)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._confirm[channel] = fut
        try:
            if not self._connected.is_set():
                await asyncio.wait_for(self._connected.wait(), SUBSCRIBE_TIMEOUT_S)
            if send:
                if not self._to_send:
                    asyncio.get_running_loop().call_soon(self._send_subscribes)
                self._to_send[channel] = None
            await asyncio.wait_for(asyncio.shield(fut), SUBSCRIBE_TIMEOUT_S)
        except (TimeoutError, *UNAVAILABLE) as exc:
            raise SubscriptionUnavailable(str(exc) or type(exc).__name__) from exc

    def _send_subscribes(self) -> None:
        channels = [c for c in self._to_send if c in self._confirm]
        self._to_send.clear()
        if channels:
            asyncio.ensure_future(self._send(channels)).add_done_callback(_retrieve)

    async def _send(self, channels: list[str]) -> None:
        try:
            if self._pubsub is None:
                raise ConnectionError("pub/sub connection not open")
            await self._pubsub.subscribe(*channels)
        except UNAVAILABLE as exc:
            for channel in channels:
                fut = self._confirm.get(channel)
                if fut is not None and not fut.done():
                    fut.set_exception(ConnectionError(str(exc) or type(exc).__name__))

    def _leave_later(self, channel: str) -> None:
        """Unsubscribe from `channel` with the others left idle around the same time (see `UNSUBSCRIBE_AFTER_S`)."""
        self._idle[channel] = None
        if len(self._idle) >= UNSUBSCRIBE_BATCH:
            self._unsubscribe_idle()
        elif self._unsubscribing is None:
            self._unsubscribing = asyncio.get_running_loop().call_later(UNSUBSCRIBE_AFTER_S, self._unsubscribe_idle)

    def _unsubscribe_idle(self) -> None:
        if self._unsubscribing is not None:
            self._unsubscribing.cancel()
            self._unsubscribing = None
        channels, self._idle = list(self._idle), {}
        if channels and self._pubsub is not None and self._connected.is_set():
            asyncio.ensure_future(self._pubsub.unsubscribe(*channels)).add_done_callback(_retrieve)

    async def _listen(self) -> None:
        backoff = 0.05
        while True:
            self._pubsub = await pubsub_of(self._redis)
            try:
                await self._pubsub.subscribe(self._heartbeat, *self._subs)
                self._connected.set()
                backoff = 0.05
                while True:
                    raise_if_cancelling()  # one lost in the SUBSCRIBE's send still ends the hub
                    msg = await self._pubsub.get_message(timeout=5.0)
                    if msg is not None:
                        self._dispatch(msg)
            except UNAVAILABLE as exc:
                raise_if_cancelling(exc)
                log.warning("waiter hub: redis unavailable", error=repr(exc), retry_in_s=backoff)
            finally:
                self._connected.clear()
                self._idle.clear()  # a new connection subscribes only to the channels waited on
                with contextlib.suppress(Exception):
                    await self._pubsub.aclose()
                self._wake_all()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _dispatch(self, msg: dict) -> None:  # type: ignore[type-arg]
        channel = msg.get("channel")
        if isinstance(channel, bytes):
            channel = channel.decode()
        kind = msg.get("type")
        if kind == "subscribe":
            fut = self._confirm.pop(channel, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
            elif channel in self._subs:
                # re-subscribed after a reconnect: a result may have been published while we were not
                # subscribed, so wake the waiters once more to re-read their records
                for sub in self._subs[channel]:
                    sub.record_due = sub.missed = True
                    sub.event.set()
            elif channel != self._heartbeat and channel not in self._idle and self._pubsub is not None:
                # nobody waits on it any more (left while we were disconnected): drop it
                asyncio.ensure_future(self._pubsub.unsubscribe(channel)).add_done_callback(_retrieve)
        elif kind == "message":
            data = msg.get("data")
            delta = data[1:] if isinstance(data, bytes) and data[:1] == DELTA else None
            record = data[1:] if isinstance(data, bytes) and data[:1] == RECORD_EVENT else None
            for sub in self._subs.get(channel, ()):
                if delta is not None:
                    sub.deltas.append(delta)
                else:
                    sub.record_due = True
                    sub.record = record
                sub.event.set()

    def _wake_all(self) -> None:
        for subs in self._subs.values():
            for sub in subs:
                sub.record_due = sub.missed = True
                sub.event.set()
        for fut in self._confirm.values():
            if not fut.done():
                fut.set_exception(ConnectionError("pub/sub connection lost"))
        self._confirm.clear()


def _retrieve(task: asyncio.Future[None]) -> None:
    """A background send's outcome, consumed: a failed one is logged, not left to the loop's "never retrieved"."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.debug("waiter hub: background command failed", error=repr(exc))
