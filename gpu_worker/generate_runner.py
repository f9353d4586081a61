"""The generation runner: the continuous stage over `GenerationEngine`.

`prepare` tokenizes a request once into a `Job`; `start` prefills a batch of jobs into the running
batch; each `step()` decodes one token for every running row and returns the rows that finished, at
once; `remove` ends rows the scheduler gives up on. A failing prefill is retried in halves, so one
bad request fails alone. The engine's rows hold the jobs themselves (`GenSpec.owner`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, cast

import structlog

from gpu_worker.bad_words import MAX_BAD_WORD_TOKENS, bad_word_ids
from gpu_worker.constraints import Grammars
from gpu_worker.engine import GenerationEngine
from gpu_worker.generation_config import warn_unapplied
from gpu_worker.generation_result import generation_result, resumed_whole
from gpu_worker.job import Job
from gpu_worker.kv_cache import text_config
from gpu_worker.models import LoadedModel
from gpu_worker.outcomes import Delta, Outcome, failed_outcome
from gpu_worker.runner import count_calls
from gpu_worker.sequences import EngineStats, GenResult, GenSpec, SamplingParams
from gpu_worker.service_model import CostPrior
from gpu_worker.stream_release import Release, next_delta
from gpu_worker.token_logprobs import PROMPT_LOGITS_MAX, prompt_scorable, scored_prompt, with_logprobs
from gpu_worker.token_text import TokenText
from gpu_worker.tool_tokens import decode_keeping, special_ids
from gpu_worker.warm_up import timed_generations
from shared.faults import Faults
from shared.lanes import assign_lane
from shared.messages import InferenceRequest, RequestResult
from shared.model_context import CONTEXT_EXCEEDED, context_message, exact_context
from shared.params import GenerateParams, template_kwargs
from shared.states import FinishReason, Priority
from shared.tool_call_formats import kept_tokens

log = structlog.get_logger(__name__)


class GenerateRunner:
    def __init__(self, loaded: LoadedModel, worker: str, *, max_rows: int, max_seq_len: int,
                 clock: Callable[[], float] = time.time, faults: Faults | None = None, fused: bool = False) -> None:
        self.loaded = loaded
        self.faults = faults or Faults()
        self.spec = loaded.spec
        self.worker = worker
        self.clock = clock
        self.tokenizer = loaded.tokenizer
        self._token = TokenText(self.tokenizer)  # a token's text alone, for log probabilities
        # the special tokens a request offering tools keeps in its text: its calls are written with them
        self._tool_tokens = special_ids(self.tokenizer, kept_tokens(self.spec.tool_call_parser))
        self.vocab = (config := text_config(loaded.model)).vocab_size  # a multimodal checkpoint's: its text config's
        eos = loaded.model.generation_config.eos_token_id
        for cfg in (loaded.model.config, config):  # else the model's config, else its text config's (Gemma 3's)
            eos = getattr(cfg, "eos_token_id", None) if eos is None else eos
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.grammars = Grammars(self.tokenizer, self.vocab, sorted(self.eos_ids))  # structured output
        self.repetition_penalty = float(loaded.model.generation_config.repetition_penalty or 1.0)
        warn_unapplied(self.spec.name, loaded.model.generation_config)
        # the longest sequence the model computes exactly (its context, a RoPE switch); None: none declared
        self.context = model_context(loaded.model)
        self.engine = GenerationEngine(loaded.model, max_rows=max_rows, max_seq_len=max_seq_len,
                                       decode_tail=self._decode, clock=clock, fused=fused)
        self.model_calls: dict[str, int] = {}

    @property
    def busy(self) -> bool:
        return self.engine.running > 0

    @property
    def free_rows(self) -> int:
        return self.engine.free_rows

    def running_ids(self) -> list[str]:
        return self.engine.running_ids()

    def engine_stats(self) -> EngineStats:
        return self.engine.stats

    def remaining_tokens(self) -> dict[str, int]:
        return self.engine.remaining_tokens()

    def warm_up(self) -> CostPrior:
        """Short generations before serving, timed (`gpu_worker.warm_up`)."""
        self.grammars.warm()
        return timed_generations(self.engine, self.vocab, min(self.engine.max_seq_len, self.context or 1 << 30))

    def prepare(self, req: InferenceRequest, now: float) -> Job | Outcome:
        params = GenerateParams(**{**req.params, "stop": tuple(req.params.get("stop", ()))})
        if (outside := params.outside_vocabulary(self.vocab)) is not None:
            return failed_outcome(req, self.worker, now, "invalid_input",
                                  f"{outside[0]}: token ids must be below the vocabulary size {self.vocab}")
        ids = self._prompt_ids(req, params)
        if isinstance(ids, tuple):  # (code, message): refused
            return failed_outcome(req, self.worker, now, *ids)
        if len(ids) > self.spec.max_input_tokens:
            return failed_outcome(req, self.worker, now, "input_too_long",
                                  f"prompt is {len(ids)} tokens; this model takes at most "
                                  f"{self.spec.max_input_tokens}")
        if not ids:
            return failed_outcome(req, self.worker, now, "invalid_input", "the prompt has no tokens")
        if params.prompt_logprobs is not None and not prompt_scorable(len(ids), self.vocab):
            return failed_outcome(req, self.worker, now, "invalid_input",
                                  f"prompt_logprobs: a prompt of {len(ids)} tokens would hold {len(ids)} x "
                                  f"{self.vocab} logits at once; at most {PROMPT_LOGITS_MAX:,} (a shorter prompt, "
                                  "or no prompt_logprobs)")
        total = len(ids) + params.max_new_tokens
        # the model's limit, not this engine's: a request it reads may belong to another engine of the model
        if total > self.spec.max_seq_len:
            return failed_outcome(req, self.worker, now, "input_too_long",
                                  f"prompt + max_new_tokens = {total} exceeds {self.spec.max_seq_len} tokens")
        if self.context is not None and total > self.context:  # before it is computed: alone, not its batch
            return failed_outcome(req, self.worker, now, CONTEXT_EXCEEDED,
                                  context_message(self.context, len(ids), params.max_new_tokens))
        grammar = self.grammars.compile(params.response_format) if params.response_format is not None else None
        if isinstance(grammar, str):
            return failed_outcome(req, self.worker, now, "invalid_input", grammar)
        bad_words = bad_word_ids(params.bad_words, self._encode)
        if (n := sum(map(len, bad_words))) > MAX_BAD_WORD_TOKENS:  # each checked at every step
            return failed_outcome(req, self.worker, now, "invalid_input",
                                  f"bad_words: {n} tokens in all (as is and after a space); at most "
                                  f"{MAX_BAD_WORD_TOKENS}")
        # a streaming request run again (a crash, a hand-back) continues after what its caller was sent
        stream = Release.of(params, req.streamed, ids) if req.stream else None
        return Job(id=req.id, lane=assign_lane(total, self.spec.lanes).name, rank=Priority(req.priority).rank,
                   deadline=req.deadline_ms / 1000, arrived=now, tokens=total,
                   prompt_tokens=len(ids) + len(req.streamed), new_tokens=params.max_new_tokens, request=req,
                   params=params, inputs=(tuple(ids),), stream=stream, grammar=grammar, bad_words=bad_words)

    def _prompt_ids(self, req: InferenceRequest, params: GenerateParams) -> list[int] | tuple[str, str]:
        """The prompt's token ids as the model reads them (`truncate_prompt_tokens` cut), or (code, message) where
        they cannot be had."""
        if "input_ids" in req.input:
            ids = params.cut_prompt(list(req.input["input_ids"]), self.spec.max_input_tokens,  # cut, then read
                                    self.context)
            if any(i >= self.vocab for i in ids):
                return "invalid_input", f"input_ids must be below the vocabulary size {self.vocab}"
            return ids
        if "messages" in req.input:
            own = req.input.get("chat_template")
            if own is not None and not self.spec.trust_request_chat_template:  # a producer past the gateway's check
                return "invalid_input", f"model {self.spec.name} does not take a request's chat template"
            if own is None and not getattr(self.tokenizer, "chat_template", None):
                return "no_chat_template", (f"model {self.spec.name} has no chat template: send a prompt instead, "
                                            "or give the model one (its model file's chat_template)")
            ids = list(self.tokenizer.apply_chat_template(
                req.input["messages"], tools=req.input.get("tools"), documents=req.input.get("documents"),
                chat_template=own,
                **template_kwargs(req.input.get("chat_template_kwargs", {})), return_dict=False,
                add_generation_prompt=req.input.get("add_generation_prompt", True),
                continue_final_message=req.input.get("continue_final_message", False)))
        else:
            ids = self.tokenizer(req.input["prompt"], add_special_tokens=True)["input_ids"]
        return params.cut_prompt(ids, self.spec.max_input_tokens, self.context)  # truncate_prompt_tokens: its last

    def _spec(self, job: Job) -> GenSpec:
        params = cast(GenerateParams, job.params)  # prepare builds a generation job's params so
        prefix = job.stream.restart() if job.stream is not None else ()
        job.constraint = None if job.grammar is None else Grammars.start(job.grammar, prefix)
        return GenSpec(id=job.id, prompt_ids=job.inputs[0] + prefix, max_new_tokens=job.new_tokens - len(prefix),
                       sampling=SamplingParams(
                           params.temperature, params.top_p, params.top_k, params.seed,
                           self.repetition_penalty if params.repetition_penalty is None else params.repetition_penalty,
                           params.presence_penalty, params.frequency_penalty, tuple(params.logit_bias.items()),
                           params.logprobs, scored_prompt(params, len(prefix), len(job.inputs[0] + prefix),
                                                          self.vocab), params.min_p,
                           max(0, params.min_tokens - len(prefix)),  # of the row's own tokens
                           params.allowed_token_ids, job.bad_words),
                       stop=tuple(params.stop), eos_ids=frozenset() if params.ignore_eos else self.eos_ids,
                       stop_ids=frozenset(params.stop_token_ids), ends=self.eos_ids | set(params.stop_token_ids),
                       decode=None if (decode := self._decoder(job)) == self._decode else decode,
                       owner=job, resumed=len(prefix), constraint=job.constraint)

    def start(self, batch: list[Job], now: float) -> list[Outcome]:
        count_calls(self.model_calls, batch)
        done = [job for job in batch if job.stream is not None and job.stream.sent >= job.new_tokens]
        if done:  # a streaming request run again after its caller was sent every token: only the result is left
            batch = [job for job in batch if job not in done]
            return [self.resumed_whole(job) for job in done] + (self.start(batch, now) if batch else [])
        try:
            for job in batch:
                self.faults.check_tokens(job.inputs[0])
            return self._outcomes(self.engine.prefill([self._spec(job) for job in batch]))
        except Exception as exc:
            self.engine.remove([job.id for job in batch], FinishReason.ERROR)  # rows that did join leave again
            if len(batch) == 1:
                log.warning("prefill failed", request_id=batch[0].id, error=repr(exc))
                return [failed_outcome(batch[0].req, self.worker, self.clock(), "model_error",
                                       f"the model raised {type(exc).__name__}: {exc}", computed=True)]
            mid = len(batch) // 2
            return self.start(batch[:mid], now) + self.start(batch[mid:], now)

    def begin_chunked(self, job: Job, now: float) -> list[Outcome]:
        count_calls(self.model_calls, [job])
        try:
            self.faults.check_tokens(job.inputs[0])
            self.engine.prefill_in_chunks(self._spec(job))
        except Exception as exc:
            log.warning("chunked prefill refused", request_id=job.id, error=repr(exc))
            return [failed_outcome(job.req, self.worker, self.clock(), "model_error",
                                   f"the model raised {type(exc).__name__}: {exc}", computed=True)]
        return []

    @property
    def chunking(self) -> bool:
        return self.engine.chunked.active

    @property
    def chunk_left(self) -> int:
        return self.engine.chunked.remaining

    @property
    def fused(self) -> bool:
        return self.engine.fused

    @property
    def last_chunk(self) -> tuple[int, float]:
        return self.engine.chunked.last

    def step(self, chunk_tokens: int = 0) -> list[Outcome]:
        return self._outcomes(self.engine.step(chunk_tokens))

    def remove(self, ids: set[str], reason: FinishReason) -> list[Outcome]:
        return self._outcomes(self.engine.remove(ids, reason))

    def hold_back(self, ids: frozenset[str]) -> None:
        self.engine.hold_back(ids)

    def take_deltas(self) -> list[Delta]:
        """What each streaming row may send its caller since the last call (`gpu_worker.stream_release`)."""
        out = []
        for row in self.engine.rows:
            job = row.spec.owner
            if isinstance(job, Job) and job.stream is not None:
                delta = next_delta(job.stream, job.stream.output(row.tokens), self._decoder(job))
                if delta is not None:
                    delta = with_logprobs(delta, job, row.logprobs, self._token)
                    out.append(Delta(job.req, delta, first=job.stream.first))
                    job.stream.first = False
        return out

    def resumed_whole(self, job: Job, reason: FinishReason = FinishReason.LENGTH) -> Outcome:
        return resumed_whole(job, self.clock(), worker=self.worker, decode=self._decoder(job), reason=reason)

    def _outcomes(self, results: list[GenResult]) -> list[Outcome]:
        now = self.clock()
        return [self._outcome(r.owner, r, now) for r in results if isinstance(r.owner, Job)]

    def _outcome(self, job: Job, r: GenResult, now: float) -> Outcome:
        if r.finish_reason is FinishReason.ERROR and job.constraint is not None and job.constraint.failed:
            return failed_outcome(job.req, self.worker, now, "invalid_input", "response_format: the output could "
                                  f"not be held to the format: {job.constraint.failed}", computed=True)
        return Outcome(job.req, self._result(job, r, now))

    def _decode(self, ids: list[int]) -> str:
        """Token ids to text, as callers see it (the engine's stop-string check reads the same)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        """Text to token ids as output spells it (no special tokens added): a bad word's."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decoder(self, job: Job) -> Callable[[list[int]], str]:
        """How `job`'s output reads: with every special token where it asks (`skip_special_tokens` false), else with
        its model's tool-call tokens where it offers tools (`tool_tokens`)."""
        if not cast(GenerateParams, job.params).skip_special_tokens:
            return functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        if self._tool_tokens and job.req.input.get("tools"):
            return functools.partial(decode_keeping, self.tokenizer, kept=self._tool_tokens)
        return self._decode

    def _result(self, job: Job, r: GenResult, now: float) -> RequestResult:
        return generation_result(job, r, now, worker=self.worker, decode=self._decoder(job), token=self._token)


def model_context(model: Any) -> int | None:
    """The longest sequence (prompt and output) `model` computes exactly as `generate` does
    (`shared.model_context`)."""
    return exact_context(text_config(model).to_dict())
