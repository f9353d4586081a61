"""The batch runner (`batchgate batches`, its own deployable; `batchgate up` runs one): takes each active
batch under a lease, validates its input file, feeds its items into the lanes a bounded number at a
time, writes one line per item as it finishes, and writes the output and error files at the end.

- Validation reads the whole file first (`shared.batches.parse_line` and the submit body's own checks
  against the model): any bad line fails the batch with the line errors, and nothing is computed.
- Feeding: at most `in_flight` items of a batch are queued or running at once, so a 50,000-line batch never
  floods the lanes or the admission estimate. Items go through `shared.operations.submit` like any caller's
  requests (admission, the tenant's quota), at batch priority, with the batch's window as their deadline
  (bounded by the model's `max_timeout_s`): a worker runs them on capacity interactive work leaves idle
  and preempts them for it. A refusal for capacity (429) pauses feeding for its Retry-After.
- Exactly once: each item's idempotency key is its batch id and line (`shared.batches.item_key`), so an item
  fed again after a crash finds its request again instead of making a second; lines are written once per line number
  (`shared.batch_store`). Another runner takes a batch over when its lease lapses and resumes from the
  recorded feed position.
- An item whose request expired before it ran, its deadline the model's `max_timeout_s` and the window still
  open, is fed again (a new request, under its attempt's key): no worker for an hour costs a 24h batch nothing.
- Cancel stops feeding, cancels the items in flight that have not started and lets those running finish; the
  window's end does the same (`expired`). Items that never ran get an error line (`batch_cancelled`,
  `batch_expired`); one that cannot fit before the window's end is `batch_expired` at once, and the batch ends
  `expired`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import structlog

from shared import files, jsonl
from shared import operations as ops
from shared.api_errors import ApiError, TooManyRequests
from shared.batch_store import BatchState, BatchStore
from shared.batches import (
    TERMINAL,
    WINDOW_ENDED,
    BatchError,
    Item,
    ItemRef,
    Progress,
    Written,
    item_key,
    parse_line,
    refused_line,
    refused_line_id,
    result_line,
    submit_body,
)
from shared.config import Settings
from shared.errors import ValidationError
from shared.messages import CallbackDelivery
from shared.queue_client import QueueClient
from shared.records import parse_record
from shared.redis_io import UNAVAILABLE, raise_if_cancelling
from shared.states import Status, Task
from shared.submit import build_request
from shared.views import record_view

log = structlog.get_logger(__name__)

IN_FLIGHT = 128  # items of one batch queued or running at once (2x the default engine's 64 rows)
POLL_S = 0.25  # how often the items in flight are read
DISCOVER_S = 1.0  # how often the runner looks for batches to take
LEASE_S = 15.0  # a runner that stops renewing loses its batches after this long
CANCEL_CHECK_LINES = 1000  # validation looks for a cancel this often (a 50,000-line file takes ~15 s to check)
DEADLINE_RETRY_S = 2.0  # an item refused for the queue its window's end leaves it is tried again after at most this
MAX_ERRORS = 100
TASK_OF = {"completion": Task.GENERATE, "chat": Task.GENERATE, "response": Task.GENERATE, "native": None,
           "embedding": Task.EMBED}


class Entry(NamedTuple):
    """An input line as read: its number (from 0), its bytes, the byte offset after it, the byte offset of its start
    (where a reader that reads it again starts)."""

    line: int
    raw: bytes
    end: int
    start: int


async def lines_from(store: files.FileStore, key: str, start: int, first: int) -> AsyncIterator[Entry]:
    """The lines from byte offset `start` (which is line `first`); blank lines are skipped but counted, and a byte
    order mark before the file's first line is not part of it."""
    buf = b""
    offset, line = start, first
    async for chunk in store.read(key, start):
        buf += chunk
        while (nl := buf.find(b"\n")) >= 0:
            raw, buf = buf[:nl], buf[nl + 1:]
            if offset == 0:
                raw = raw.removeprefix(jsonl.BOM)
            if raw.strip():
                yield Entry(line, raw, offset + nl + 1, offset)
            offset += nl + 1
            line += 1
    end = offset + len(buf)
    at = offset
    if offset == 0:
        buf = buf.removeprefix(jsonl.BOM)
    if buf.strip():
        yield Entry(line, buf, end, at)


@dataclass
class Feeding:
    """Where a batch's feeding stands: the file's reader, the line about to be fed, those to feed again (their
    requests expired before they ran), whether the file is read to its end, and until when feeding pauses."""

    reader: AsyncIterator[Entry] | None
    pending: Pending | None = None
    again: list[ItemRef] = field(default_factory=list)
    exhausted: bool = False
    paused_until: float = 0.0


class Pending(NamedTuple):
    """A line about to be fed: `attempt` 0 is its first feeding (from the file, in order); a later one feeds a
    line again whose request expired before it ran (`result_line`)."""

    entry: Entry
    attempt: int = 0


class BatchRunner:
    def __init__(self, settings: Settings, *, queue: QueueClient | None = None, in_flight: int = IN_FLIGHT,
                 poll_s: float = POLL_S, name: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.q = queue or QueueClient(settings)
        self._own_queue = queue is None
        self.store = BatchStore(self.q.redis, self.q.keys)
        self.files = files.file_store(settings)
        self.in_flight = in_flight
        self.poll_s = poll_s
        self.name = name or f"batches-{os.getpid()}-{secrets.token_hex(3)}"
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        log.info("batch runner started", runner=self.name, in_flight=self.in_flight)
        try:
            while not stop.is_set():
                await self.discover()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), DISCOVER_S)
        finally:
            for task in self._tasks.values():
                task.cancel()
            for batch_id, task in list(self._tasks.items()):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                with contextlib.suppress(Exception):
                    await self.store.release(batch_id, self.name)
            if self._own_queue:
                await self.q.close()

    async def discover(self) -> None:
        """Take each active batch no runner holds."""
        for batch_id, task in list(self._tasks.items()):
            if task.done():
                del self._tasks[batch_id]
        try:
            active = await self.store.active()
            for batch_id in active:
                if batch_id not in self._tasks and await self.store.lease(batch_id, self.name, int(LEASE_S * 1000)):
                    self._tasks[batch_id] = asyncio.create_task(self._hold(batch_id), name=f"batch-{batch_id}")
        except Exception as exc:  # Redis away: try again at the next round
            log.warning("batch runner: discovery failed", error=repr(exc))

    async def _hold(self, batch_id: str) -> None:
        """Run a batch while renewing its lease; stop at once if the lease is lost."""
        work = asyncio.create_task(self.run_batch(batch_id))
        try:
            while not work.done():
                raise_if_cancelling()  # one lost in the lease's Redis call still ends the hold
                done, _ = await asyncio.wait([work], timeout=LEASE_S / 3)
                if done:
                    break
                try:
                    if not await self.store.renew(batch_id, self.name, int(LEASE_S * 1000)):
                        log.warning("batch lease lost", batch_id=batch_id, runner=self.name)
                        work.cancel()
                except Exception as exc:
                    log.warning("batch lease renewal failed", batch_id=batch_id, error=repr(exc))
            await work
        except Exception:
            log.exception("batch run failed; another round takes it again", batch_id=batch_id)
        finally:
            await cancel_until_done(work)  # before the lease goes: no second runner while this one still writes
            with contextlib.suppress(Exception):
                await self.store.release(batch_id, self.name)

    # --- one batch -------------------------------------------------------------------------------------
    async def run_batch(self, batch_id: str) -> None:
        st = await self.store.get(batch_id)
        if st is None:
            return
        if st.progress.status == "validating":
            if not await self.validate(st):
                return
            st = await self.store.get(batch_id)
            assert st is not None
        if st.progress.status in ("in_progress", "cancelling"):
            final = await self.feed(st)
            st = await self.store.get(batch_id)
            if final is None or st is None:  # another runner took it over and ended it meanwhile
                return
            await self.finalize(st, final)
        elif st.progress.status == "finalizing":  # a runner died writing the files: write them again
            await self.finalize(st, "completed")  # the final status it recorded stays
        elif st.progress.status in TERMINAL:  # a runner died right after the end: what follows it is still to do
            await self.after_end(batch_id)

    def _tool_parser(self, model: str) -> str:
        """A model's tool-call format, which a chat line's tool_choice "auto" needs ("": none, or no such model)."""
        spec = self.settings.model(model)
        return spec.tool_call_parser if spec is not None else ""

    def _check(self, item: Item, tenant: str) -> None:
        """The item's submit body against its model, as a submit would check it (no admission)."""
        spec = self.settings.model(item.model)
        if spec is None:  # a native line's model is in its url (the batch's endpoint)
            raise BatchError(f"unknown model {item.model!r}", code="model_not_found", line=item.line,
                             param="url" if item.kind == "native" else "body.model")
        want = TASK_OF[item.kind]
        if want is not None and spec.task is not want:
            raise BatchError(f"{item.model!r} is {spec.task.model_kind}", code="wrong_model_task",
                             param="body.model", line=item.line)
        try:
            build_request(submit_body(item, self.clock() + spec.max_timeout_s / 2), spec, tenant, self.clock(),
                          self.q.callback_allow, self.q.token_limits)
        except ValidationError as exc:
            param, message = item.param(exc.field, exc.message)
            # a code more precise than the default keeps it, as the interactive route answers (context_length_exceeded)
            raise BatchError(message, code=exc.code or "invalid_request", param=param, line=item.line) from None

    async def validate(self, st: BatchState) -> bool:
        """Every line checked before anything runs: `in_progress` with the total, or `failed` with the errors. A
        cancel while it reads stops it (every line then gets `batch_cancelled`)."""
        meta = st.meta
        fmeta = await files.get_meta(self.q.redis, self.q.keys, meta.input_file_id)
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()
        models: set[str] = set()
        if fmeta is None:
            errors.append(BatchError("the input file is gone", code="file_not_found", param="input_file_id").entry())
        else:
            async for line, raw, _, _ in lines_from(self.files, fmeta.key, 0, 0):
                if line % CANCEL_CHECK_LINES == CANCEL_CHECK_LINES - 1 and await self._cancelled(meta.id):
                    return True  # `cancelling`: the feed answers every line `batch_cancelled`
                try:
                    item = parse_line(raw, line, meta.endpoint, self._tool_parser)
                    if item.custom_id in seen:
                        raise BatchError(f"custom_id {item.custom_id!r} is used by an earlier line",
                                         code="duplicate_custom_id", param="custom_id", line=line)
                    seen.add(item.custom_id)
                    models.add(item.model)
                    self._check(item, meta.tenant)
                except BatchError as err:
                    if len(errors) < MAX_ERRORS:
                        errors.append(err.entry())
            if not seen and not errors:
                errors.append(BatchError("the input file has no requests", code="empty_file",
                                         param="input_file_id").entry())
        now = int(self.clock())
        if errors:
            await self.store.set_fields(meta.id, errors=json.dumps(errors), total=0)
            await self.store.move(meta.id, "failed", "failed_at", now, from_=("validating", "cancelling"))
            await self.after_end(meta.id)  # its webhook, then out of the active set (the next runner's, if it dies)
            log.info("batch failed validation", batch_id=meta.id, errors=len(errors))
            return False
        # the batch's model, as OpenAI's batch object shows it: the one its lines name ("" where they name several)
        await self.store.set_fields(meta.id, total=len(seen), model=models.pop() if len(models) == 1 else "")
        status = await self.store.move(meta.id, "in_progress", "in_progress_at", now, from_=("validating",))
        log.info("batch validated", batch_id=meta.id, items=len(seen), status=status)
        return status in ("in_progress", "cancelling")  # cancelled while validating: every line gets its error

    async def _cancelled(self, batch_id: str) -> bool:
        cur = await self.store.get(batch_id)
        return cur is None or cur.progress.status == "cancelling"

    async def feed(self, st: BatchState) -> str | None:
        """Feed and collect until every item has its line, or the batch is cancelled or its window ends;
        returns the final status (`expired` too where a line was answered `batch_expired` before the end), or None
        when the batch is past feeding already (a runner stalled past its lease: another took the batch over)."""
        meta, batch_id = st.meta, st.meta.id
        fmeta = await files.get_meta(self.q.redis, self.q.keys, meta.input_file_id)
        f = Feeding(lines_from(self.files, fmeta.key, st.next_offset, st.next_line) if fmeta else None)
        f.exhausted = f.reader is None
        flight = {ref.line: ref for ref in await self.store.in_flight(batch_id)}
        ending: str | None = None
        while True:
            cur = await self.store.get(batch_id)
            if cur is None:
                return "cancelled"
            if cur.progress.status not in ("in_progress", "cancelling"):
                log.warning("batch ended by another runner; this one stops", batch_id=batch_id, runner=self.name,
                            status=cur.progress.status)
                return None
            now = self.clock()
            if ending is None and (cur.progress.status == "cancelling" or now >= meta.expires_at):
                ending = "cancelled" if cur.progress.status == "cancelling" else "expired"
            if ending is not None:  # each round: a running item a worker hands back is queued again meanwhile
                await self._stop_queued(meta.tenant, list(flight.values()))
            elif now >= f.paused_until:
                await self._fill(meta, fmeta, flight, f, now)
            f.again += await self._collect(meta, flight, ending)
            if ending is not None and not flight:
                await self._close_unfed(meta, f.reader, f.pending, f.again, ending)
                return ending
            if f.exhausted and f.pending is None and not f.again and not flight:
                cur = await self.store.get(batch_id)
                return "expired" if cur is not None and cur.expiring else "completed"
            await asyncio.sleep(self.poll_s)

    async def _fill(self, meta: Any, fmeta: files.FileMeta | None, flight: dict[int, ItemRef], f: Feeding,
                    now: float) -> None:
        """Feed lines (those to feed again first) until `in_flight` are in flight, the file is read, or a refusal
        for capacity pauses feeding."""
        while len(flight) < self.in_flight:
            if f.pending is None:
                f.pending = await self._next(meta, fmeta, f.again, f.reader if not f.exhausted else None)
                if f.pending is None:
                    f.exhausted = True
                    return
            fed = await self._submit(meta, f.pending, now)
            if isinstance(fed, float):  # refused for capacity: try again after its Retry-After
                f.paused_until = now + fed
                return
            if isinstance(fed, ItemRef):
                flight[fed.line] = fed
            f.pending = None

    async def _next(self, meta: Any, fmeta: files.FileMeta | None, again: list[ItemRef],
                    reader: AsyncIterator[Entry] | None) -> Pending | None:
        """The next line to feed: one to feed again first (read again from its offset; a ref of a runner of before
        has none, and is looked for from the file's start), else the file's next."""
        while again and fmeta is not None:
            ref = again.pop(0)
            lines = lines_from(self.files, fmeta.key, max(ref.offset, 0), ref.line if ref.offset >= 0 else 0)
            try:
                async for entry in lines:
                    if entry.line >= ref.line:
                        if entry.line == ref.line:
                            return Pending(entry, ref.attempt + 1)
                        break
            finally:
                await lines.aclose()
            # its line is not where it was (the file's bytes changed under the batch): answered, never dropped
            await self.store.write_line(meta.id, ref.line, Written(False, refused_line(
                ref.custom_id, "input_changed", "the input file no longer holds this line where it did",
                line_id="batch_req_" + ref.request_id.removeprefix("req_"))))
        if reader is None:
            return None
        entry = await anext(reader, None)
        return None if entry is None else Pending(entry)

    async def _submit(self, meta: Any, pending: Pending, now: float) -> ItemRef | float | None:
        """Submit one line: its in-flight ref; the seconds to wait when refused for capacity (nothing
        recorded); None when refused for good (its error line written). A line fed again leaves the feed position
        where it is."""
        (line, raw, end, start), attempt = pending
        item = parse_line(raw, line, meta.endpoint, self._tool_parser)
        spec = self.settings.model(item.model)
        assert spec is not None  # validated
        deadline = min(float(meta.expires_at), now + spec.max_timeout_s)
        try:
            answer = await ops.submit(self.q, submit_body(item, deadline), spec, meta.tenant,
                                      idempotency_key=item_key(meta.id, line, attempt))
        except TooManyRequests as exc:
            if exc.code == "deadline_infeasible" and not exc.retryable:
                # its own compute, with no queue at all, passes its deadline: no wait changes that. Where that
                # deadline is the window's end, the window leaves it undone (`batch_expired`, the batch `expired`);
                # else it is the model's max_timeout_s, which the request cannot fit, as an interactive one cannot
                at_window = deadline >= meta.expires_at
                await self._written(meta, pending, Written(False, refused_line(
                    item.custom_id, "batch_expired", WINDOW_ENDED, line_id=refused_line_id(meta.id, line))
                    if at_window else refused_line(item.custom_id, exc.code, exc.message, 429,
                                                   line_id=refused_line_id(meta.id, line)), expired=at_window))
                return None
            if exc.code == "deadline_infeasible":
                # the queue ahead, as estimated, passes the window's end: the estimate errs (a queue drains faster
                # than a forecast says), so the item is tried again soon, until it fits or the window ends (then it
                # and the lines after it are answered `batch_expired`, as OpenAI answers what a window left)
                return min(float(exc.retry_after or 1.0), DEADLINE_RETRY_S)
            return float(exc.retry_after or 1.0)
        except ApiError as exc:
            if exc.code == "idempotency_in_progress":  # a runner that died claimed its key moments ago: soon
                return float(exc.retry_after or 1.0)
            await self._written(meta, pending, Written(False, refused_line(
                item.custom_id, exc.code, exc.message, exc.status, line_id=refused_line_id(meta.id, line))))
            return None
        except UNAVAILABLE as exc:  # Redis away, or a write its replicas did not confirm: not the line's fault
            log.warning("batch item not fed: redis unavailable; feeding again shortly", batch_id=meta.id, line=line,
                        error=repr(exc))
            return 1.0
        ref = item.ref(str(answer.body["id"]), deadline=deadline, offset=start, attempt=attempt)
        if attempt:
            await self.store.refed(meta.id, ref)
        else:
            await self.store.fed(meta.id, [ref], line + 1, end)
        return ref

    async def _written(self, meta: Any, pending: Pending, written: Written) -> None:
        """A line answered without a request in flight; a first feeding moves the feed position past it."""
        entry = pending.entry
        await self.store.write_line(meta.id, entry.line, written)
        if pending.attempt == 0:
            await self.store.fed(meta.id, [], entry.line + 1, entry.end)

    async def _collect(self, meta: Any, flight: dict[int, ItemRef], ending: str | None) -> list[ItemRef]:
        """Write the line of every item in flight that finished (one round trip to read them all); `ending`: how the
        batch is ending, if it is (`result_line`). Returns those to feed again (out of `flight`; their refs stay
        recorded until fed again or answered, so a runner that takes over feeds them again too)."""
        if not flight:
            return []
        refs = list(flight.values())
        pipe = self.q.redis.pipeline(transaction=False)
        for ref in refs:
            pipe.hgetall(self.q.keys.record(ref.request_id))
        created = int(self.clock())
        again = []
        for ref, raw in zip(refs, await pipe.execute(), strict=True):
            rec = parse_record(ref.request_id, raw)
            if rec is not None and not rec.terminal:
                rec = await self.q.get(ref.request_id)  # expires it once its deadline (and grace) passed
            if rec is None and ending is None and self.clock() < meta.expires_at:
                # gone uncollected (runners away past the result TTL): fed again while the window lasts (the key of
                # its next attempt finds that request if one was made)
                del flight[ref.line]
                again.append(ref)
                continue
            if rec is None:
                written: Written | None = Written(False, refused_line(
                    ref.custom_id, "result_expired", "the item's result expired before it was collected",
                    line_id="batch_req_" + ref.request_id.removeprefix("req_")))
            elif not rec.terminal:
                continue
            else:
                written = result_line(ref, record_view(rec), created, ending, expires_at=meta.expires_at,
                                      now=self.clock())
            del flight[ref.line]
            if written is None:
                again.append(ref)
            else:
                await self.store.write_line(meta.id, ref.line, written)
        return again

    async def _stop_queued(self, tenant: str, refs: list[ItemRef]) -> None:
        """Cancel the items in flight that have not started (the batch's cancel, or its window's end); those
        running finish, and their lines are written as they end (a generation the window's end cuts keeps what it
        generated, `length`)."""
        if not refs:
            return
        pipe = self.q.redis.pipeline(transaction=False)
        for ref in refs:
            pipe.hgetall(self.q.keys.record(ref.request_id))
        recs = [parse_record(ref.request_id, raw) for ref, raw in zip(refs, await pipe.execute(), strict=True)]
        # only while it is still queued, in one step with the check (`cancel_queued`): a request a worker starts after
        # the read above runs to its end and is written as it ends (cancelled through its worker, it ended with no
        # output and a 409 line, neither finished nor `batch_cancelled`)
        await asyncio.gather(*(self.q.cancel_queued(rec, "cancelled with its batch before it ran") for rec in recs
                               if rec is not None and rec.state is Status.QUEUED and rec.meta is not None
                               and rec.meta.tenant == tenant))

    async def _close_unfed(self, meta: Any, reader: AsyncIterator[Entry] | None, pending: Pending | None,
                           again: list[ItemRef], ending: str) -> None:
        """Every line not fed (or waiting to be fed again) gets its error line: the batch was cancelled, or its
        window ended."""
        code = "batch_cancelled" if ending == "cancelled" else "batch_expired"
        message = "the batch was cancelled before this request ran" if ending == "cancelled" else WINDOW_ENDED
        seen = {ref.custom_id for ref in again}
        for ref in again:
            await self.store.write_line(meta.id, ref.line, Written(False, refused_line(
                ref.custom_id, code, message, line_id="batch_req_" + ref.request_id.removeprefix("req_"))))
        entries = [pending.entry] if pending is not None else []
        if pending is not None and pending.attempt:  # a line fed again: its place in the file is behind the reader
            await self._refuse(meta, pending.entry, code, message, seen)
            entries = []
        last = None
        for entry in entries:
            last = entry
            await self._refuse(meta, entry, code, message, seen)
        if reader is not None:
            async for entry in reader:
                last = entry
                await self._refuse(meta, entry, code, message, seen)
        if last is not None:
            await self.store.fed(meta.id, [], last.line + 1, last.end)

    async def _refuse(self, meta: Any, entry: Entry, code: str, message: str, seen: set[str]) -> None:
        """A line not fed gets its error line, unless it is no request: cancelled before validation read it, a line
        that does not parse, or repeats an earlier line's `custom_id`, was never a request and gets none (a line with
        no `custom_id`, or one that a caller keying the results by it would see twice)."""
        try:
            custom_id = parse_line(entry.raw, entry.line, meta.endpoint, self._tool_parser).custom_id
        except BatchError:
            return
        if custom_id in seen:
            return
        seen.add(custom_id)
        await self.store.write_line(meta.id, entry.line, Written(False, refused_line(
            custom_id, code, message, line_id=refused_line_id(meta.id, entry.line))))

    async def finalize(self, st: BatchState, final: str) -> None:
        """Write the output and error files, then end the batch. Fenced: each finalizing attempt writes files of
        its own (their ids come from the batch's and the attempt's number) and ends the batch only if it is still
        the latest attempt and its runner holds the lease, so a runner stalled past its lease (even in the middle
        of a file) ends nothing and writes over nothing: it deletes its own files instead."""
        batch_id = st.meta.id
        began = await self.store.begin_finalize(batch_id, self.name, final, int(self.clock()))
        if began.attempt == 0:  # ended already (another runner, while this one stalled past its lease), or lost
            log.warning("batch not finalized by this runner", batch_id=batch_id, runner=self.name,
                        status=began.status)
            return
        st = await self.store.get(batch_id)
        assert st is not None
        total = max(st.progress.total, st.next_line)  # the file's lines that may have one written
        if total > st.progress.total:  # cancelled before it was validated: its requests are the lines written
            await self.store.set_fields(batch_id, total=st.progress.completed + st.progress.failed)
        written: list[files.FileMeta] = []
        ids: dict[str, str] = {}
        try:
            for field_, ok, suffix in (("out_id", True, "output"), ("err_id", False, "errors")):
                if (meta := await self._write_file(st, total, began.attempt, ok=ok, suffix=suffix)) is not None:
                    written.append(meta)
                    ids[field_] = meta.id
        except BaseException:  # cancelled (its lease lost) or failed: its files are no one's
            await asyncio.shield(self._drop_files(written))
            raise
        time_field = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[began.final]
        # not dropped if this call is cut: the end may have happened (the next attempt deletes them if not)
        ended = await self.store.end(batch_id, self.name, began.attempt, began.final, time_field, int(self.clock()),
                                     **ids)
        if not ended:
            await self._drop_files(written)
            log.warning("batch lease lost while finalizing; left to its new runner", batch_id=batch_id,
                        runner=self.name)
            return
        await self.after_end(batch_id)
        p: Progress = st.progress
        log.info("batch finished", batch_id=batch_id, status=began.final, completed=p.completed, failed=p.failed)

    async def after_end(self, batch_id: str) -> None:
        """What follows a batch's end, each step safe to repeat (a runner that dies in between leaves the batch
        active, and the next one that takes it does them again): its webhook (the same delivery id, which the
        dispatcher schedules once), the files of earlier finalizing attempts deleted, its working state dropped."""
        st = await self.store.get(batch_id)
        if st is None:
            return
        await self.store.queue_webhook(self._webhook(st.meta, st.progress.status))
        keep = {st.progress.output_file_id, st.progress.error_file_id}
        for attempt in range(1, st.attempts):
            for suffix in ("output", "errors"):
                if (fid := output_file_id(batch_id, suffix, attempt)) not in keep:
                    meta = await files.get_meta(self.q.redis, self.q.keys, fid)
                    await self._drop_files([meta] if meta is not None else [])
        await self.store.finished(batch_id)

    async def _drop_files(self, written: list[files.FileMeta]) -> None:
        """Delete files this runner wrote (record first: a file is never listed without its bytes)."""
        for meta in written:
            with contextlib.suppress(Exception):
                await files.delete_meta(self.q.redis, self.q.keys, meta)
                await self.files.delete(meta.key)

    def _webhook(self, meta: Any, final: str) -> CallbackDelivery | None:
        """The signed webhook of the batch's end (`batch.completed`, `.cancelled`, `.expired` or `.failed`), if it
        named a `callback_url`."""
        return None if meta.callback_url is None else CallbackDelivery(
            delivery_id=f"msg_{meta.id}_{final}", request_id=meta.id, tenant=meta.tenant, event=f"batch.{final}",
            url=meta.callback_url, created_ms=int(self.clock() * 1000))

    async def _write_file(self, st: BatchState, total: int, attempt: int, *, ok: bool,
                          suffix: str) -> files.FileMeta | None:
        """The output (or error) file of one finalizing attempt: its lines in input order, stored, then recorded.
        Its id comes from the batch's and the attempt's: no attempt writes over another's."""
        count = st.progress.completed if ok else st.progress.failed
        if count == 0:
            return None
        file_id = output_file_id(st.meta.id, suffix, attempt)
        counted = files.LineCount()

        async def chunks() -> AsyncIterator[bytes]:
            async for good, line in self.store.lines(st.meta.id, total):
                if good == ok:
                    yield line + b"\n"

        size = await self.files.write(file_id, counted.count(chunks()))
        meta = files.FileMeta(id=file_id, tenant=st.meta.tenant, bytes=size, lines=counted.lines,
                              created_at=int(self.clock()), filename=f"{st.meta.id}_{suffix}.jsonl",
                              purpose="batch_output", key=file_id)
        try:
            await files.put_meta(self.q.redis, self.q.keys, meta)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.files.delete(file_id))
            raise
        return meta


async def cancel_until_done(task: asyncio.Task[None], *, every_s: float = 0.05, tries: int = 100) -> None:
    """Cancel `task` until it ends (at most `tries` times). One cancel() can be lost: Python 3.11's `wait_for`,
    which redis-py wraps around every command it sends with a socket timeout, returns the command's result and
    drops a cancellation that arrives as the command completes; the task then runs on."""
    for _ in range(tries):
        if task.done():
            return
        task.cancel()
        await asyncio.wait([task], timeout=every_s)


def output_file_id(batch_id: str, suffix: str, attempt: int = 1) -> str:
    """The output or error file id of a batch's finalizing attempt: a valid file id (its batch's creation time, then
    a digest), the same every time it is computed."""
    raw = base64.b32decode(batch_id.removeprefix("batch_").upper() + "======")[:6]
    name = suffix if attempt == 1 else f"{suffix}.{attempt}"
    raw += hashlib.sha256(f"{batch_id}:{name}".encode()).digest()[:10]
    return "file-" + base64.b32encode(raw).decode("ascii").rstrip("=").lower()


# --- the deployable --------------------------------------------------------------------------------

async def _serve(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await BatchRunner(settings).run(stop)


def run(settings: Settings) -> None:
    """One batch runner until SIGTERM/SIGINT (several may run: each batch is held by one at a time)."""
    asyncio.run(_serve(settings))
