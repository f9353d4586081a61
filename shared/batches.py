"""The Batch API's rules, pure: what a batch is, how an input line becomes a native request, what the
output and error files' lines say, and the batch object OpenAI's clients read.

A batch is a JSONL file of requests to one endpoint (`/v1/completions`, `/v1/chat/completions`,
`/v1/embeddings`, or a native `/v1/models/{model}/requests`), each line
`{"custom_id", "method": "POST", "url": <the endpoint>, "body": {...}}`. Its items run at batch priority
with the batch's completion window as their deadline (bounded by each model's `max_timeout_s`); the
runner (`gateway.batch_runner`) feeds them a bounded number at a time and writes one output or error line
per `custom_id`, exactly once.

Statuses as OpenAI defines them: validating -> failed | in_progress -> finalizing -> completed; expired
when the window ends first; cancelling -> cancelled.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared import openai_responses as oar
from shared import openai_shapes as oa
from shared import strict_json
from shared.ids import new_request_id
from shared.openai_tools import Calls

OPENAI_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")
NATIVE_ENDPOINT = re.compile(r"^/v1/models/([^/]+)/requests$")
MIN_WINDOW_S = 60.0
MAX_WINDOW_S = 7 * 86_400.0
MAX_CUSTOM_ID = 512
MAX_ERRORS_LISTED = 100  # a failed validation lists this many line errors (OpenAI lists some, not all)
MAX_METADATA = 16  # OpenAI: up to 16 key-value pairs, keys <= 64 and values <= 512 characters

TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
_WINDOW = re.compile(r"([0-9]{1,6})(s|m|h|d)")  # ASCII digits, the whole value (fullmatch): "24h\n" is no window
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


class BatchError(Exception):
    """A batch request (or one of its input lines) the API refuses: `code`, `message`, the field (`param`)."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None,
                 line: int | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.line = message, code, param, line

    def entry(self) -> dict[str, Any]:
        """As an entry of the batch's `errors.data` (lines numbered from 1, as editors do)."""
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": None if self.line is None else self.line + 1}


class BatchMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a batch is for: fixed at creation."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int  # epoch seconds, as OpenAI's batch object
    expires_at: int
    metadata: dict[str, str] | None = None
    callback_url: str | None = None  # batchgate's own: a signed webhook when the batch ends


def new_batch_id(now_ms: int) -> str:
    return "batch_" + new_request_id(now_ms).removeprefix("req_")


def window_seconds(window: Any) -> float:
    """A completion window ("24h", "30m", "2d", "90s") in seconds."""
    if window is None:
        raise BatchError('required: a duration such as "24h"', code="missing_required_parameter",
                         param="completion_window")
    m = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    if m is None:
        raise BatchError('must be a duration such as "24h" (units s, m, h, d)', param="completion_window")
    seconds = float(int(m.group(1)) * _UNIT_S[m.group(2)])
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise BatchError(f"must be between {MIN_WINDOW_S:g} s and {MAX_WINDOW_S / 86_400:g} days",
                         param="completion_window")
    return seconds


def check_endpoint(endpoint: Any) -> str:
    if isinstance(endpoint, str) and (endpoint in OPENAI_ENDPOINTS or NATIVE_ENDPOINT.match(endpoint)):
        return endpoint
    if endpoint is None:
        raise BatchError(f"required: one of {', '.join(OPENAI_ENDPOINTS)} or /v1/models/{{model}}/requests",
                         param="endpoint", code="missing_required_parameter")
    raise BatchError(f"must be one of {', '.join(OPENAI_ENDPOINTS)} or /v1/models/{{model}}/requests",
                     param="endpoint", code="invalid_endpoint")


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in metadata.items())):
        raise BatchError(f"at most {MAX_METADATA} string pairs (keys <= 64, values <= 512 characters)",
                         param="metadata")
    return dict(metadata)


@dataclass(frozen=True, slots=True)
class Item:
    """One input line, validated as far as it can be without the model: its native submit body and what its
    answer needs (the OpenAI shape to build it in)."""

    line: int  # 0-based
    custom_id: str
    model: str
    body: dict[str, Any]  # the native submit body (no deadline yet)
    kind: str  # "completion" | "chat" | "response" | "embedding" | "native"
    encoding_format: str = "float"
    aliases: dict[str, str] = field(default_factory=dict)  # native field -> the endpoint's parameter (OpenAI's)
    answer: Answer | None = None  # what its OpenAI answer shows beyond the output (log probabilities, echo)

    def param(self, native_field: str | None, message: str) -> tuple[str, str]:
        """A field of the native body the checks refused, and their message, as the line names them
        (`body.prompt` on /v1/completions, not `body.input.prompt`)."""
        if not native_field:
            return "body", message
        if self.kind == "native":
            return f"body.{native_field}", message
        param, message = oa.in_openai_terms(native_field, message, self.aliases)
        return f"body.{param or native_field}", message

    def ref(self, request_id: str, *, deadline: float = 0.0, offset: int = -1, attempt: int = 0) -> ItemRef:
        return ItemRef(self.line, self.custom_id, request_id, self.kind, self.model, self.encoding_format,
                       self.answer, deadline, offset, attempt)


class Answer(msgspec.Struct, frozen=True, array_like=True):
    """Of an OpenAI generation line, what its answer shows beyond the output (`Translated`'s fields of the same
    names): log probabilities, the echoed prompt, tool calls (`calls`: the answer is tool calls; `forced`: the
    function a named `tool_choice` forced)."""

    logprobs: int | None = None
    echo: bool = False
    prompt: str | None = None
    score_only: bool = False
    calls: bool = False
    forced: str | None = None
    # and the rest of its `Calls` (`shared.openai_tools`): the deprecated `functions`, "auto"'s parser, one call only,
    # the short ids of the model's template
    legacy: bool = False
    parser: str = ""
    single: bool = False
    short_ids: bool = False
    # a /v1/responses line's fields its response echoes back (instructions, tools, ...)
    response: dict[str, Any] | None = None


class ItemRef(msgspec.Struct, frozen=True, array_like=True):
    """An item in flight, as the batch's record keeps it: enough to write its line once it finishes."""

    line: int
    custom_id: str
    request_id: str
    kind: str
    model: str
    encoding_format: str = "float"
    answer: Answer | None = None  # a ref kept by a gateway of before has none (it refused what needs one)
    # what feeding it again needs (a ref kept by a runner of before has none: 0, -1): the deadline it was fed with
    # (epoch seconds), its line's byte offset in the input file, and which feeding of the line it is (0: the first)
    deadline: float = 0.0
    offset: int = -1
    attempt: int = 0


def item_key(batch_id: str, line: int, attempt: int) -> str:
    """The idempotency key of a line's request: a line fed again (its request expired before it ran, the window
    still open) is another request, under the key of its attempt. Its parts are joined by a control character, as
    `derived_key`'s are: no caller can send it (`batch:<id>:<line>` could be, and a caller's own request under it
    took the line's place)."""
    return f"batch\x1f{batch_id}\x1f{line}" + (f"\x1f{attempt}" if attempt else "")


_TRANSLATE = {"/v1/completions": oa.translate_completion, "/v1/chat/completions": oa.translate_chat,
              "/v1/embeddings": oa.translate_embeddings}


def _translate(endpoint: str, body: dict[str, Any],
               parser_of: Callable[[str], str] | None) -> tuple[oa.Translated, str, dict[str, Any] | None]:
    """A line's body as the native translation: (it, the item's kind, a response's echoed fields)."""
    if endpoint == "/v1/responses":  # served as a chat completion, answered as a response
        call = oar.translate_response(body, parser_of=parser_of)
        return call.chat, "response", call.echo
    translate = _TRANSLATE[endpoint]
    tr = translate(body, parser_of=parser_of) if translate is oa.translate_chat else translate(body)
    return tr, tr.kind, None


def _refuse_per_request_delivery(body: dict[str, Any], native: bool, line: int) -> None:
    """A batch's items answer in its output file: one cannot stream, nor (native) name a callback of its own."""
    if body.get("stream"):
        raise BatchError("a batch item cannot stream", code="invalid_request", param="body.stream", line=line)
    if native and body.get("callback") is not None:  # the batch's own callback_url tells of its end
        raise BatchError("a batch item has no callback of its own: give the batch a callback_url", line=line,
                         code="invalid_request", param="body.callback")


def parse_line(raw: bytes | str, line: int, endpoint: str, parser_of: Callable[[str], str] | None = None) -> Item:
    """An input line as an `Item`; `BatchError` (with the line) when it is not one. `parser_of(model)`: the model's
    tool-call format, which a chat line's `tool_choice` "auto" needs ("" or no `parser_of`: none)."""
    try:
        obj = strict_json.loads(raw)
    except (ValueError, RecursionError):
        raise BatchError("not a JSON object", code="invalid_json_line", line=line) from None
    if not isinstance(obj, dict):
        raise BatchError("not a JSON object", code="invalid_json_line", line=line)
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BatchError(f"unknown field {unknown[0]!r} (a line has custom_id, method, url, body)",
                         code="invalid_request", param=unknown[0], line=line)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID or not custom_id.isprintable():
        raise BatchError(f"custom_id must be 1-{MAX_CUSTOM_ID} printable characters", code="invalid_custom_id",
                         param="custom_id", line=line)
    if obj.get("method", "POST") != "POST":
        raise BatchError("method must be POST", code="invalid_method", param="method", line=line)
    if obj.get("url") != endpoint:
        raise BatchError(f"url must be the batch's endpoint {endpoint}", code="mismatched_url", param="url",
                         line=line)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BatchError("body must be a JSON object", code="invalid_body", param="body", line=line)
    native = NATIVE_ENDPOINT.match(endpoint)
    _refuse_per_request_delivery(body, bool(native), line)
    if native:
        inner = {k: v for k, v in body.items() if k not in ("timeout_s", "deadline", "priority")}
        return Item(line, custom_id, native.group(1), inner, "native")
    try:  # its own priority and timeout are replaced by the batch's: whatever they hold is not this line's fault
        tr, kind, echo = _translate(endpoint, {k: v for k, v in body.items() if k not in ("timeout_s", "priority")},
                                    parser_of)
    except oa.OpenAIError as err:
        raise BatchError(err.message, code=err.code or "invalid_request",
                         param=f"body.{err.param}" if err.param else "body", line=line) from None
    if tr.requests > 1:  # a line is one request, with one result line
        raise BatchError("a batch item has one choice (n=1, best_of=1): write a line per choice",
                         code="unsupported_parameter", param="body.n" if tr.n > 1 else "body.best_of", line=line)
    inner = {k: v for k, v in tr.body.items() if k not in ("timeout_s", "deadline", "priority", "stream")}
    c = tr.calls
    answer = Answer(tr.logprobs, tr.echo, tr.prompt, tr.score_only, c is not None, c.forced if c else None,
                    *((c.legacy, c.parser, c.single, c.short_ids) if c else (False, "", False, False)), echo)
    return Item(line, custom_id, tr.model, inner, kind, tr.encoding_format, tr.aliases,
                answer if answer != Answer() else None)


def submit_body(item: Item, deadline_s: float) -> dict[str, Any]:
    """The native submit body of an item: batch priority, the given deadline (epoch seconds)."""
    return {**item.body, "priority": "batch", "deadline": deadline_s}


def _response_body(ref: ItemRef, view: dict[str, Any], created: int) -> dict[str, Any]:
    if ref.kind == "native":
        return view
    a = ref.answer or Answer()
    kind = "chat" if ref.kind == "response" else ref.kind
    tr = oa.Translated(kind=kind, model=ref.model, body={}, encoding_format=ref.encoding_format,  # type: ignore[arg-type]
                       logprobs=a.logprobs, echo=a.echo, prompt=a.prompt, score_only=a.score_only,
                       calls=Calls(a.forced, a.parser, a.single, a.short_ids, a.legacy) if a.calls else None)
    if ref.kind == "embedding":
        return oa.embedding_response(tr, view)
    if ref.kind == "response":
        return oar.response_object(oar.ResponseCall(tr, a.response or {}), view, created)
    return oa.completion_response(tr, [view], created)


@dataclass(frozen=True, slots=True)
class Written:
    """A finished item's line: in the output file (`ok`) or the error file; `expired`: a `batch_expired` line (the
    batch then ends `expired`, as OpenAI ends a batch whose window left requests undone); `tokens`: the prompt and
    output tokens it computed (the batch's `usage`)."""

    ok: bool
    line: dict[str, Any]
    expired: bool = False
    tokens: tuple[int, int] = (0, 0)


WINDOW_ENDED = "the batch's completion window ended before this request ran"


def result_line(ref: ItemRef, view: dict[str, Any], created: int, ending: str | None = None, *,
                expires_at: float = float("inf"), now: float = 0.0) -> Written | None:
    """A finished item's line, or None when it must be fed again: its request expired before it ran, with the
    batch's window still open (its deadline was the model's `max_timeout_s`, not the window's end: a worker
    away, or busy, for that long).

    - The window's end (the item's deadline was the window's, or the batch is ending `expired`) leaves a request
      that never ran, or expired with no output, `batch_expired`, as OpenAI answers what its window left.
    - The batch's cancel leaves what it cancelled before it ran `batch_cancelled` (what was running finishes and
      is written; one that started as it was cancelled is written as it ended, its output kept).
    - Otherwise the line is what the endpoint answered: the OpenAI response, or its error with the status the
      interactive route gives (a native endpoint's too: 409 cancelled, 504 expired with no output, 400 a text it
      cannot take, 500 a failure); a generation its deadline cut after some output is an answer (`length`)."""
    line_id = "batch_req_" + ref.request_id.removeprefix("req_")
    status = view.get("status")
    never_ran = view.get("started_at") is None
    oa_err = oa.result_error(view)
    window_ended = ending == "expired" or now >= expires_at or (ref.deadline and ref.deadline >= expires_at)
    if status == "cancelled" and never_ran and ending != "expired":  # the batch's cancel (or one of its own)
        return Written(False, refused_line(ref.custom_id, "batch_cancelled", "cancelled before this request ran",
                                           line_id=line_id))
    if (status == "expired" and oa_err is not None) or (status == "cancelled" and never_ran and ending == "expired"):
        if window_ended:
            return Written(False, refused_line(ref.custom_id, "batch_expired", WINDOW_ENDED, line_id=line_id),
                           expired=True)
        if never_ran:
            return None  # fed again, with the deadline the window still allows
    if oa_err is None:
        ok, status_code, body = True, 200, _response_body(ref, view, created)
    elif ref.kind == "native":  # the status the interactive route gives; the code and message as the record has them
        ok, status_code = False, oa_err.status
        body = _error_body(status_code, view.get("error") or {"code": status, "message": f"the request {status}"})
    else:
        ok, status_code = False, oa_err.status
        body = _error_body(status_code, {"code": oa_err.code, "message": oa_err.message})
    # as OpenAI writes them: a line with an HTTP response has its error in the response's body, `error` null
    return Written(ok, {"id": line_id, "custom_id": ref.custom_id,
                        "response": {"status_code": status_code, "request_id": ref.request_id, "body": body},
                        "error": None}, tokens=tokens_of(view))


def tokens_of(view: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, output tokens) a finished request computed, as its answer's usage counts them."""
    output = view.get("output") or {}
    if "tokens" in output:  # an embedding: each text's tokens
        return sum(int(n) for n in output.get("tokens") or ()), 0
    usage = oa.usage(view)
    return usage["prompt_tokens"], usage["completion_tokens"]


def _error_body(status: int, err: dict[str, Any]) -> dict[str, Any]:
    """An error response's body in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`)."""
    return oa.OpenAIError(status, str(err.get("message", "")), code=err.get("code")).body()


def refused_line(custom_id: str | None, code: str, message: str, status: int | None = None, *,
                 line_id: str) -> dict[str, Any]:
    """The error line of an item that never ran: refused at submit (`status`: the HTTP answer it got, in
    `response`, `error` null), or never sent (the window ended, the batch was cancelled: `response` null, the
    reason in `error`), as OpenAI writes both. `line_id`: the line's `batch_req_` id (`refused_line_id`)."""
    if status is None:
        return {"id": line_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
    return {"id": line_id, "custom_id": custom_id, "error": None, "response": {
        "status_code": status, "request_id": None, "body": _error_body(status, {"code": code, "message": message})}}


def refused_line_id(batch_id: str, line: int) -> str:
    """The id of a line that never had a request (its own request's id names the others)."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


@dataclass(slots=True)
class Progress:
    """What changes as a batch runs (kept beside its `BatchMeta`)."""

    status: str = "validating"
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at, finalizing_at, completed_at, ...
    model: str | None = None  # the model every line names (None: not validated yet, or lines name several)
    input_tokens: int = 0  # what the written lines computed
    output_tokens: int = 0


def batch_object(meta: BatchMeta, p: Progress) -> dict[str, Any]:
    """The batch as OpenAI's `Batch` object."""
    t = p.times
    return {
        "id": meta.id, "object": "batch", "endpoint": meta.endpoint,
        "errors": {"object": "list", "data": p.errors} if p.errors else None,
        "input_file_id": meta.input_file_id, "completion_window": meta.completion_window, "status": p.status,
        "output_file_id": p.output_file_id, "error_file_id": p.error_file_id, "created_at": meta.created_at,
        "in_progress_at": t.get("in_progress_at"), "expires_at": meta.expires_at,
        "finalizing_at": t.get("finalizing_at"), "completed_at": t.get("completed_at"),
        "failed_at": t.get("failed_at"), "expired_at": t.get("expired_at"), "cancelling_at": t.get("cancelling_at"),
        "cancelled_at": t.get("cancelled_at"),
        # a batch cancelled while validated has no total until it ends (then the lines it answered): never less
        # than the lines answered so far (its `failed` rose past a `total` of 0)
        "request_counts": {"total": max(p.total, p.completed + p.failed), "completed": p.completed,
                           "failed": p.failed},
        "metadata": meta.metadata, "model": p.model,
        "usage": {"input_tokens": p.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": p.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": p.input_tokens + p.output_tokens},
    }
