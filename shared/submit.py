"""What a caller submits, as schema types, and how a submitted body becomes an `InferenceRequest`.

`GenerateSubmit` and `EmbedSubmit` are the submit body of a generation and an embedding model: the
gateway's validation and the OpenAPI document's request body both come from them. `build_request`
checks a body against its model's type, then what depends on the model (its limits, the deadline from
`timeout_s`/`deadline` or its default, the callback URL's address), and assigns the lane. Pure: the
clock value is passed in; used by the HTTP gateway and by the SDK's direct mode alike.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from shared.config import ModelSpec
from shared.deadlines import cannot_finish
from shared.errors import ValidationError
from shared.ids import new_request_id
from shared.lanes import assign_lane, estimate_embed_tokens, estimate_generate_tokens
from shared.messages import Callback, InferenceRequest
from shared.model_context import CONTEXT_EXCEEDED, context_message
from shared.params import (
    ITEM_LISTS,
    TRUNCATE_HINT,
    EmbedInput,
    EmbedParams,
    GenerateInput,
    GenerateParams,
    exactly_one,
)
from shared.ssrf import AllowList, RefusedURL, check_url, normalized_url
from shared.states import Priority, Task
from shared.token_limits import TemplateRefusal, TokenLimits, compile_problem
from shared.validation import check_text, convert

MAX_TIMEOUT_S = 10**9  # a bound only to keep the number finite; each model's max_timeout_s is checked after
MAX_EPOCH_S = 10**11
CallbackEvent = Literal["started", "completed"]
DateTimeStr = Annotated[str, Meta(extra_json_schema={"format": "date-time"})]  # parsed by resolve_deadline


class CallbackSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where to send webhooks, and for which events."""

    url: Annotated[str, Meta(extra_json_schema={"format": "uri"})]
    events: Annotated[tuple[CallbackEvent, ...], Meta(min_length=1, extra_json_schema={"uniqueItems": True})] = (
        "completed",)


class _SubmitFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    timeout_s: Annotated[float, Meta(gt=0, le=MAX_TIMEOUT_S, description="seconds from now")] | UnsetType = UNSET
    deadline: Annotated[float, Meta(ge=0, le=MAX_EPOCH_S)] | DateTimeStr | UnsetType = UNSET
    priority: Priority = Priority.INTERACTIVE
    callback: CallbackSpec | UnsetType = UNSET


class GenerateSubmit(_SubmitFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The submit body for a generation model. `deadline`: epoch seconds or ISO 8601 with a zone."""

    input: Annotated[GenerateInput, exactly_one("prompt", "input_ids", "messages")]
    params: GenerateParams | None = None
    stream: Annotated[bool, Meta(description="publish tokens as they are decoded: GET /v1/requests/{id}/events "
                                             "(or submit with Accept: text/event-stream)")] = False


class EmbedSubmit(_SubmitFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The submit body for an embedding model. `deadline`: epoch seconds or ISO 8601 with a zone."""

    input: Annotated[EmbedInput, exactly_one("texts", "text")]
    params: EmbedParams | None = None


SUBMIT_TYPES: dict[Task, type[GenerateSubmit] | type[EmbedSubmit]] = {Task.GENERATE: GenerateSubmit,
                                                                       Task.EMBED: EmbedSubmit}


def resolve_deadline(timeout_s: float | UnsetType, deadline: float | str | UnsetType, spec: ModelSpec,
                     now: float) -> float:
    """Absolute deadline (epoch seconds) from `timeout_s` or `deadline`, else the model's default."""
    if timeout_s is not UNSET and deadline is not UNSET:
        raise ValidationError("timeout_s", "give either timeout_s or deadline, not both")
    if isinstance(timeout_s, float):
        if timeout_s > spec.max_timeout_s:
            raise ValidationError("timeout_s", f"at most {spec.max_timeout_s} seconds for this model")
        if timeout_s < spec.min_timeout_s:
            raise ValidationError("timeout_s", f"at least {spec.min_timeout_s:g} seconds: no request to this model "
                                               "can finish sooner")
        return now + timeout_s
    if isinstance(deadline, str):
        try:
            parsed = datetime.fromisoformat(re.sub(r"[zZ]$", "+00:00", deadline))  # RFC 3339 takes "z" too
        except ValueError as exc:
            raise ValidationError("deadline", "must be epoch seconds or an ISO 8601 time") from exc
        if parsed.tzinfo is None:
            raise ValidationError("deadline", "an ISO 8601 deadline needs a time zone (e.g. Z)")
        deadline = parsed.timestamp()
    if isinstance(deadline, float):
        if cannot_finish(deadline, now):
            raise ValidationError("deadline", "is in the past")
        if deadline - now > spec.max_timeout_s:
            raise ValidationError("deadline", f"at most {spec.max_timeout_s} seconds ahead for this model")
        if deadline - now < spec.min_timeout_s:
            raise ValidationError("deadline", f"at least {spec.min_timeout_s:g} seconds ahead: no request to this "
                                              "model can finish sooner")
        return deadline
    return now + spec.default_timeout_s


def resolve_callback(spec: CallbackSpec, allow: AllowList) -> Callback:
    if len(set(spec.events)) != len(spec.events):
        raise ValidationError("callback.events", "a list of distinct events from ['started', 'completed']")
    if not spec.url.isprintable():
        raise ValidationError("callback.url", "must not contain control characters")
    try:
        check_url(spec.url, allow)
    except RefusedURL as exc:
        raise ValidationError("callback.url", str(exc)) from exc
    return Callback(url=normalized_url(spec.url), events=spec.events)


def check_tokens(inp: dict[str, Any], spec: ModelSpec, limits: TokenLimits, *, truncate: bool = False,
                 field: str = "", keep: int | None = None, side: str = "left") -> tuple[int | None, str]:
    """Token limits the gateway can know before queueing (the model's vocabulary, its tokenizer): a prompt
    or text too long for the model, a token id outside its vocabulary. Unknowable ones are the worker's.
    Returns a prompt's token count where it could count it (else None; at most `keep`, the last tokens a
    truncated prompt keeps, at its `side`'s end cut), and its field."""
    if "input_ids" in inp:
        vocab = limits.vocab_size(spec)
        ids, start = inp["input_ids"], 0
        if keep is not None and len(ids) > keep:  # cut first, then read (vLLM's)
            ids, start = (ids[:keep], 0) if side == "right" else (ids[len(ids) - keep:], len(ids) - keep)
        bad = next(((i, t) for i, t in enumerate(ids, start) if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise ValidationError("input.input_ids", f"item {bad[0]}: {bad[1]} is not a token of this model "
                                                     f"(its vocabulary has {vocab} tokens: ids 0-{vocab - 1})")
        return _kept(len(inp["input_ids"]), keep), "input.input_ids"
    if "prompt" in inp or "messages" in inp:
        if "prompt" in inp:
            counts = limits.count(spec, [inp["prompt"]])
            n, where = (counts[0] if counts is not None else None), "input.prompt"
        else:
            if inp.get("chat_template") is None and limits.lacks_chat_template(spec):  # as its worker would fail it
                raise ValidationError("input.messages", f"model {spec.name} has no chat template: send a prompt "
                                                        "instead, or give the model one (its model file's "
                                                        "chat_template)", code="no_chat_template")
            try:
                n, where = limits.count_chat(
                    spec, inp["messages"], inp.get("tools"), inp.get("chat_template_kwargs"),
                    add_generation_prompt=inp.get("add_generation_prompt", True),
                    continue_final_message=inp.get("continue_final_message", False),
                    documents=inp.get("documents"), chat_template=inp.get("chat_template")), "input.messages"
            except TemplateRefusal as exc:  # known now: the worker's template would refuse it the same way
                raise ValidationError("input.messages", f"the model's chat template refuses this conversation: "
                                                        f"{exc}") from None
        n = None if n is None else _kept(n, keep)
        if n is not None and n > spec.max_input_tokens:
            raise ValidationError(where, f"is {n} tokens; this model takes at most {spec.max_input_tokens}",
                                  code=CONTEXT_EXCEEDED)
        return n, where
    if "texts" in inp and not truncate:
        cap = limits.max_text_tokens(spec)
        counts = limits.count(spec, inp["texts"]) or []
        for i, n in enumerate(counts):
            if n > cap:
                where = "input.text" if field == "input.text" else f"input.texts[{i}]"
                raise ValidationError(where, f"is {n} tokens; this model takes at most {cap} per text "
                                             f"{TRUNCATE_HINT}", code=CONTEXT_EXCEEDED)
    return None, ""


def check_template(template: str) -> None:
    """A request's own chat template compiles (where jinja2 is here to tell; else the worker's check stays). It is
    compiled only: rendering a caller's template runs its loops, which the worker alone is trusted with."""
    if (problem := compile_problem(template)) is not None:
        raise ValidationError("input.chat_template", problem)


def _kept(n: int, keep: int | None) -> int:
    return n if keep is None else min(n, keep)


def check_bias(params: GenerateParams, vocab: int | None) -> None:
    """`logit_bias`, `stop_token_ids` and `allowed_token_ids` name tokens of the model's vocabulary (where the gateway
    knows its size)."""
    if (outside := params.outside_vocabulary(vocab)) is not None:
        field, bad = outside
        raise ValidationError(f"params.{field}", f"{bad} is not a token of this model (its vocabulary has {vocab} "
                                                 f"tokens: ids 0-{vocab - 1})")


def within_context(params: GenerateParams, given: bool, prompt_tokens: int | None, where: str,
                   context: int | None) -> GenerateParams:
    """A prompt and its new tokens within the model's context (`shared.model_context`), as OpenAI and vLLM hold
    them: a default `max_new_tokens` shrinks to what fits; one the caller gave that does not fit, or a prompt that
    fills the context alone, is refused naming the field to change."""
    if context is None or prompt_tokens is None or prompt_tokens + params.max_new_tokens <= context:
        return params
    room = context - prompt_tokens
    if not given and room >= max(1, params.min_tokens):
        return msgspec.structs.replace(params, max_new_tokens=room)
    name = "max_new_tokens" if given or room < 1 else "min_tokens"  # a default shrinks, down to min_tokens
    field = f"params.{name}" if room >= 1 else where
    raise ValidationError(field, context_message(context, prompt_tokens, getattr(params, name), name),
                          code=CONTEXT_EXCEEDED)


def build_request(body: Any, spec: ModelSpec, tenant: str, now: float,
                  allow: AllowList | None = None, limits: TokenLimits | None = None) -> InferenceRequest:
    """The request a submit body asks for (raises `ValidationError` with the field it concerns).
    `limits`: where the token limits the gateway can know come from (none checked without it)."""
    if not isinstance(body, dict):
        raise ValidationError("", "the body must be a JSON object")
    check_text(body, item_lists=ITEM_LISTS)  # before anything encodes or measures its text
    if spec.task is Task.EMBED and "stream" in body:
        raise ValidationError("stream", f"{spec.name} is an embedding model: only generation models stream "
                                        "(its vectors come whole, in the result)")
    sub = convert(body, SUBMIT_TYPES[spec.task], item_lists=ITEM_LISTS)
    if isinstance(sub, GenerateSubmit):
        raw_params = body.get("params")
        given = isinstance(raw_params, dict) and "max_new_tokens" in raw_params
        params = (sub.params or GenerateParams()).within(
            given=given, limit=spec.max_new_tokens, default_max_new_tokens=spec.default_max_new_tokens)
        params.check_format()
        if spec.echo and params.response_format is not None:  # as its worker refuses it, known here already
            raise ValidationError("params.response_format", f"model {spec.name} echoes its prompt; it cannot follow a "
                                                            "format")
        params.check_truncation(spec.max_input_tokens)
        # a prompt the worker truncates may be any length the body's size allows; else one far past the model's
        # prompt limit is refused untokenized
        # -1 keeps what the model's context leaves beside the output, where the gateway knows the context (a model
        # file may allow more than the model takes: it kept the file's limit, and the prompt was then refused)
        keep = params.prompt_kept(spec.max_input_tokens, limits.context(spec) if limits is not None else None)
        inp = sub.input.normalised(max_prompt_chars=spec.max_input_tokens * 16 if keep is None else None,
                                   max_input_tokens=spec.max_input_tokens if keep is None else None,
                                   templates_trusted=spec.trust_request_chat_template)
        if "chat_template" in inp:
            check_template(inp["chat_template"])
        prompt_tokens = None
        if limits is not None:
            prompt_tokens, where = check_tokens(inp, spec, limits, keep=keep, side=params.truncation_side)
            if keep is not None and prompt_tokens == keep:  # the prompt as cut: what to lower is the cut
                where = "params.truncate_prompt_tokens"
            params = within_context(params, given, prompt_tokens, where, limits.context(spec))
            check_bias(params, limits.vocab_size(spec))
        if prompt_tokens is None:  # not counted here: estimated from the characters
            prompt_tokens = _kept(estimate_generate_tokens(inp, params.max_new_tokens)[0], keep)
        tokens = prompt_tokens + params.max_new_tokens
        params_dict = params.to_dict()
        stream = sub.stream
    else:
        embed_params = sub.params or EmbedParams()
        embed_params.check_truncation(limits.max_text_tokens(spec) if limits is not None else spec.max_input_tokens)
        # with params.truncate (or truncate_prompt_tokens), a text over the model's tokens is accepted, whatever its
        # length (the body's size bounds it), and cut by the worker, which reports it; without, one far past them is
        # refused untokenized
        inp = sub.input.normalised(max_texts=spec.max_texts,
                                   max_text_chars=None if embed_params.cuts() else spec.max_input_tokens * 16)
        if limits is not None:
            check_tokens(inp, spec, limits, truncate=embed_params.cuts(),
                         field="input.text" if isinstance(sub.input.text, str) else "input.texts")
        tokens = estimate_embed_tokens(inp, embed_params.text_tokens(spec.max_input_tokens) if embed_params.cuts()
                                       else None)
        params_dict = embed_params.to_dict()
        stream = False
    callback = resolve_callback(sub.callback, allow or AllowList()) if sub.callback is not UNSET else None
    deadline = resolve_deadline(sub.timeout_s, sub.deadline, spec, now)
    return InferenceRequest(
        id=new_request_id(int(now * 1000)), tenant=tenant, model=spec.name, task=spec.task, input=inp,
        params=params_dict, lane=assign_lane(tokens, spec.lanes).name, priority=sub.priority,
        created_ms=int(now * 1000), deadline_ms=int(deadline * 1000), est_tokens=tokens, callback=callback,
        stream=stream,
    )
