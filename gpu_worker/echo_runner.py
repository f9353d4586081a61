"""The echo model (`kind: echo` in the model file): the runner port with no model behind it, so a benchmark
measures batchgate itself (gateway, Redis, intake, scheduler, publisher, waiters) and not a forward.

Everything around it is the worker's usual path: intake, the scheduler's lanes and windows, mark-running,
the publisher. Only the compute is gone:
- tokens are bytes: a prompt's token ids are its UTF-8 bytes (`messages`: their contents joined by
  newlines, as the gateway counts them); `input_ids` are taken as they are (below `vocab_size` if set);
- the output's i-th token is the prompt's i-th, cycling (prompt "abc", `max_new_tokens: 5` -> "abcab");
  sampling parameters change nothing; the text is the UTF-8 decoding of the tokens below 256;
- a start gives each new row its first token and every `step` one more to each running row, after
  sleeping as a forward would take: `step_ms`, plus `step_ms_per_row` per row a step advances and
  `prefill_ms_per_token` per prompt token a start prefills (all 0: no sleep), so a benchmark can give the
  stack a model's cost curve without its compute; stop strings end a row as on a model; there is no EOS.
  Rows: the model's `max_running` per engine.
Pure Python: no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_worker.generation_result import generation_result, resumed_whole
from gpu_worker.job import Job
from gpu_worker.outcomes import Delta, Outcome, failed_outcome
from gpu_worker.runner import count_calls
from gpu_worker.sequences import EngineStats, GenResult, completes_stop
from gpu_worker.service_model import CostPrior
from gpu_worker.stream_release import Release, next_delta
from gpu_worker.token_logprobs import asked, certain, certain_prompt, with_logprobs
from shared.config import ModelSpec
from shared.faults import Faults
from shared.lanes import assign_lane
from shared.messages import InferenceRequest
from shared.params import GenerateParams
from shared.states import FinishReason, Priority


def encode_text(text: str) -> list[int]:
    """The echo model's tokens of a text: its UTF-8 bytes."""
    return list(text.encode("utf-8", "replace"))


def decode_tokens(ids: list[int]) -> str:
    """Text of echo tokens: the UTF-8 decoding of those below 256 (the others spell nothing)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")


def token_text(token_id: int) -> tuple[str, list[int] | None]:
    """An echo token's text alone, and its byte where the text cannot hold it (a byte of a multi-byte character:
    its text U+FFFD), as log probabilities name tokens (`gpu_worker.token_logprobs.TokenFn`)."""
    if 0 <= token_id < 0x80:
        return chr(token_id), None
    if token_id < 0x100:
        return "\ufffd", [token_id]
    return "", None


@dataclass(slots=True)
class _Row:
    job: Job
    prompt: tuple[int, ...]  # what is echoed
    offset: int  # output tokens an earlier attempt released (the row continues after them)
    new_tokens: int  # this attempt's budget
    admitted_at: float
    prefill_s: float
    first_token_at: float = 0.0
    tokens: list[int] = field(default_factory=list)

    def grow(self) -> None:
        self.tokens.append(self.prompt[(self.offset + len(self.tokens)) % len(self.prompt)])


class EchoRunner:
    def __init__(self, spec: ModelSpec, worker: str, *, max_rows: int, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, faults: Faults | None = None) -> None:
        self.spec = spec
        self.worker = worker
        self.max_rows = max_rows
        self.clock = clock
        self.sleep = sleep
        self.faults = faults or Faults()
        self.step_s = spec.step_ms / 1000
        self.row_s = spec.step_ms_per_row / 1000
        self.token_s = spec.prefill_ms_per_token / 1000
        self.rows: dict[str, _Row] = {}
        self.held: frozenset[str] = frozenset()
        self.stats = EngineStats()
        self.model_calls: dict[str, int] = {}

    chunking = False
    chunk_left = 0
    fused = False
    last_chunk = (0, 0.0)

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    @property
    def free_rows(self) -> int:
        return self.max_rows - len(self.rows)

    def running_ids(self) -> list[str]:
        return list(self.rows)

    def engine_stats(self) -> EngineStats:
        return self.stats

    def remaining_tokens(self) -> dict[str, int]:
        return {rid: row.new_tokens - len(row.tokens) for rid, row in self.rows.items()}

    def warm_up(self) -> CostPrior:
        """Nothing to warm; its costs are the configured ones."""
        return CostPrior(prefill_fixed_s=0.0, prefill_per_token_s=self.token_s, step_s=self.step_s,
                         step_per_row_s=self.row_s)

    def prepare(self, req: InferenceRequest, now: float) -> Job | Outcome:
        params = GenerateParams(**{**req.params, "stop": tuple(req.params.get("stop", ()))})
        vocab = self.spec.vocab_size
        if (outside := params.outside_vocabulary(vocab)) is not None:  # as a model's runner refuses it
            return failed_outcome(req, self.worker, now, "invalid_input",
                                  f"{outside[0]}: token ids must be below the vocabulary size {vocab}")
        if params.response_format is not None:  # its output is its prompt: nothing it could be held to
            return failed_outcome(req, self.worker, now, "invalid_input",
                                  f"response_format: model {self.spec.name} echoes its prompt; it cannot follow a "
                                  "format")
        if "input_ids" in req.input:
            ids = params.cut_prompt(list(req.input["input_ids"]), self.spec.max_input_tokens)  # cut, then read
            if vocab is not None and any(i >= vocab for i in ids):
                return failed_outcome(req, self.worker, now, "invalid_input",
                                      f"input_ids must be below the vocabulary size {vocab}")
        elif "messages" in req.input:
            ids = encode_text("\n".join(m["content"] for m in req.input["messages"]))
        else:
            ids = encode_text(req.input["prompt"])
        ids = params.cut_prompt(ids, self.spec.max_input_tokens)  # as a model's runner truncates it
        if not ids:
            return failed_outcome(req, self.worker, now, "invalid_input", "the prompt has no tokens")
        total = len(ids) + params.max_new_tokens
        if len(ids) > self.spec.max_input_tokens or total > self.spec.max_seq_len:
            return failed_outcome(req, self.worker, now, "input_too_long",
                                  f"prompt is {len(ids)} tokens; with max_new_tokens {total}, over this model's "
                                  f"{self.spec.max_input_tokens} prompt / {self.spec.max_seq_len} total")
        stream = Release.of(params, req.streamed, ids) if req.stream else None
        return Job(id=req.id, lane=assign_lane(total, self.spec.lanes).name, rank=Priority(req.priority).rank,
                   deadline=req.deadline_ms / 1000, arrived=now, tokens=total,
                   prompt_tokens=len(ids) + len(req.streamed), new_tokens=params.max_new_tokens, request=req,
                   params=params, inputs=(tuple(ids),), stream=stream)

    def start(self, batch: list[Job], now: float) -> list[Outcome]:
        count_calls(self.model_calls, batch)
        t0 = self.clock()
        out: list[Outcome] = []
        fresh: list[_Row] = []
        for job in batch:
            if job.stream is not None and job.stream.sent >= job.new_tokens:
                out.append(self.resumed_whole(job))
                continue
            try:
                self.faults.check_tokens(job.inputs[0])
            except Exception as exc:
                out.append(failed_outcome(job.req, self.worker, t0, "model_error",
                                          f"the model raised {type(exc).__name__}: {exc}", computed=True))
                continue
            prefix = job.stream.restart() if job.stream is not None else ()
            fresh.append(_Row(job, job.inputs[0], len(prefix), job.new_tokens - len(prefix), t0, 0.0))
        if fresh and (cost := self.step_s + self.token_s * sum(len(row.prompt) for row in fresh)):
            self.sleep(cost)  # the prefill's forward
        done = self.clock()
        for row in fresh:
            row.prefill_s, row.first_token_at = done - t0, done
            self.rows[row.job.id] = row
            self.stats.prefill_tokens += len(row.prompt)
        self.stats.prefill_s += done - t0
        return out + self._advance(fresh, done)

    def begin_chunked(self, job: Job, now: float) -> list[Outcome]:
        return self.start([job], now)  # no forward to cut into chunks: the whole prompt at once

    def step(self, chunk_tokens: int = 0) -> list[Outcome]:
        t0 = self.clock()
        rows = [row for rid, row in self.rows.items() if rid not in self.held]
        if cost := self.step_s + self.row_s * len(rows):
            self.sleep(cost)
        now = self.clock()
        self.stats.steps += 1
        self.stats.decode_tokens += len(rows)
        self.stats.decode_s += now - t0
        return self._advance(rows, now)

    def resumed_whole(self, job: Job, reason: FinishReason = FinishReason.LENGTH) -> Outcome:
        return resumed_whole(job, self.clock(), worker=self.worker, decode=decode_tokens, reason=reason)

    def remove(self, ids: set[str], reason: FinishReason) -> list[Outcome]:
        now = self.clock()
        return [self._leave(self.rows[rid], reason, now) for rid in list(ids) if rid in self.rows]

    def hold_back(self, ids: frozenset[str]) -> None:
        self.held = frozenset(ids)

    def take_deltas(self) -> list[Delta]:
        out = []
        for row in self.rows.values():
            job = row.job
            if job.stream is not None:
                delta = next_delta(job.stream, job.stream.output(row.tokens), decode_tokens)
                if delta is not None:
                    delta = with_logprobs(delta, job, certain(row.tokens, asked(job)), token_text)
                    out.append(Delta(job.req, delta, first=job.stream.first))
                    job.stream.first = False
        return out

    def _advance(self, rows: list[_Row], now: float) -> list[Outcome]:
        """Each of `rows` gets its next token; those that are done leave."""
        out = []
        for row in rows:
            row.grow()
            reason = self._finished(row)
            if reason is not None:
                out.append(self._leave(row, reason, now))
        return out

    def _finished(self, row: _Row) -> FinishReason | None:
        params = row.job.params if isinstance(row.job.params, GenerateParams) else GenerateParams()
        held = row.offset + len(row.tokens)  # as a model's rows: nothing ends it below min_tokens
        if row.tokens and row.tokens[-1] in params.stop_token_ids and held >= params.min_tokens:
            return FinishReason.STOP  # before stop strings
        if params.stop and held > params.min_tokens:  # one a token past them completes
            # a stop string of n characters spans at most 4n bytes; 3 more for a character cut at the front
            back = 4 * max(len(s) for s in params.stop) + 3
            tail = decode_tokens(row.tokens[-back:])
            if (completes_stop(tail, decode_tokens(row.tokens[-back:-1]), params.stop) if params.min_tokens
                    else any(s in tail for s in params.stop)):
                return FinishReason.STOP
        return FinishReason.LENGTH if len(row.tokens) >= row.new_tokens else None

    def _leave(self, row: _Row, reason: FinishReason, now: float) -> Outcome:
        del self.rows[row.job.id]
        r = GenResult(id=row.job.id, token_ids=list(row.tokens), finish_reason=reason,
                      prompt_tokens=len(row.prompt) + row.offset, prefill_s=row.prefill_s,
                      ttft_s=row.prefill_s, decode_s=max(0.0, now - row.first_token_at),
                      admitted_at=row.admitted_at, owner=row.job, logprobs=certain(row.tokens, asked(row.job)),
                      prompt_logprobs=certain_prompt(row.job))
        return Outcome(row.job.req, generation_result(row.job, r, now, worker=self.worker, decode=decode_tokens,
                                                        token=token_text))
