"""A generation's terminal result, as callers see it, from what a runner's rows produced (`GenResult`).

Shared by the model's runner (`gpu_worker.generate_runner`) and the echo runner (`gpu_worker.echo_runner`), so
both answer in one shape: text and token ids cut at a stop string, a streaming request's output joined to
what its earlier attempts sent, the status a finish reason means, the timings. Pure: the tokenizer comes in as
a function.
"""

from __future__ import annotations

from collections.abc import Callable

from gpu_worker.job import Job
from gpu_worker.outcomes import Outcome, result_for
from gpu_worker.sequences import GenResult
from gpu_worker.stop_strings import cut_at_stop
from gpu_worker.token_logprobs import TokenFn, output_logprobs, plain, prompt_output
from shared.deadlines import cannot_finish
from shared.messages import ErrorInfo, RequestResult
from shared.params import GenerateParams
from shared.states import FinishReason, Status

Decode = Callable[[list[int]], str]


def generation_result(job: Job, r: GenResult, now: float, *, worker: str, decode: Decode,
                      token: TokenFn | None = None) -> RequestResult:
    """`token`: a token's text alone, for log probabilities (default: `decode` of it)."""
    token = token or plain(decode)
    token_ids = job.stream.output(r.token_ids) if job.stream is not None else r.token_ids
    prompt_tokens = r.prompt_tokens - (job.stream.base if job.stream is not None else 0)
    params = job.params if isinstance(job.params, GenerateParams) else GenerateParams()
    generated = len(token_ids)
    if token_ids and (r.finish_reason is FinishReason.EOS or (
            r.finish_reason is FinishReason.STOP and token_ids[-1] in params.stop_token_ids)):
        # an EOS or a stop token (checked before stop strings) ends it: its id kept, its text only with
        # include_stop_str_in_output, as vLLM's (a stream sends that text last: the row leaves before releasing it)
        text = decode(token_ids if params.include_stop_str_in_output else token_ids[:-1])
    elif r.finish_reason is FinishReason.STOP:  # text and tokens both end before the stop string (or after it)
        text, token_ids = cut_at_stop(token_ids, params.stop, decode, after=params.min_tokens,
                                      include=params.include_stop_str_in_output)
    else:
        text = decode(token_ids)
    output = {"text": text, "token_ids": token_ids, "prompt_tokens": prompt_tokens,
              "completion_tokens": len(token_ids)}
    if generated != len(token_ids):  # what the stop string's cut left out was computed (and is billed) all the same
        output["generated_tokens"] = generated
    if (logprobs := output_logprobs(job, token_ids, r.logprobs, token, r.prompt_logprobs)) is not None:
        output["logprobs"] = logprobs
    output.update(prompt_output(job, r.prompt_logprobs, decode, token))
    timings = {"ttft_ms": round(r.ttft_s * 1000, 3), "decode_ms": round(r.decode_s * 1000, 3),
               "prefill_ms": round(r.prefill_s * 1000, 3),
               "compute_ms": round((now - r.admitted_at) * 1000, 3)}
    status = {FinishReason.DEADLINE: Status.EXPIRED, FinishReason.CANCELLED: Status.CANCELLED}.get(
        r.finish_reason, Status.SUCCEEDED)
    error = None
    if status is Status.EXPIRED:
        why = ("deadline reached" if cannot_finish(job.deadline, now)
               else f"cannot finish the other {job.new_tokens - len(token_ids)} tokens by the deadline")
        error = ErrorInfo("deadline_exceeded", f"{why} after {len(token_ids)} tokens; partial output kept")
    elif status is Status.CANCELLED:
        error = ErrorInfo("cancelled", "cancelled while running")
    return result_for(job.req, status, worker=worker, now=now, output=output, error=error,
                      reason=r.finish_reason, timings=timings, started=r.admitted_at)


def resumed_whole(job: Job, now: float, *, worker: str, decode: Decode,
                  reason: FinishReason = FinishReason.LENGTH) -> Outcome:
    """A streaming request's result from what its caller was sent, with no row of its own now: run again after it
    was sent every token (`length`), or (`deadline`) preempted and then expired while queued again (its output was
    null, its stream's deltas then adding up to nothing)."""
    if job.stream is None:
        raise ValueError(f"job {job.id} is not a streaming request")
    r = GenResult(id=job.id, token_ids=[], finish_reason=reason,
                  prompt_tokens=len(job.inputs[0]) + len(job.stream.restart()), prefill_s=0.0, ttft_s=0.0,
                  decode_s=0.0, admitted_at=now, owner=job)
    return Outcome(job.req, generation_result(job, r, now, worker=worker, decode=decode))
