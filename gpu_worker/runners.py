"""Model runners: turn scheduled requests into model calls and results (the torch edge of the worker).

- `EmbedRunner`: the dynamic stage alone; one padded encoder forward per batch, mean pooling.
- `GenerateRunner`: the continuous stage; prefill joins the running batch of `GenerationEngine`,
  each `step()` decodes one token for every running row, finished rows are returned at once.
A failing batch is retried one request at a time, so one bad request fails alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog
import torch

from gpu_worker.engine import EngineStats, GenerationEngine, GenResult, GenSpec
from gpu_worker.models import LoadedModel
from gpu_worker.outcomes import Outcome, failed_outcome, result_for
from gpu_worker.sampling import SamplingParams
from gpu_worker.scheduler import Pending
from gpu_worker.stop_strings import cut_at_stop
from shared.config import ModelSpec
from shared.errors import ConfigError
from shared.faults import Faults
from shared.lanes import LaneSpec, assign_lane
from shared.messages import ErrorInfo, InferenceRequest, RequestResult
from shared.params import EmbedParams, GenerateParams
from shared.states import FinishReason, Priority, Status

log = structlog.get_logger(__name__)


class Runner(Protocol):
    @property
    def busy(self) -> bool: ...

    @property
    def free_rows(self) -> int: ...

    def prepare(self, req: InferenceRequest, now: float) -> Pending | Outcome: ...

    def start(self, batch: list[Pending], now: float) -> list[Outcome]: ...

    def step(self) -> list[Outcome]: ...

    def cancel(self, ids: set[str]) -> list[Outcome]: ...

    def expire(self, now: float) -> list[Outcome]: ...

    def running_ids(self) -> list[str]: ...

    def engine_stats(self) -> EngineStats | None: ...

    def warm_up(self) -> None: ...

    def remaining_tokens(self) -> dict[str, int]: ...

    def expire_ids(self, ids: set[str]) -> list[Outcome]: ...


MODEL_CALLS_KEPT = 10_000


def count_calls(calls: dict[str, int], batch: list[Pending]) -> None:
    """How often each request reached the model (tests and debugging); only the latest ids are kept."""
    for p in batch:
        calls[p.id] = calls.pop(p.id, 0) + 1
    while len(calls) > MODEL_CALLS_KEPT:
        del calls[next(iter(calls))]


class EmbedRunner:
    def __init__(self, loaded: LoadedModel, worker: str, clock: Callable[[], float] = time.time,
                 faults: Faults | None = None) -> None:
        self.loaded = loaded
        self.faults = faults or Faults()
        self.spec = loaded.spec
        self.worker = worker
        self.clock = clock
        self.max_len = min(self.spec.max_input_tokens,
                           getattr(loaded.model.config, "max_position_embeddings", 512))
        self.model_calls: dict[str, int] = {}

    busy = False

    @property
    def free_rows(self) -> int:
        return self.spec.max_batch_size

    def running_ids(self) -> list[str]:
        return []

    def engine_stats(self) -> EngineStats | None:
        return None

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One forward before serving: first-call imports and allocations happen now, not on a request."""
        enc = self.loaded.tokenizer(["warm up"], return_tensors="pt")
        self.loaded.model(**{k: v.to(self.loaded.device) for k, v in enc.items()})

    def remaining_tokens(self) -> dict[str, int]:
        return {}

    def expire_ids(self, ids: set[str]) -> list[Outcome]:
        return []

    def prepare(self, req: InferenceRequest, now: float) -> Pending | Outcome:
        texts = req.input["texts"]
        enc = self.loaded.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=self.max_len)
        lens = [len(ids) for ids in enc["input_ids"]]
        tokens = sum(lens)
        lane = assign_lane(tokens, self.spec.lanes).name
        return Pending(id=req.id, lane=lane, rank=Priority(req.priority).rank, deadline=req.deadline_ms / 1000,
                       arrived=now, tokens=tokens, prompt_tokens=max(lens), size=len(texts),
                       payload=(req, enc["input_ids"]))

    def start(self, batch: list[Pending], now: float) -> list[Outcome]:
        try:
            return self._run(batch, now)
        except Exception as exc:
            if len(batch) == 1:
                req = batch[0].payload[0]
                log.warning("embed failed", request_id=req.id, error=repr(exc))
                return [failed_outcome(req, self.worker, self.clock(), "model_error",
                                       f"the model raised {type(exc).__name__}: {exc}", computed=True)]
            mid = len(batch) // 2
            return self.start(batch[:mid], now) + self.start(batch[mid:], now)

    @torch.inference_mode()
    def _run(self, batch: list[Pending], now: float) -> list[Outcome]:
        seqs = [ids for p in batch for ids in p.payload[1]]
        count_calls(self.model_calls, batch)
        for s in seqs:
            self.faults.check_tokens(s)
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        ids, mask = ids.to(self.loaded.device), mask.to(self.loaded.device)
        t0 = self.clock()
        hidden = self.loaded.model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
        normed = torch.nn.functional.normalize(pooled, p=2, dim=1)
        done = self.clock()
        outcomes: list[Outcome] = []
        row = 0
        for p in batch:
            req, enc = p.payload
            n = len(enc)
            params = EmbedParams(**req.params)
            vecs = (normed if params.normalize else pooled)[row: row + n].float().cpu().tolist()
            row += n
            output = {"embeddings": vecs, "dim": len(vecs[0]), "tokens": [len(e) for e in enc]}
            timings = {"compute_ms": round((done - t0) * 1000, 3), "batch_texts": float(len(seqs))}
            outcomes.append(Outcome(req, result_for(req, Status.SUCCEEDED, worker=self.worker, now=done,
                                                    output=output, reason=FinishReason.DONE,
                                                    timings=timings, started=t0)))
        return outcomes

    def step(self) -> list[Outcome]:
        return []

    def cancel(self, ids: set[str]) -> list[Outcome]:
        return []

    def expire(self, now: float) -> list[Outcome]:
        return []


def kv_budget_bytes(spec_budget_tokens: int | None, bytes_per_token: int, device: Any) -> int:
    """The KV cache memory this worker may use: from config, else sized from the device."""
    if spec_budget_tokens is not None:
        return spec_budget_tokens * bytes_per_token
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.7)  # the rest: activations, logits, allocator slack
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = 8 << 30
    return min(int(available * 0.25), 8 << 30)


def engine_rows(max_running: int, budget_bytes: int, bytes_per_row: int) -> int:
    """Rows of the running batch that fit the budget (each row may use the cache's full width)."""
    return max(0, min(max_running, budget_bytes // max(1, bytes_per_row)))


def engine_seq_len(spec: ModelSpec, lanes: Sequence[LaneSpec]) -> int:
    """Longest sequence an engine serving `lanes` can be given: the model's limit, or less when its lanes
    are all bounded (a request is filed under a lane by prompt + max_new_tokens, so the bound holds)."""
    bounds = [lane.max_tokens for lane in lanes]
    if None in bounds:
        return spec.max_seq_len
    return min(spec.max_seq_len, max(b for b in bounds if b is not None))


def size_engines(loaded: LoadedModel, seq_lens: Sequence[int]) -> list[int]:
    """Rows for each of a model's engines (one per engine group), so load can never exhaust memory: the
    model's KV budget is split evenly between its engines, each row sized for its engine's longest sequence."""
    spec = loaded.spec
    per_token = GenerationEngine.bytes_per_row(loaded.model, spec.max_seq_len) // (2 * spec.max_seq_len)
    budget = kv_budget_bytes(spec.kv_budget_tokens, per_token, loaded.device) // max(1, len(seq_lens))
    sizes = []
    for seq_len in seq_lens:
        per_row = GenerationEngine.bytes_per_row(loaded.model, seq_len)
        rows = engine_rows(spec.max_running, budget, per_row)
        if rows < 1:
            raise ConfigError(f"model {spec.name}: a KV budget of {budget} bytes per engine holds no sequence of "
                              f"{seq_len} tokens ({per_row} bytes); raise kv_budget_tokens or lower the limits")
        log.info("engine sized", model=spec.name, rows=rows, max_seq_len=seq_len,
                 kv_cache_mib=round(rows * per_row / 2**20, 1), budget_mib=round(budget / 2**20, 1))
        sizes.append(rows)
    return sizes


# CFS weights: nice 0 is 1024, +2 is 655: the background engine yields to the foreground one without
# being starved by every other runnable thread on the machine (at +5, 335, it was, in the e2e benchmark)
BACKGROUND_NICE = 2


def bind_compute_thread(device: Any, *, background: bool) -> str:
    """Called on a compute loop's own thread before it runs. Several engines of one model compete for one
    device: the engine of the shortest lanes runs at normal priority, the others in the background. On
    CUDA each engine gets a stream of its own (the foreground one at high priority), so their kernels
    overlap and the short lane's are scheduled first; on CPU the background threads are niced.
    Returns what was done, for the log."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)  # the caches were zero-filled on the default stream
            lo, hi = torch.cuda.Stream.priority_range()  # (lowest priority, highest priority)
            stream = torch.cuda.Stream(device=device, priority=lo if background else hi)
            torch.cuda.set_stream(stream)
            return f"cuda stream priority {lo if background else hi}"
        except (RuntimeError, AttributeError) as exc:  # an old driver or build: the default stream still works
            log.warning("no stream of its own for this engine", error=repr(exc))
            return "default cuda stream"
    if background:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except (OSError, AttributeError) as exc:  # not Linux, or not permitted
            log.warning("could not lower the priority of a background engine", error=repr(exc))
            return "normal priority"
        return f"nice +{BACKGROUND_NICE}"
    return "normal priority"


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads_per_engine(engines: int, configured: int = 0, cores: int | None = None) -> int:
    """torch threads for each of `engines` compute threads that all have work, sharing this process's CPUs."""
    if configured > 0:
        return configured
    return max(1, (cores or cpu_cores()) // max(1, engines))


def model_size(model: Any) -> int:
    """Parameters of a torch model (0 for anything else): the largest model's engine owns the CPU pool."""
    try:
        return sum(p.numel() for p in model.parameters())
    except (AttributeError, TypeError):
        return 0


def single_threaded(fn: Callable[..., Any], *args: Any) -> Any:
    """Run torch work on a helper thread (model loading, warm-up) without giving that thread an OpenMP
    pool: see `CpuShare` for why a second pool slows every engine."""
    torch.set_num_threads(1)
    return fn(*args)


class CpuShare:
    """The process's cores among its CPU compute threads (an engine's own thread, or one that several
    engines of a model share: `gpu_worker.turns`), named by the caller, the owner first.

    torch's thread count is per calling thread, and GNU OpenMP keeps a pool of worker threads for
    every thread that ever ran a parallel region on more than one, for that thread's whole life.
    Once the pools hold more threads than there are cores, libgomp stops spinning between parallel
    regions and every region waits for its workers to be woken: on this repo's 2-core VM, a 1-row
    decode step on a helper thread took 13.9 ms on two threads beside a second pool, 10.2 ms on one
    thread, and 6.1 ms on two threads with no other pool (`scripts/step_costs.py --threads-check`,
    `docs/bench/threads_check.json`; `tests/unit/test_engines.py` checks the rule). So the pools must
    never outnumber the cores:

    - one compute thread, the *owner* (the worker names the largest model's first), may grow a pool;
    - every other one gets a fixed count, `cores // threads`;
    - the owner gets what those leave. If they run on one thread each (no pool of theirs ever
      exists), that is every core while they are idle and one core fewer per thread with work;
      otherwise it is the cores their pools leave, always.

    `configured` (`BATCHGATE_TORCH_THREADS`) fixes every thread's count instead."""

    def __init__(self, engines: list[str], configured: int = 0, cores: int | None = None) -> None:
        self.cores = cores or cpu_cores()
        self.owner = engines[0] if engines else ""
        self.fixed = configured if configured > 0 else None
        others = len(engines) - 1
        self.other = cpu_threads_per_engine(len(engines), 0, self.cores)
        self.owner_max = self.cores if self.other == 1 else max(1, self.cores - others * self.other)
        self._busy: dict[str, bool] = {}
        self._set: dict[str, int] = {}

    def threads(self, engine: str) -> int:
        """What `engine` should run on now (pure: reads the others' last reported state)."""
        if self.fixed is not None:
            return self.fixed
        if engine != self.owner:
            return self.other
        if self.other > 1:
            return self.owner_max
        busy = sum(1 for name, b in self._busy.items() if b and name != engine)
        return max(1, self.owner_max - busy)

    def report(self, engine: str, busy: bool) -> None:
        """From `engine`'s own thread, each iteration: whether it has work; sets its threads when it does."""
        self._busy[engine] = busy
        if not busy:
            return
        want = self.threads(engine)
        if self._set.get(engine) != want:
            torch.set_num_threads(want)
            self._set[engine] = want


class GenerateRunner:
    def __init__(self, loaded: LoadedModel, worker: str, *, max_rows: int, max_seq_len: int,
                 clock: Callable[[], float] = time.time, faults: Faults | None = None) -> None:
        self.loaded = loaded
        self.faults = faults or Faults()
        self.spec = loaded.spec
        self.worker = worker
        self.clock = clock
        self.tokenizer = loaded.tokenizer
        self.vocab = loaded.model.config.vocab_size
        eos = loaded.model.generation_config.eos_token_id
        if eos is None:
            eos = loaded.model.config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.engine = GenerationEngine(loaded.model, max_rows=max_rows, max_seq_len=max_seq_len,
                                       decode_tail=self._decode, clock=clock)
        self._requests: dict[str, InferenceRequest] = {}
        self.model_calls: dict[str, int] = {}

    @property
    def busy(self) -> bool:
        return self.engine.running > 0

    @property
    def free_rows(self) -> int:
        return self.engine.free_rows

    def running_ids(self) -> list[str]:
        return self.engine.running_ids()

    def engine_stats(self) -> EngineStats | None:
        return self.engine.stats

    def warm_up(self) -> None:
        """A short generation before serving: first-call imports and kernels happen now, not on a request."""
        self.engine.prefill([GenSpec(id="warm-up", prompt_ids=(1, 2, 3, 4), max_new_tokens=3)])
        while self.engine.running:
            self.engine.step()
        self.engine.stats = EngineStats()

    def remaining_tokens(self) -> dict[str, int]:
        return self.engine.remaining_tokens()

    def expire_ids(self, ids: set[str]) -> list[Outcome]:
        return self._outcomes(self.engine.expire_ids(ids))

    def prepare(self, req: InferenceRequest, now: float) -> Pending | Outcome:
        params = GenerateParams(**{**req.params, "stop": tuple(req.params.get("stop", ()))})
        if "input_ids" in req.input:
            ids = list(req.input["input_ids"])
            if any(i >= self.vocab for i in ids):
                return failed_outcome(req, self.worker, now, "invalid_input",
                                      f"input_ids must be below the vocabulary size {self.vocab}")
        else:
            ids = self.tokenizer(req.input["prompt"], add_special_tokens=True)["input_ids"]
        if len(ids) > self.spec.max_input_tokens:
            return failed_outcome(req, self.worker, now, "input_too_long",
                                  f"prompt is {len(ids)} tokens; this model takes at most "
                                  f"{self.spec.max_input_tokens}")
        spec = GenSpec(
            id=req.id, prompt_ids=tuple(ids), max_new_tokens=params.max_new_tokens,
            sampling=SamplingParams(params.temperature, params.top_p, params.top_k, params.seed),
            stop=params.stop, eos_ids=frozenset() if params.ignore_eos else self.eos_ids,
            deadline=req.deadline_ms / 1000 if self.spec.deadline_aware else None,
        )
        if not ids:
            return failed_outcome(req, self.worker, now, "invalid_input", "the prompt has no tokens")
        # the model's limit, not this engine's: a request it reads may belong to another engine of the model
        if spec.total_tokens > self.spec.max_seq_len:
            return failed_outcome(req, self.worker, now, "input_too_long",
                                  f"prompt + max_new_tokens = {spec.total_tokens} exceeds "
                                  f"{self.spec.max_seq_len} tokens")
        lane = assign_lane(spec.total_tokens, self.spec.lanes).name
        return Pending(id=req.id, lane=lane, rank=Priority(req.priority).rank, deadline=req.deadline_ms / 1000,
                       arrived=now, tokens=spec.total_tokens, prompt_tokens=len(ids),
                       new_tokens=params.max_new_tokens, payload=(req, spec))

    def start(self, batch: list[Pending], now: float) -> list[Outcome]:
        for p in batch:
            self._requests[p.id] = p.payload[0]
        count_calls(self.model_calls, batch)
        try:
            for p in batch:
                self.faults.check_tokens(p.payload[1].prompt_ids)
            return self._outcomes(self.engine.prefill([p.payload[1] for p in batch]))
        except Exception as exc:
            self.engine.cancel([p.id for p in batch])  # rows that did join leave again
            if len(batch) == 1:
                req = self._requests.pop(batch[0].id)
                log.warning("prefill failed", request_id=req.id, error=repr(exc))
                return [failed_outcome(req, self.worker, self.clock(), "model_error",
                                       f"the model raised {type(exc).__name__}: {exc}", computed=True)]
            mid = len(batch) // 2
            return self.start(batch[:mid], now) + self.start(batch[mid:], now)

    def step(self) -> list[Outcome]:
        return self._outcomes(self.engine.step())

    def cancel(self, ids: set[str]) -> list[Outcome]:
        return self._outcomes(self.engine.cancel(ids))

    def expire(self, now: float) -> list[Outcome]:
        return self._outcomes(self.engine.expire(now))

    def _outcomes(self, results: list[GenResult]) -> list[Outcome]:
        now = self.clock()
        out = []
        for r in results:
            req = self._requests.pop(r.id, None)
            if req is not None:
                out.append(Outcome(req, self._result(req, r, now)))
        return out

    def _decode(self, ids: list[int]) -> str:
        """Token ids to text, as callers see it (the engine's stop-string check reads the same)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _result(self, req: InferenceRequest, r: GenResult, now: float) -> RequestResult:
        token_ids = r.token_ids
        if r.finish_reason is FinishReason.STOP:  # text and tokens both end before the stop string
            text, token_ids = cut_at_stop(token_ids, req.params.get("stop") or (), self._decode)
        else:
            text = self._decode(token_ids)
        output = {"text": text, "token_ids": token_ids, "prompt_tokens": r.prompt_tokens,
                  "completion_tokens": len(token_ids)}
        timings = {"ttft_ms": round(r.ttft_s * 1000, 3), "decode_ms": round(r.decode_s * 1000, 3),
                   "prefill_ms": round(r.prefill_s * 1000, 3),
                   "compute_ms": round((now - r.admitted_at) * 1000, 3)}
        status = {FinishReason.DEADLINE: Status.EXPIRED, FinishReason.CANCELLED: Status.CANCELLED}.get(
            r.finish_reason, Status.SUCCEEDED)
        error = None
        if status is Status.EXPIRED:
            left = req.params.get("max_new_tokens", 0) - len(r.token_ids)
            why = ("deadline reached" if now * 1000 >= req.deadline_ms
                   else f"cannot finish the other {left} tokens by the deadline")
            error = ErrorInfo("deadline_exceeded", f"{why} after {len(r.token_ids)} tokens; partial output kept")
        elif status is Status.CANCELLED:
            error = ErrorInfo("cancelled", "cancelled while running")
        return result_for(req, status, worker=self.worker, now=now, output=output, error=error,
                          reason=r.finish_reason, timings=timings, started=r.admitted_at)
