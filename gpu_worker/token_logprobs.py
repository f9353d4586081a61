"""Output tokens' log probabilities as callers see them (pure: the tokenizer comes in as a function).

The engine keeps, for a row whose request asks (`params.logprobs`), one `TokenLogprob` per token: the token's log
probability under the model's own logits and its likeliest alternatives, as ids (`gpu_worker.sampling.
keep_logprobs`). Here they become the result's `output.logprobs` and each stream delta's `logprobs`: one entry per
output token, aligned with `token_ids`, `{token_id, token, logprob, top_logprobs: [{token_id, token, logprob}]}`,
and `bytes` where a token is part of a character (its `token` then holds U+FFFD).
A streaming request run again (a crash, a hand-back) starts after the tokens its caller was sent, which join its
prompt; their entries went out in its deltas, and its record gets them again from the prefill, which scores its
prompt's tokens for it (`scored_prompt`), so the record's entries are whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from gpu_worker.job import Job
from gpu_worker.sequences import TokenLogprob
from shared.messages import StreamDelta
from shared.params import GenerateParams

Decode = Callable[[list[int]], str]
# a token's text alone, and its bytes where the text cannot hold them (`gpu_worker.token_text`)
TokenFn = Callable[[int], tuple[str, list[int] | None]]


def plain(decode: Decode) -> TokenFn:
    """A token's text as `decode` spells it alone (a tokenizer with nothing better: the echo model's)."""
    return lambda token_id: (decode([token_id]), None)

# the logits a prompt's scoring holds at once (its tokens x the vocabulary: every position's, from its prefill's
# forward): 2^28, 1 GiB of float32; a 2,048-token prompt of a 128k vocabulary, 32k tokens of an 8k one
PROMPT_LOGITS_MAX = 2**28


def prompt_scorable(tokens: int, vocab: int) -> bool:
    return tokens * vocab <= PROMPT_LOGITS_MAX


def asked(job: Job) -> int | None:
    """How many alternatives `job` asks for with each token's log probability (None: no log probabilities)."""
    return job.params.logprobs if isinstance(job.params, GenerateParams) else None


def _named(token_id: int, logprob: float | None, token: TokenFn) -> dict[str, Any]:
    text, raw = token(token_id)
    out: dict[str, Any] = {"token_id": token_id, "token": text, "logprob": logprob}
    if raw is not None:
        out["bytes"] = raw
    return out


def entries(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], token: TokenFn) -> list[Any]:
    """One entry per token; where its log probability is not known (a prompt's first token, say), `logprob` is
    null and `top_logprobs` empty."""
    return [{**_named(tid, None if lp is None else lp[0], token),
             "top_logprobs": [] if lp is None else [_named(i, v, token) for i, v in lp[1]]}
            for tid, lp in zip(token_ids, logprobs, strict=True)]


def scored_prompt(params: GenerateParams, resumed: int, tokens: int, vocab: int) -> int | None:
    """The alternatives the prefill scores the prompt's `tokens` with: those asked for the prompt, and for a stream
    run again with log probabilities, those of the output it was started after (in its prompt now), unless that
    would hold more logits than a prompt's scoring may (its entries then have `logprob` null)."""
    if resumed and params.logprobs is not None and prompt_scorable(tokens, vocab):
        return max(params.logprobs, params.prompt_logprobs or 0)
    return params.prompt_logprobs


def _cut(entry: TokenLogprob | None, k: int) -> TokenLogprob | None:
    return None if entry is None else (entry[0], entry[1][:k])


def output_logprobs(job: Job, token_ids: Sequence[int], computed: Sequence[TokenLogprob] | None,
                    token: TokenFn, prompt: Sequence[TokenLogprob | None] | None = None) -> list[Any] | None:
    """The result's `output.logprobs` for its `token_ids` (cut at a stop string): the tokens a resumed stream was
    started after (scored with its prompt, `prompt`), then this attempt's; None when the request does not ask."""
    if (k := asked(job)) is None:
        return None
    base = job.stream.base if job.stream is not None else 0
    sent = prompt[len(job.inputs[0]):len(job.inputs[0]) + base] if prompt else []
    known: list[TokenLogprob | None] = [_cut(e, k) for e in sent] + [None] * (base - len(sent))
    known += list(computed or ())
    known += [None] * (len(token_ids) - len(known))
    return entries(token_ids, known[:len(token_ids)], token)


def with_logprobs(delta: StreamDelta, job: Job, computed: Sequence[TokenLogprob] | None,
                  token: TokenFn) -> StreamDelta:
    """`delta` carrying its tokens' entries, if its request asks for them (`computed`: the running row's, from
    the output token `job.stream.base` on)."""
    if asked(job) is None or job.stream is None:
        return delta
    lo = delta.start - job.stream.base
    own: list[TokenLogprob | None] = list(computed[lo:lo + len(delta.token_ids)]) if computed else []
    own += [None] * (len(delta.token_ids) - len(own))
    return dataclasses.replace(delta, logprobs=tuple(entries(delta.token_ids, own, token)))


def prompt_output(job: Job, computed: Sequence[TokenLogprob | None] | None, decode: Decode,
                  token: TokenFn) -> dict[str, Any]:
    """With `params.echo` or `params.prompt_logprobs`: the prompt's `prompt_token_ids` and `prompt_text`, and with
    the latter its `prompt_logprobs` (the first token's `logprob` null: nothing comes before it). A streamed
    request run again has the tokens its caller was sent in its prompt: they are output, not prompt, and left out."""
    params = job.params
    if not isinstance(params, GenerateParams) or (params.prompt_logprobs is None and not params.echo):
        return {}
    prompt = list(job.inputs[0])
    out: dict[str, Any] = {"prompt_token_ids": prompt, "prompt_text": decode(prompt)}
    if params.prompt_logprobs is not None:
        known = [_cut(e, params.prompt_logprobs) for e in (computed or [])[:len(prompt)]]
        known += [None] * (len(prompt) - len(known))
        out["prompt_logprobs"] = entries(prompt, known, token)
    return out


def certain(tokens: Sequence[int], k: int | None) -> list[TokenLogprob] | None:
    """The echo model's: every token is the only one it could be (log probability 0)."""
    return None if k is None else [(0.0, ((t, 0.0),)[:k]) for t in tokens]


def certain_prompt(job: Job) -> list[TokenLogprob | None] | None:
    """The echo model's prompt log probabilities (what a stream run again was sent included, as the engine scores
    it): after the first token, each is certain."""
    if not isinstance(job.params, GenerateParams):
        return None
    sent = job.stream.released[:job.stream.base] if job.stream is not None else []
    k = scored_prompt(job.params, len(sent), 0, 0)
    return None if k is None else [None, *(certain([*job.inputs[0], *sent][1:], k) or ())]
