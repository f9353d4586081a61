"""The encoder runner: the dynamic stage alone, one padded encoder forward per batch, the model's own pooling
(`gpu_worker.pooling`).

A failing batch is retried in halves, so one bad request fails alone. A text longer than the model
takes (`max_input_tokens`, at most its position embeddings) fails its request (`input_too_long`),
unless the request asked for `params.truncate`: then it is cut, and the output says so (`truncated`,
one flag per text). The gateway refuses such texts at submit where it can count their tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
import torch

from gpu_worker.job import Job
from gpu_worker.models import LoadedModel
from gpu_worker.outcomes import Delta, Outcome, failed_outcome, result_for
from gpu_worker.pooling import pool, pooling_modes
from gpu_worker.runner import count_calls
from gpu_worker.service_model import CostPrior
from shared.faults import Faults
from shared.lanes import assign_lane
from shared.params import TRUNCATE_HINT, EmbedParams
from shared.states import FinishReason, Priority, Status
from shared.token_limits import encoder_text_tokens, sentence_config

log = structlog.get_logger(__name__)

WARM_TEXT_TOKENS = (8, 128)  # the warm-up's timed texts: a line through two sizes


class EmbedRunner:
    def __init__(self, loaded: LoadedModel, worker: str, clock: Callable[[], float] = time.time,
                 faults: Faults | None = None) -> None:
        self.loaded = loaded
        self.faults = faults or Faults()
        self.spec = loaded.spec
        self.worker = worker
        self.clock = clock
        sentence = sentence_config(loaded.path)  # the model's own sentence-transformers settings
        self.max_len = encoder_text_tokens(self.spec.max_input_tokens, loaded.model.config.to_dict(), sentence)
        self.lower_case = sentence.get("do_lower_case") is True  # its pipeline lower-cases every text first
        self.model_calls: dict[str, int] = {}
        self.pooling = pooling_modes(loaded.path, self.spec.name)  # the model's own (sentence-transformers), or mean

    busy = False
    chunking = False
    chunk_left = 0
    fused = False
    last_chunk = (0, 0.0)

    @property
    def free_rows(self) -> int:
        return self.spec.max_batch_size

    def running_ids(self) -> list[str]:
        return []

    def engine_stats(self) -> None:
        return None

    def remaining_tokens(self) -> dict[str, int]:
        return {}

    def resumed_whole(self, job: Job, reason: FinishReason = FinishReason.LENGTH) -> Outcome:
        raise ValueError(f"job {job.id} is not a streaming request: an encoder streams nothing")

    def remove(self, ids: set[str], reason: FinishReason) -> list[Outcome]:
        return []  # nothing runs between calls

    def step(self, chunk_tokens: int = 0) -> list[Outcome]:
        return []

    def begin_chunked(self, job: Job, now: float) -> list[Outcome]:
        return self.start([job], now)

    def hold_back(self, ids: frozenset[str]) -> None:
        pass  # no rows between calls

    @torch.inference_mode()
    def take_deltas(self) -> list[Delta]:
        return []

    @torch.inference_mode()
    def warm_up(self) -> CostPrior:
        """Forwards before serving: first-call imports and allocations happen on the first, not on a request; the next
        two, a short and a longer text, are timed for the costs that stand in until requests are measured."""
        self._warm_forward(min(WARM_TEXT_TOKENS[0], self.max_len))
        short = self._warm_forward(min(WARM_TEXT_TOKENS[0], self.max_len))
        return CostPrior.through(short, self._warm_forward(min(WARM_TEXT_TOKENS[1], self.max_len)))

    def _warm_forward(self, tokens: int) -> tuple[int, float]:
        """(tokens, seconds) of a forward of one text of about `tokens` tokens."""
        enc = self.loaded.tokenizer(["warm up " * tokens], truncation=True, max_length=tokens, return_tensors="pt")
        t0 = time.perf_counter()
        self.loaded.model(**{k: v.to(self.loaded.device) for k, v in enc.items()})
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)
        return int(enc["input_ids"].shape[1]), time.perf_counter() - t0

    def _texts(self, req) -> list[str]:  # type: ignore[no-untyped-def]
        return [t.lower() for t in req.input["texts"]] if self.lower_case else req.input["texts"]

    def prepare(self, req, now: float) -> Job | Outcome:  # type: ignore[no-untyped-def]
        texts = self._texts(req)
        params = EmbedParams(**req.params)
        cap = params.text_tokens(self.max_len)  # truncate_prompt_tokens: each text's first tokens
        # counted whole (verbose off: transformers would warn of a text longer than the model takes, which is
        # answered here, refused or cut)
        enc = self.loaded.tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)
        over = [(i, len(ids)) for i, ids in enumerate(enc["input_ids"]) if len(ids) > cap]
        if over and not params.cuts():
            i, n = over[0]
            return failed_outcome(req, self.worker, now, "input_too_long",
                                  f"text {i} is {n} tokens; this model takes at most {self.max_len} per text "
                                  f"{TRUNCATE_HINT}")
        if over:
            enc = self.loaded.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=cap)
        inputs = tuple(tuple(ids) for ids in enc["input_ids"])
        lens = [len(ids) for ids in inputs]
        tokens = sum(lens)
        return Job(id=req.id, lane=assign_lane(tokens, self.spec.lanes).name, rank=Priority(req.priority).rank,
                   deadline=req.deadline_ms / 1000, arrived=now, tokens=tokens, prompt_tokens=max(lens),
                   size=len(texts), request=req, params=params, inputs=inputs)

    def _truncated(self, job: Job) -> list[bool]:
        """Which texts of a request that cuts them were cut: those at the cap whose whole text is longer."""
        texts = self._texts(job.req)
        cap = job.params.text_tokens(self.max_len) if isinstance(job.params, EmbedParams) else self.max_len
        return [len(ids) >= cap
                and len(self.loaded.tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"])
                > cap for ids, text in zip(job.inputs, texts, strict=True)]

    def start(self, batch: list[Job], now: float) -> list[Outcome]:
        try:
            return self._run(batch)
        except Exception as exc:
            if len(batch) == 1:
                log.warning("embed failed", request_id=batch[0].id, error=repr(exc))
                return [failed_outcome(batch[0].req, self.worker, self.clock(), "model_error",
                                       f"the model raised {type(exc).__name__}: {exc}", computed=True)]
            mid = len(batch) // 2
            return self.start(batch[:mid], now) + self.start(batch[mid:], now)

    @torch.inference_mode()
    def _run(self, batch: list[Job]) -> list[Outcome]:
        seqs = [ids for job in batch for ids in job.inputs]
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
        pooled = pool(hidden, mask, self.pooling)
        normed = torch.nn.functional.normalize(pooled, p=2, dim=1)
        done = self.clock()
        outcomes: list[Outcome] = []
        row = 0
        timings = {"compute_ms": round((done - t0) * 1000, 3), "batch_texts": float(len(seqs))}
        for job in batch:
            n = len(job.inputs)
            normalize = job.params.normalize if isinstance(job.params, EmbedParams) else True
            vecs = (normed if normalize else pooled)[row: row + n].float().cpu().tolist()
            row += n
            output = {"embeddings": vecs, "dim": len(vecs[0]), "tokens": [len(e) for e in job.inputs]}
            if isinstance(job.params, EmbedParams) and job.params.cuts():
                output["truncated"] = self._truncated(job)
            outcomes.append(Outcome(job.req, result_for(job.req, Status.SUCCEEDED, worker=self.worker, now=done,
                                                        output=output, reason=FinishReason.DONE,
                                                        timings=dict(timings), started=t0)))
        return outcomes
