"""OpenAI-compatible shapes: what `/v1/completions`, `/v1/chat/completions` and `/v1/embeddings` accept,
and how it becomes the native submit body; how a native result becomes OpenAI's response, chunk or error.

Pure (no I/O, no clock): the gateway's `gateway.openai_api` calls these around `shared.operations`, so
the OpenAI routes get the native API's lanes, deadlines, admission and tenant limits unchanged.

What is refused, and why, is written once here (docs/openai.md lists it): an OpenAI field we accept is
either honoured or harmless at the value given; anything else is a 400 naming the field (`param`).
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from shared.api_errors import ApiError
from shared.errors import ValidationError
from shared.model_context import CONTEXT_EXCEEDED
from shared.openai_logprobs import openai_logprobs
from shared.openai_tools import (
    Calls,
    ChosenFunction,
    FunctionDefs,
    ToolChoice,
    ToolDefs,
    ToolError,
    answer,
    call_id,
    finish,
    legacy_plan,
    message_calls,
    plan,
)
from shared.params import MAX_SEED, MAX_TOP_LOGPROBS, MIN_TOP_P
from shared.tool_call_formats import streamable
from shared.validation import check_text, convert

OWNED_BY = "batchgate"
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when the caller sends none (the native API's is 0: greedy)
TIMEOUT_HEADER = "x-batchgate-timeout"
MAX_CHOICES = 16  # `n`: each choice is a request of its own, batched with the others on the worker
EXTENSION = "batchgate"  # the key of our own fields in a response (OpenAI clients keep unknown keys)
# the caller's to fix: a 400 with that code (a generation's prompt past what the model takes: OpenAI's
# context_length_exceeded, which clients built on its SDK look for to trim a conversation)
TEXT_FAILURES = frozenset({"invalid_input", "input_too_long", "no_chat_template", CONTEXT_EXCEEDED})

Priority = Literal["interactive", "batch"]
Kind = Literal["completion", "chat", "embedding"]


# ---------------------------------------------------------------------------------------------- errors

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error", 504: "timeout_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class OpenAIError(Exception):
    """An error as OpenAI sends it: `{"error": {"message", "type", "param", "code"}}` with its status.

    `retry`: False sends `x-should-retry: false`, so OpenAI's clients do not submit again a request that
    cannot succeed by retrying (they retry 408, 409, 429 and 5xx by default)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry: bool | None = None, retry_after: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry, self.retry_after = retry, retry_after
        self._headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": error_type(self.status), "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        out = dict(self._headers)
        if self.retry_after is not None:  # OpenAI's clients read the milliseconds first
            out["retry-after-ms"] = str(max(1, round(self.retry_after * 1000)))
        if self.retry is not None:
            out["x-should-retry"] = "true" if self.retry else "false"
        return out


def invalid(param: str | None, message: str, code: str = "invalid_request") -> OpenAIError:
    """A 400 about one field of the request (its OpenAI name)."""
    return OpenAIError(400, f"{param}: {message}" if param else message, code=code, param=param)


def unsupported(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {what}", code="unsupported_parameter", param=param)


def openai_param(native_field: str, aliases: dict[str, str]) -> str | None:
    """The OpenAI name of a native body field: `params.max_new_tokens` -> `max_tokens`, `input.texts[2]`
    -> `input[2]`; the longest alias that is a prefix (at a field boundary) wins, `params.` is dropped."""
    if not native_field:
        return None
    for native in sorted(aliases, key=len, reverse=True):
        if native_field == native or native_field.startswith((native + ".", native + "[")):
            return aliases[native] + native_field[len(native):]
    return native_field.removeprefix("params.")


_NATIVE_HINT = re.compile(r" \(or set (params\.[a-z_]+)[^)]*\)")


def in_openai_terms(native: str, message: str, aliases: dict[str, str]) -> tuple[str | None, str]:
    """A field the native checks refused, and their message, as an OpenAI route names them: (the parameter,
    the message naming it)."""
    param = openai_param(native, aliases)
    if native and param and message.startswith(native + ":"):
        message = param + message[len(native):]
    # a hint to set a native parameter is given in the route's terms; one it has no counterpart of would mislead
    message = _NATIVE_HINT.sub(lambda m: m.group(0).replace(m.group(1), aliases[m.group(1)]) if m.group(1) in aliases
                               else "", message)
    # a native parameter the message names in its sentence ("prompt (9 tokens) + max_new_tokens (4000) = ..."),
    # by the name the caller sent it under
    for native_name, name in aliases.items():
        bare = native_name.removeprefix("params.")
        if native_name.startswith("params.") and bare != name and "." not in bare:
            message = re.sub(rf"(?<![\w.]){re.escape(bare)}\b", name, message)
    return param, message


def from_api_error(exc: ApiError, aliases: dict[str, str] | None = None) -> OpenAIError:
    """A native error in OpenAI's shape. A 422 (a field the native checks refused) is a 400, as OpenAI
    answers invalid parameters; its field and message name the OpenAI parameter."""
    param, message = in_openai_terms(str(exc.extra.get("field") or ""), exc.message, aliases or {})
    status = 400 if exc.status == 422 else exc.status
    # a conflict with no time to come back after (a key used with another body, a file in use) cannot change
    # on a retry, and OpenAI's clients retry every 409 unless told not to
    final = exc.status == 409 and exc.retry_after is None
    return OpenAIError(status, message, code=exc.code, param=param, retry_after=exc.retry_after,
                       retry=False if final else None, headers=exc.headers())  # Retry-After among them


# --------------------------------------------------------------------------------------- request types


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; chunks are never padded
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, every chunk's usage so far


class JsonSchemaFormat(msgspec.Struct, frozen=True):
    name: str | None = None  # accepted; a name is for the caller's own bookkeeping
    schema: dict[str, Any] | None = None  # none: any JSON object
    strict: bool | None = None  # accepted; the output always follows the schema
    description: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The fields completions and chat completions share (OpenAI's, then our extensions)."""

    model: Annotated[str, Meta(min_length=1)]
    max_tokens: int | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # checked as the native params.logit_bias
    service_tier: str | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs' tokens named `token_id:N`
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids with the text
    # extensions: the deadline and priority of the native API; vLLM's top_k, min_p, stop_token_ids, min_tokens,
    # include_stop_str_in_output, skip_special_tokens, ignore_eos, repetition_penalty, allowed_token_ids,
    # bad_words, truncate_prompt_tokens and truncation_side
    timeout_s: float | None = None
    priority: Priority | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # structured output: OpenAI's response_format (completions too, as vLLM takes it), vLLM's guided decoding
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None  # accepted; there is one backend (llguidance)
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_Sampling, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[Any]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, frozen=True):
    """One part of a message's content; only `text` parts are read (others are refused by name)."""

    type: str
    text: str | None = None


class MessageIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted; chat templates have no place for it
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None
    refusal: str | None = None
    audio: Any | None = None
    # what the SDK's own answer objects carry back when a caller appends `choices[0].message` to its history
    # (OpenAI's `annotations`; `parsed` from `chat.completions.parse`): answers, not input, so read past
    annotations: list[Any] | None = None
    parsed: Any | None = None


class ChatRequest(_Sampling, frozen=True, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[MessageIn], Meta(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: ToolDefs | None = None
    tool_choice: str | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    documents: list[dict[str, str]] | None = None  # vLLM's: what a retrieval-augmented template shows the model
    echo: bool | None = None  # vLLM's: the answer begins with the last message, where it is the answering role's
    chat_template: str | None = None  # vLLM's: the request's own template (where the model's file trusts it)
    add_generation_prompt: bool | None = None  # vLLM's, as the native input's
    continue_final_message: bool | None = None
    functions: FunctionDefs | None = None  # deprecated, as `tools`
    function_call: str | ChosenFunction | None = None  # deprecated, as `tool_choice`
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: Any | None = None
    audio: Any | None = None
    web_search_options: Any | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: Annotated[str, Meta(min_length=1)]
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
    timeout_s: float | None = None
    priority: Priority | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: each text's first tokens


@dataclass(frozen=True, slots=True)
class Translated:
    """An OpenAI request as the native API's submit body, and what its answer needs."""

    kind: Kind
    model: str
    body: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # with include_usage, vLLM's continuous_usage_stats: each chunk's usage so far
    encoding_format: str = "float"
    aliases: dict[str, str] = field(default_factory=dict)  # native field -> OpenAI parameter
    n: int = 1  # choices asked for: each its own native request
    logprobs: int | None = None  # alternatives asked for with each token's log probability; None: none
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens named by their ids
    prefix: str = ""  # chat's `echo` (vLLM's): the last message, which the answer's content begins with
    with_ids: bool = False  # vLLM's return_token_ids: the prompt's and the output's token ids beside the text
    echo: bool = False  # completions: the prompt before the completion (its tokens' log probabilities too)
    prompt: str | None = None  # the prompt as sent, when a string (echoed as it is)
    score_only: bool = False  # `echo` with `max_tokens` 0: the prompt alone (the one token generated is dropped)
    best_of: int = 1  # completions: candidates generated, the `n` likeliest per token returned
    calls: Calls | None = None  # chat with tool_choice "required" or a named function: the answer is tool calls

    @property
    def requests(self) -> int:
        """Native requests the call makes: one per choice, or per candidate with `best_of`."""
        return max(self.n, self.best_of)

    def bodies(self) -> list[dict[str, Any]]:
        """The native submit body of each choice: a given seed is the first choice's, the next ones count up from
        it (OpenAI's choices of one seeded request differ from each other, and are the same on every call)."""
        out = []
        for i in range(self.requests):
            params = dict(self.body["params"])
            if isinstance(params.get("seed"), int):
                params["seed"] = (params["seed"] + i) % (MAX_SEED + 1)
            if self.best_of > self.n:  # the candidates are ranked by their tokens' log probabilities
                params["logprobs"] = params.get("logprobs") or 0
            out.append({**self.body, "params": params})
        return out


# ----------------------------------------------------------------------------------------- translation


def parse_request(raw: Any, typ: type[Any]) -> Any:
    """An OpenAI route's body as its type; a 400 naming the field that does not fit."""
    if not isinstance(raw, dict):
        raise invalid(None, "the body must be a JSON object")
    try:
        check_text(raw)
        return convert(raw, typ)
    except ValidationError as exc:
        raise invalid(exc.field or None, exc.message) from None


def _refuse_non_defaults(req: Any, checks: Sequence[tuple[str, Callable[[Any], bool], str]]) -> None:
    """Each (field, is it at a value we honour, why not): the first one that is not is a 400."""
    for name, ok, why in checks:
        if not ok(getattr(req, name)):
            raise unsupported(name, why)


def _none_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in allowed


def _empty(v: Any) -> bool:
    return not v


_COMMON_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("service_tier", _none_or("auto", "default"), "only 'auto' or 'default'"),
    ("guided_whitespace_pattern", _none_or(), "not supported: JSON comes out with json.dumps' separators (a "
                                              "schema's own x-guidance options set others)"),
)
_COMPLETION_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("suffix", _empty, "not supported (only empty)"),
)
_CHAT_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("store", _none_or(False), "completions are not stored (only false)"),
    ("modalities", lambda v: v is None or list(v) == ["text"], "only ['text']"),
    ("reasoning_effort", _none_or(), "not supported"),
    ("verbosity", _none_or(), "not supported"),
    ("prediction", _none_or(), "predicted outputs are not supported"),
    ("audio", _none_or(), "audio output is not supported"),
    ("web_search_options", _none_or(), "web search is not supported"),
)


def _timeout_alias(req: Any, timeout_header: str | None) -> dict[str, str]:
    """Where a native check's `timeout_s` came from, when the caller set it by the header (the model's range)."""
    return {"timeout_s": "X-Batchgate-Timeout"} if req.timeout_s is None and (timeout_header or "").strip() else {}


def _deadline(req: Any, timeout_header: str | None) -> dict[str, Any]:
    """`timeout_s` (body, wins) or the `X-Batchgate-Timeout` header; `priority`."""
    out: dict[str, Any] = {}
    if req.timeout_s is not None:
        out["timeout_s"] = req.timeout_s
    elif timeout_header is not None and timeout_header.strip():
        try:
            seconds = float(timeout_header) if "_" not in timeout_header else math.nan  # float() takes "1_0"
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):  # named as the header, where the caller set it
            raise invalid("X-Batchgate-Timeout", f"must be a positive number of seconds, got {timeout_header[:40]!r}",
                          code="invalid_timeout")
        out["timeout_s"] = seconds
    if req.priority is not None:
        out["priority"] = req.priority
    return out


def _params(req: _Sampling, max_tokens: int | None, fmt: dict[str, Any] | None) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    for name in ("top_p", "seed", "top_k", "min_p", "ignore_eos", "repetition_penalty", "stop_token_ids",
                 "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids",
                 "truncate_prompt_tokens", "truncation_side"):
        if getattr(req, name) is not None:
            params[name] = getattr(req, name)
    for name in ("presence_penalty", "frequency_penalty", "logit_bias", "bad_words"):
        if getattr(req, name):  # 0, {} and [], OpenAI's (and vLLM's) defaults, are the native defaults too
            params[name] = getattr(req, name)
    # values OpenAI (and vLLM) take that the native params spell otherwise: top_p 0 keeps the likeliest token
    # alone (the native least top_p does), any int64 is a seed, vLLM's top_k -1 is off (native 0)
    if params.get("top_p") == 0:
        params["top_p"] = MIN_TOP_P
    if isinstance(params.get("seed"), int):
        params["seed"] %= MAX_SEED + 1
    if params.get("top_k") == -1:
        params["top_k"] = 0
    if req.stop is not None and req.stop != []:
        params["stop"] = req.stop
    if fmt is not None:
        params["response_format"] = fmt
    if req.return_token_ids:  # vLLM's: the prompt's ids come with the output (native echo)
        params["echo"] = True
    return params


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _constraint(req: _Sampling) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The native `params.response_format` of OpenAI's `response_format`, vLLM's `guided_*` or its
    `structured_outputs` (at most one of them), and the aliases naming it in errors."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        given.append(("response_format", _response_format(fmt)))
    given += [(name, _structured(name, kind, value)) for name, kind in _GUIDED.items()
              if (value := getattr(req, name)) is not None]
    if req.structured_outputs is not None:
        given.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    if len(given) > 1:
        raise invalid(given[1][0], f"give one of {given[0][0]} and {given[1][0]}: one format per request")
    if not given:
        return None, {}
    name, native = given[0]
    schema_at = "response_format.json_schema.schema" if name == "response_format" else name
    return native, {"params.response_format": name, "params.response_format.schema": schema_at}


def _response_format(fmt: ResponseFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type != "json_schema":
        raise unsupported("response_format.type", f"only 'text', 'json_object' or 'json_schema' (got {fmt.type!r})")
    if fmt.json_schema is None:
        raise invalid("response_format.json_schema", "required with type 'json_schema'")
    schema = fmt.json_schema.schema
    return {"type": "json_object"} if schema is None else {"type": "json_schema", "schema": schema}


def _structured(param: str, kind: str, value: Any) -> dict[str, Any]:
    """One of vLLM's guided decoding fields (`kind`: json, regex, choice, grammar) as a native format."""
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as a JSON string too
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid(param, "must be a JSON Schema: an object, or a string holding one") from None
        if not isinstance(value, dict):
            raise invalid(param, "must be a JSON Schema: an object, or a string holding one")
        return {"type": "json_schema", "schema": value}
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise invalid(param, "must be a list of strings")
        return {"type": "choice", "choices": value}
    if not isinstance(value, str):
        raise invalid(param, "must be a string")
    return {"type": kind, "pattern": value} if kind == "regex" else {"type": "grammar", "grammar": value}


def _structured_outputs(value: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar or json_object (true)."""
    kinds = {k: v for k, v in value.items() if k in ("json", "regex", "choice", "grammar", "json_object")
             and v is not None and v is not False}
    if other := sorted(k for k, v in value.items() if k not in kinds and v not in (None, False)):
        raise unsupported(f"structured_outputs.{other[0]}", "only json, regex, choice, grammar or json_object")
    if len(kinds) != 1:
        raise invalid("structured_outputs", "give exactly one of json, regex, choice, grammar or json_object")
    ((kind, v),) = kinds.items()
    if kind == "json_object":
        return {"type": "json_object"}
    return _structured(f"structured_outputs.{kind}", kind, v)


def _choices(req: _Sampling) -> int:
    if req.n is None:
        return 1
    if not 1 <= req.n <= MAX_CHOICES:
        raise invalid("n", f"must be between 1 and {MAX_CHOICES}, got {req.n}")
    return req.n


def _stream_flags(req: _Sampling) -> tuple[bool, bool, bool]:
    """Streamed; with the usage chunk; with usage in every chunk (vLLM's `continuous_usage_stats`, which counts
    only with `include_usage`, as vLLM reads it)."""
    stream, options = bool(req.stream), req.stream_options
    if options is not None and not stream:  # as OpenAI answers: options of a stream not asked for
        raise invalid("stream_options", "only allowed when stream is true")
    usage = bool(stream and options is not None and options.include_usage)
    return stream, usage, bool(usage and options is not None and options.continuous_usage_stats)


def _prompt_input(prompt: str | list[Any]) -> dict[str, Any]:
    """`prompt`: a string, one string in a list, token ids, or one list of token ids."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not prompt:
        raise invalid("prompt", "must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"input_ids": prompt}
    if not (all(isinstance(p, str) for p in prompt) or all(_token_ids(p) for p in prompt)):  # mixed, or booleans
        raise invalid("prompt", "must be a string, a list of strings, a list of token ids (integers) or a list of "
                                "such lists")
    if len(prompt) > 1:
        raise invalid("prompt", f"one prompt per request (got a list of {len(prompt)}); send each as its own "
                                "request (they are batched together on the server anyway)", code="multiple_prompts")
    only = prompt[0]
    if isinstance(only, str):
        return {"prompt": only}
    if _token_ids(only):
        return {"input_ids": only}
    raise invalid("prompt", "must be a string, a list of one string, or a list of token ids")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _top(param: str, value: int) -> int:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(param, f"must be between 0 and {MAX_TOP_LOGPROBS}, got {value}")
    return value


def translate_completion(raw: Any, *, timeout_header: str | None = None) -> Translated:
    req: CompletionRequest = parse_request(raw, CompletionRequest)
    _refuse_non_defaults(req, (*_COMMON_CHECKS, *_COMPLETION_CHECKS))
    stream, usage, continuous = _stream_flags(req)
    logprobs = None if req.logprobs is None else _top("logprobs", req.logprobs)
    prompt = _prompt_input(req.prompt)
    echo, score_only = bool(req.echo), bool(req.echo) and req.max_tokens == 0
    if echo and stream:
        raise unsupported("echo", "not with stream: true (ask for the echo without streaming)")
    if score_only and req.min_tokens:  # the prompt scored alone: no token is kept
        raise invalid("min_tokens", f"must be at most max_tokens (0), got {req.min_tokens}")
    fmt, fmt_aliases = _constraint(req)
    params = _with_logprobs(_params(req, 1 if score_only else req.max_tokens, fmt), logprobs)
    if echo and logprobs is not None:  # the prompt's tokens scored (and their text)
        params["prompt_logprobs"] = logprobs
    elif echo and "input_ids" in prompt:  # the text of the prompt's tokens
        params["echo"] = True
    body = {"input": prompt, "params": params, "stream": stream, **_deadline(req, timeout_header)}
    aliases = {"input.prompt": "prompt", "input.input_ids": "prompt", "input": "prompt",
               "params.max_new_tokens": "max_tokens", "params.logprobs": "logprobs",
               "params.prompt_logprobs": "logprobs", **fmt_aliases, **_timeout_alias(req, timeout_header)}
    n = _choices(req)
    best_of = n if req.best_of is None else req.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise invalid("best_of", f"must be between n ({n}) and {MAX_CHOICES}, got {best_of}")
    if best_of > n and stream:  # as OpenAI answers: the best is known only once every candidate is done
        raise invalid("best_of", "best_of above 1 cannot be streamed")
    # echoed as sent, unless truncated: then as the worker read it (the tokens kept)
    sent = prompt.get("prompt") if req.truncate_prompt_tokens is None else None
    return Translated("completion", req.model, body, stream, usage, continuous, aliases=aliases, n=n,
                      logprobs=logprobs, echo=echo, as_ids=bool(req.return_tokens_as_token_ids), prompt=sent,
                      score_only=score_only, best_of=best_of, with_ids=bool(req.return_token_ids))


def _with_logprobs(params: dict[str, Any], logprobs: int | None) -> dict[str, Any]:
    return params if logprobs is None else {**params, "logprobs": logprobs}


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(given: list[MessageIn]) -> list[dict[str, Any]]:
    """The native messages. The deprecated function calling's turns become tool calling's: an assistant's
    `function_call` a call, a `function` message the tool result that answers the call before it. Their ids,
    `call<message index, 5 digits>`, are 9 letters and digits, as Mistral's chat templates require."""
    out, last_call = [], ""
    for i, m in enumerate(given):
        at = f"messages[{i}]"
        if m.function_call is not None:
            last_call = f"call{i:05d}"
            m = msgspec.structs.replace(m, function_call=None, tool_calls=[
                {"id": last_call, "type": "function", "function": _legacy_call(at, m)}])
        elif m.role == "function":
            if not m.name:
                raise invalid(f"{at}.name", "required: the function whose result this is")
            m = msgspec.structs.replace(m, role="tool", tool_call_id=last_call or f"call{i:05d}")
        out.append(_message(i, m))
    return out


def _legacy_call(at: str, m: MessageIn) -> dict[str, str]:
    """An assistant's deprecated `function_call`, checked: {"name", "arguments": a JSON object as text}."""
    call = m.function_call
    if m.role != "assistant" or m.tool_calls or not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise invalid(f"{at}.function_call", "an assistant's {'name', 'arguments'} (JSON text), without tool_calls")
    arguments = call.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise invalid(f"{at}.function_call.arguments", "must be a JSON object, as text")
    return {"name": call["name"], "arguments": arguments}


def _message(i: int, m: MessageIn) -> dict[str, Any]:
    at = f"messages[{i}]"
    if m.role not in _ROLES:
        raise invalid(f"{at}.role", f"must be one of: {', '.join(_ROLES)} (got {m.role!r})")
    if m.audio is not None:
        raise unsupported(f"{at}.audio", "audio is not supported")
    extra = _call_fields(at, m)
    if m.content is None and "tool_calls" in extra:
        return {"role": m.role, "content": "", **extra}
    if isinstance(m.content, str):
        return {"role": m.role, "content": m.content, **extra}
    if not m.content:
        why = "required" if m.content is None else "an empty list (at least one part, as OpenAI)"
        raise invalid(f"{at}.content", f"{why}: a string or a list of text parts")
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise unsupported(f"{at}.content[{j}]", f"only text parts are supported (got type {part.type!r})")
        if part.text is None:
            raise invalid(f"{at}.content[{j}].text", "required: a text part's string")
        texts.append(part.text)
    return {"role": m.role, "content": "\n".join(texts), **extra}


def _call_fields(at: str, m: MessageIn) -> dict[str, Any]:
    """A message's `tool_calls` (an assistant's) and `tool_call_id` (a tool's), as the native message takes them."""
    extra: dict[str, Any] = {}
    if m.tool_calls:
        if m.role != "assistant":
            raise invalid(f"{at}.tool_calls", "only an assistant's message makes tool calls")
        extra["tool_calls"] = _tools(lambda: message_calls(at, m.tool_calls or []))
    if m.tool_call_id is not None:
        extra["tool_call_id"] = m.tool_call_id
    elif m.role == "tool":  # as OpenAI: the template pairs a result with its call by this id
        raise invalid(f"{at}.tool_call_id", "required: the id of the tool call this message answers")
    return extra


def _tools(build: Callable[[], Any]) -> Any:
    try:
        return build()
    except ToolError as exc:
        raise (unsupported if exc.unsupported else invalid)(exc.param, exc.message) from None


def translate_chat(raw: Any, *, timeout_header: str | None = None,
                   parser_of: Callable[[str], str] | None = None) -> Translated:
    """`parser_of(model)`: the model's tool-call format, which `tool_choice` "auto" needs ("": none)."""
    req: ChatRequest = parse_request(raw, ChatRequest)
    _refuse_non_defaults(req, (*_COMMON_CHECKS, *_CHAT_CHECKS))
    max_param = "max_tokens"
    limit = req.max_tokens
    if req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise invalid("max_completion_tokens", "differs from max_tokens: give one of them")
        limit, max_param = req.max_completion_tokens, "max_completion_tokens"
    stream, usage, continuous = _stream_flags(req)
    top = None if req.top_logprobs is None else _top("top_logprobs", req.top_logprobs)
    if top and not req.logprobs:  # as OpenAI answers
        raise invalid("top_logprobs", "requires logprobs: true")
    logprobs = (top or 0) if req.logprobs else None
    messages = _messages(req.messages)
    # vLLM's `echo`: the answering role is the assistant's, or without a generation prompt the last message's own
    role = "assistant" if req.add_generation_prompt is not False else messages[-1]["role"]
    prefix = str(messages[-1]["content"]) if req.echo and messages[-1]["role"] == role else ""
    fmt, fmt_aliases = _constraint(req)
    parser = parser_of(req.model) if parser_of is not None and (req.tools or req.functions) else ""
    if req.functions is not None or req.function_call is not None:
        if req.tools is not None or req.tool_choice is not None:
            raise invalid("functions", "the deprecated functions and function_call, or tools and tool_choice: not both")
        tools, call_format, calls = _tools(lambda: legacy_plan(req.functions or [], req.function_call, parser))
    else:
        tools, call_format, calls = _tools(lambda: plan(req.tools, req.tool_choice, req.parallel_tool_calls, parser))
    if fmt is not None and (call_format is not None or calls is not None):  # a format leaves no room for a call
        raise invalid("function_call" if calls is not None and calls.legacy else "tool_choice",
                      f"calls are asked for: give no {next(iter(fmt_aliases.values()))} with them")
    if calls is not None and calls.parser and stream and logprobs is not None:
        raise unsupported("logprobs", "not with tools streamed under tool_choice 'auto' (text is held back until "
                                      "it is known not to be a call): ask without streaming")
    if call_format is not None:
        fmt, fmt_aliases = call_format, {"params.response_format": "tools", "params.response_format.schema": "tools"}
    inp: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {}),
                           **({"chat_template_kwargs": req.chat_template_kwargs} if req.chat_template_kwargs else {}),
                           **({"documents": req.documents} if req.documents else {}),
                           **({"chat_template": req.chat_template} if req.chat_template is not None else {})}
    for name in ("add_generation_prompt", "continue_final_message"):
        if getattr(req, name) is not None:
            inp[name] = getattr(req, name)
    body = {"input": inp, "params": _with_logprobs(_params(req, limit, fmt), logprobs),
            "stream": stream, **_deadline(req, timeout_header)}
    aliases = {"input": "messages", "input.messages": "messages", "params.max_new_tokens": max_param,
               "params.logprobs": "top_logprobs", "input.tools": "tools",
               "input.chat_template_kwargs": "chat_template_kwargs", "input.documents": "documents",
               "input.chat_template": "chat_template",
               "input.add_generation_prompt": "add_generation_prompt",
               "input.continue_final_message": "continue_final_message", **fmt_aliases,
               **_timeout_alias(req, timeout_header)}
    return Translated("chat", req.model, body, stream, usage, continuous, aliases=aliases, n=_choices(req),
                      logprobs=logprobs, calls=calls, as_ids=bool(req.return_tokens_as_token_ids), prefix=prefix,
                      with_ids=bool(req.return_token_ids))


def translate_embeddings(raw: Any, *, timeout_header: str | None = None) -> Translated:
    req: EmbeddingRequest = parse_request(raw, EmbeddingRequest)
    if req.dimensions is not None:
        raise unsupported("dimensions", "this model's vectors have a fixed size: leave dimensions out")
    if isinstance(req.input, str):
        texts = [req.input]
    elif req.input and all(isinstance(t, str) for t in req.input):
        texts = list(req.input)
    elif not req.input:
        raise invalid("input", "must not be empty")
    else:
        raise unsupported("input", "only text input (a string or a list of strings); token ids are not accepted")
    body = {"input": {"texts": texts}, **_deadline(req, timeout_header)}
    if req.truncate_prompt_tokens is not None:
        body["params"] = {"truncate_prompt_tokens": req.truncate_prompt_tokens}
    aliases = {"input.texts": "input", "input.text": "input", "input": "input",
               "params.truncate_prompt_tokens": "truncate_prompt_tokens", **_timeout_alias(req, timeout_header)}
    return Translated("embedding", req.model, body, encoding_format=req.encoding_format or "float",
                      aliases=aliases)


# ------------------------------------------------------------------------------------------- responses

_FINISH = {"length": "length", "eos": "stop", "stop": "stop"}


def result_error(view: dict[str, Any]) -> OpenAIError | None:
    """The error a terminal native result is for an OpenAI caller; None when it has an answer (a
    success, or a generation the deadline cut short after at least one token: see `finish_reason`)."""
    status = view.get("status")
    err = view.get("error") or {}
    code, message = err.get("code", status), err.get("message", f"the request {status}")
    if status == "succeeded" or (status == "expired" and _completion_tokens(view) > 0):
        return None
    if status == "expired":
        return OpenAIError(504, f"no output by the request's deadline: {message}", code=code, retry=False)
    if status == "cancelled":
        return OpenAIError(409, f"the request was cancelled: {message}", code=code, retry=False)
    if status == "failed" and code in TEXT_FAILURES:
        if code == "input_too_long" and view.get("task") in ("generate", "embed"):
            code = CONTEXT_EXCEEDED
        # the worker's hint names the native field: in the routes' terms (both take vLLM's truncate_prompt_tokens)
        _, message = in_openai_terms("", str(message), {"params.truncate_prompt_tokens": "truncate_prompt_tokens"})
        return OpenAIError(400, message, code=code, retry=False)
    return OpenAIError(500, f"the request failed: {message}", code=code or "failed", retry=False)


def _completion_tokens(view: dict[str, Any]) -> int:
    """The tokens a generation computed, as OpenAI and vLLM count them: those a stop string's cut left out of the
    output too (`generated_tokens`)."""
    output = view.get("output") or {}
    return int(output.get("generated_tokens") or output.get("completion_tokens") or len(output.get("token_ids") or ()))


def finish_reason(view: dict[str, Any]) -> str:
    """OpenAI's finish_reason for a native result: `eos` and `stop` are "stop", `length` is "length", and
    a generation the deadline cut short is "length" too (truncated; `batchgate.finish_reason` says why)."""
    return _FINISH.get(str(view.get("finish_reason")), "length" if view.get("status") == "expired" else "stop")


def extension(view: dict[str, Any]) -> dict[str, Any]:
    return {"request_id": view.get("id"), "status": view.get("status"), "finish_reason": view.get("finish_reason")}


def usage(view: dict[str, Any], *more: dict[str, Any]) -> dict[str, int]:
    """The tokens of a generation, or of the choices of one call (`more`: the others): one prompt, every output."""
    output = view.get("output") or {}
    prompt = int(output.get("prompt_tokens") or 0)
    completion = sum(_completion_tokens(v) for v in (view, *more))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_id(kind: Kind, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def completion_response(tr: Translated, views: list[dict[str, Any]], created: int) -> dict[str, Any]:
    """A finished generation as a `text_completion` or a `chat.completion`: one choice per view (`n`), each a
    request of its own; the first names the response. With `best_of`, the `n` candidates whose tokens are likeliest
    on average are the choices, best first (`usage` counts every candidate's tokens, as OpenAI bills them)."""
    every = views
    if tr.best_of > tr.n:
        views = sorted(views, key=_mean_logprob, reverse=True)[:tr.n]
    choices = []
    for i, view in enumerate(views):
        output = view.get("output") or {}
        text, entries = _echoed(tr, output) if tr.echo else (str(output.get("text", "")), output.get("logprobs"))
        reason = "length" if tr.score_only else finish_reason(view)  # max_tokens 0: nothing generated is kept
        choice: dict[str, Any] = {"index": i, "finish_reason": reason, "logprobs": None}
        if tr.logprobs is not None:
            choice["logprobs"] = openai_logprobs(tr.kind, entries, as_ids=tr.as_ids)
        content, made = answer(tr.calls, text, str(view.get("id"))) if tr.calls is not None else (text, None)
        if made is not None and tr.calls is not None:
            calls = {"function_call": made[0]["function"]} if tr.calls.legacy else {"tool_calls": made}
            content = tr.prefix + (content or "") if tr.prefix else content
            choice["message"] = {"role": "assistant", "content": content, "refusal": None, **calls}
            choice["finish_reason"] = finish(tr.calls, reason)
        elif tr.kind == "chat":
            choice["message"] = {"role": "assistant", "content": tr.prefix + text, "refusal": None}
        else:
            choice["text"] = text
        if tr.with_ids:  # vLLM's return_token_ids: a completion's choices carry the prompt's too, chat's response
            choice |= ({} if tr.kind == "chat" else {"prompt_token_ids": output.get("prompt_token_ids")}) | {
                "token_ids": list(output.get("token_ids") or ())}
        choices.append(choice)
    out = {"id": completion_id(tr.kind, str(every[0]["id"])),
           "object": "chat.completion" if tr.kind == "chat" else "text_completion",
           "created": created, "model": tr.model, "choices": choices,
           "usage": usage(*every) if not tr.score_only else usage(*[_prompt_only(v) for v in every]),
           "system_fingerprint": None, EXTENSION: extensions(views)}
    if tr.with_ids and tr.kind == "chat":
        out["prompt_token_ids"] = (views[0].get("output") or {}).get("prompt_token_ids")
    return out


def _mean_logprob(view: dict[str, Any]) -> float:
    scores = [e["logprob"] for e in (view.get("output") or {}).get("logprobs") or () if e["logprob"] is not None]
    return sum(scores) / len(scores) if scores else -math.inf


def _prompt_only(view: dict[str, Any]) -> dict[str, Any]:
    return {**view, "output": {**(view.get("output") or {}), "completion_tokens": 0, "token_ids": []}}


def _echoed(tr: Translated, output: dict[str, Any]) -> tuple[str, list[Any]]:
    """A completion with `echo`: the prompt (as sent, or as the worker decoded its token ids), then the completion
    (none when only the prompt was asked for, `max_tokens` 0); the log probabilities of both."""
    prompt = tr.prompt if tr.prompt is not None else str(output.get("prompt_text", ""))
    before = list(output.get("prompt_logprobs") or ())
    if tr.score_only:
        return prompt, before
    return prompt + str(output.get("text", "")), before + list(output.get("logprobs") or ())


def extensions(views: list[dict[str, Any]]) -> dict[str, Any]:
    """The batchgate fields of a response: its request's, and with several choices each choice's too."""
    first = extension(views[0])
    return first if len(views) == 1 else {**first, "choices": [extension(v) for v in views]}


@dataclass(slots=True)
class ChunkMaker:
    """The chunks of one streamed generation (all share its id, `created` and model)."""

    tr: Translated
    request_id: str
    created: int
    index: int = 0  # the choice the chunks are of
    chars: int = 0  # of the text, those sent so far (a completion's `text_offset` goes on from them)
    # a list of tool calls ("required"), or "auto" text from a call's tag on (or what may begin one): sent at the end
    held: str = ""
    own_id: str = ""  # the choice's own request (its tool calls' ids name it); "": `request_id`
    # continuous usage: the prompt's tokens (as the worker tells them) and the output's so far, and whether the
    # opening chunk (held until the prompt's tokens are known) was sent
    prompt_tokens: int = 0
    tokens: int = 0
    opened: bool = False
    # vLLM's return_token_ids: the prompt's ids (told with the first output), the output's not yet on a chunk, and
    # whether a completion's chunk carried the prompt's (chat's opening chunk carries them)
    prompt_ids: list[int] | None = None
    pending_ids: list[int] = field(default_factory=list)
    ids_told: bool = False

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": completion_id(self.tr.kind, self.request_id),
               "object": "chat.completion.chunk" if self.tr.kind == "chat" else "text_completion",
               "created": self.created, "model": self.tr.model, "choices": choices, "system_fingerprint": None}
        if self.tr.include_usage:
            out["usage"] = self._so_far(self.tokens) if self.tr.continuous_usage else None
        return {**out, **extra}

    def _so_far(self, tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens,
                "total_tokens": self.prompt_tokens + tokens}

    def _choice(self, content: str | None, role: bool = False, reason: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index, "finish_reason": reason, "logprobs": None}
        if self.tr.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if content is not None:
                delta["content"] = content
            choice["delta"] = delta
        else:
            choice["text"] = content or ""
        return choice

    @property
    def _deferred(self) -> bool:
        """The opening waits for the first output, which tells the prompt (continuous usage, token ids)."""
        return self.tr.continuous_usage or self.tr.with_ids

    def first(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role and empty content; completions have no such chunk. With
        continuous usage or token ids the opening waits for the first output, which tells the prompt's tokens (as
        vLLM's)."""
        if self.tr.kind != "chat" or self._deferred:
            return None
        self.opened = True
        return self._chunk([self._choice("", role=True)])

    def opening(self) -> list[dict[str, Any]]:
        """What a stream opens with: `first`, then with chat's `echo` the last message the answer begins with."""
        first = self.first()
        return [] if first is None else [first, *self._echo()]

    def _echo(self) -> list[dict[str, Any]]:
        """Chat's `echo`, once, after the opening chunk (which `opening` or `_opening` sends, once, never both)."""
        return [self._chunk([self._choice(self.tr.prefix)])] if self.tr.prefix else []

    def _opening(self) -> list[dict[str, Any]]:
        """The opening chunk held for continuous usage or token ids, once (its usage: the prompt's tokens, no output
        yet; its `prompt_token_ids`), and the echo after it."""
        if self.opened or self.tr.kind != "chat" or not self._deferred:
            return []
        self.opened = True
        extra: dict[str, Any] = {"usage": self._so_far(0)} if self.tr.continuous_usage else {}
        if self.tr.with_ids:
            extra["prompt_token_ids"] = self.prompt_ids
        return [self._chunk([self._choice("", role=True)], **extra), *self._echo()]

    def _told(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """`chunk` with the output's token ids not yet on a chunk (and a completion's first, the prompt's)."""
        if self.tr.with_ids and chunk["choices"]:
            choice = chunk["choices"][0]
            if not self.ids_told and self.tr.kind != "chat":
                choice["prompt_token_ids"], self.ids_told = self.prompt_ids, True
            choice["token_ids"], self.pending_ids = self.pending_ids, []
        return chunk

    def delta(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """A native delta event's chunks: none for one with no text nor log probabilities, or held back (with
        continuous usage or token ids, the opening chunk before the first)."""
        if isinstance(data.get("prompt_tokens"), int):
            self.prompt_tokens = data["prompt_tokens"]
        if self.prompt_ids is None and data.get("prompt_token_ids") is not None:
            self.prompt_ids = list(data["prompt_token_ids"])
        self.pending_ids += list(data.get("token_ids") or ()) if self.tr.with_ids else []
        out = self._opening()
        self.tokens = max(self.tokens, int(data.get("index") or 0) + len(data.get("token_ids") or ()))
        if not (data.get("text") or data.get("logprobs")):
            return out
        chunk = self.text(str(data["text"]), data.get("logprobs"))
        return out if chunk is None else [*out, self._told(chunk)]

    def text(self, text: str, logprobs: list[Any] | None = None) -> dict[str, Any] | None:
        """A delta's chunk; with `logprobs` asked for, its tokens' (`logprobs`: the delta's entries). A forced tool
        call streams its arguments as they come (the first chunk names the call); a list of calls is held back to
        the end (None), where it can be read whole."""
        if self.tr.calls is not None:
            if self.tr.calls.parser:
                return self._auto_text(text)
            if self.tr.calls.forced is None:
                self.held += text
                return None
            first = not self.chars
            self.chars += len(text) or 1
            function = {"name": self.tr.calls.forced, "arguments": text} if first else {"arguments": text}
            if self.tr.calls.legacy:
                return self._calls_chunk(function)
            call: dict[str, Any] = {"index": 0, "function": function}
            if first:
                call |= {"id": call_id(self.own_id or self.request_id, 0, self.tr.calls.short_ids), "type": "function"}
            return self._calls_chunk([call])
        choice = self._choice(text)
        if self.tr.logprobs is not None:
            choice["logprobs"] = openai_logprobs(self.tr.kind, logprobs, self.chars, self.tr.as_ids)
        self.chars += len(text)
        return self._chunk([choice])

    def _calls_chunk(self, calls: list[dict[str, Any]] | dict[str, Any]) -> dict[str, Any]:
        """A delta of `tool_calls` (a list), or of the deprecated `function_call` (one call's function)."""
        delta = {"tool_calls": calls} if isinstance(calls, list) else {"function_call": calls}
        return self._chunk([{"index": self.index, "finish_reason": None, "logprobs": None, "delta": delta}])

    def _auto_text(self, text: str) -> dict[str, Any] | None:
        """"auto": text streams as content until a call may begin (what may begin one is held back until it is
        known); from where calls begin, everything is held and read at the end."""
        assert self.tr.calls is not None
        self.held += text
        cut = streamable(self.tr.calls.parser, self.held, self.chars > 0)
        out, self.held = self.held[:cut], self.held[cut:]
        self.chars += len(out)
        return self._chunk([self._choice(out)]) if out else None

    def final(self, view: dict[str, Any], *, with_usage: bool = True) -> list[dict[str, Any]]:
        """The chunk with the finish_reason, then (with stream_options.include_usage, unless other choices are still
        to finish: `with_usage` false) the usage chunk."""
        counted = usage(view)
        self.prompt_tokens = counted["prompt_tokens"]
        if self.prompt_ids is None:
            self.prompt_ids = (view.get("output") or {}).get("prompt_token_ids")
        reason, out = finish_reason(view), self._opening()
        self.tokens = counted["completion_tokens"]
        if self.tr.calls is not None and self.tr.calls.forced is None:  # what was held, read whole
            content, made = answer(self.tr.calls, self.held, str(view.get("id")))
            if content:  # a list cut short, "auto" text that held no call: as a plain answer's
                out.append(self._chunk([self._choice(content)]))
            if made:
                out.append(self._calls_chunk(made[0]["function"] if self.tr.calls.legacy else
                                             [{"index": i, **call} for i, call in enumerate(made)]))
                reason = finish(self.tr.calls, reason)
        last = self._told(self._chunk([self._choice(None if self.tr.kind == "chat" else "", reason=reason)],
                                      **{EXTENSION: extension(view)}))
        if not (self.tr.include_usage and with_usage):
            return [*out, last]
        return [*out, last, self.usage_chunk([view])]

    def usage_chunk(self, views: list[dict[str, Any]]) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage of every choice."""
        return {**self._chunk([]), "usage": usage(*views)}


def float32_base64(vector: Sequence[float]) -> str:
    """A vector as OpenAI's `encoding_format: "base64"`: little-endian float32, base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_response(tr: Translated, view: dict[str, Any]) -> dict[str, Any]:
    output = view.get("output") or {}
    vectors = output.get("embeddings") or []
    encode: Callable[[list[float]], Any] = float32_base64 if tr.encoding_format == "base64" else list
    tokens = sum(int(n) for n in output.get("tokens") or ())
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "model": tr.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            EXTENSION: {"request_id": view.get("id"), "status": view.get("status"),
                        **({"truncated": output["truncated"]} if "truncated" in output else {})}}


def model_entry(name: str, created: int = 0, max_model_len: int | None = None) -> dict[str, Any]:
    """A model as OpenAI lists it (`GET /v1/models` `data`, `GET /v1/models/{model}`), with vLLM's `max_model_len`
    (prompt and output tokens together) where it is known."""
    entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY}
    if max_model_len is not None:
        entry["max_model_len"] = max_model_len
    return entry

