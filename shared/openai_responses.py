"""OpenAI's Responses API (`POST /v1/responses`), as the chat route serves it: a response's `input` (a string, or
items: messages, function calls and their outputs) and `instructions` become a conversation, its `text.format`
a response format and its function `tools` the chat route's; the chat completion that comes back becomes a response
(`output` items: a message with its `output_text`, and a `function_call` per call), and a stream of chat chunks
becomes the Responses API's typed events. Nothing is kept between calls: a conversation goes whole in each `input`
(`previous_response_id`, background responses and the built-in tools are refused by name)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from shared.openai_shapes import (
    EXTENSION,
    ChunkMaker,
    OpenAIError,
    Translated,
    completion_response,
    extensions,
    invalid,
    parse_request,
    translate_chat,
    unsupported,
)

_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


class TextOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["medium"] | None = None  # the default alone: the output's length is max_output_tokens's


class ResponseRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of `POST /v1/responses`: OpenAI's fields, then those of the chat route a response takes as they
    are (the deadline and priority of the native API, vLLM's sampling extensions)."""

    model: Annotated[str, Meta(min_length=1)]
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    text: TextOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # accepted: nothing is kept either way
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # refused where set: they need a response kept, or what is not served
    previous_response_id: str | None = None
    conversation: Any | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    prompt: Any | None = None
    # the chat route's extensions
    timeout_s: float | None = None
    priority: str | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


_PASSED = ("timeout_s", "priority", "seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "logit_bias", "stop_token_ids", "min_tokens", "ignore_eos", "skip_special_tokens",
           "include_stop_str_in_output", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "truncation_side",
           "chat_template_kwargs", "temperature", "top_p", "parallel_tool_calls", "user", "metadata", "store",
           "service_tier", "prompt_cache_key", "safety_identifier", "stream")


@dataclass(frozen=True, slots=True)
class ResponseCall:
    """A Responses API call translated: the chat route's (`chat`), and what its response echoes back."""

    chat: Translated
    echo: dict[str, Any] = field(default_factory=dict)


def translate_response(raw: Any, *, timeout_header: str | None = None,
                       parser_of: Callable[[str], str] | None = None) -> ResponseCall:
    """A `POST /v1/responses` body as the chat route's translation; its errors name the Responses API's
    parameters."""
    req: ResponseRequest = parse_request(raw, ResponseRequest)
    _refuse_state(req)
    chat: dict[str, Any] = {k: getattr(req, k) for k in _PASSED if getattr(req, k) is not None}
    chat["model"] = req.model
    chat["messages"] = [*_instructions(req.instructions), *_conversation(req.input)]
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.truncation == "auto":  # the conversation's start is dropped to fit
        chat.setdefault("truncate_prompt_tokens", -1)
    if req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or ()):
        chat["logprobs"], chat["top_logprobs"] = True, req.top_logprobs or 0
    if req.text is not None and (fmt := _format(req.text.format)) is not None:
        chat["response_format"] = fmt
    if req.tools is not None:
        chat["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    if req.stream_options is not None:
        chat["stream_options"] = {k: v for k, v in req.stream_options.items() if k != "include_obfuscation"}
    try:
        tr = translate_chat(chat, timeout_header=timeout_header, parser_of=parser_of)
    except OpenAIError as err:
        raise _renamed(err) from None
    tr.aliases.update({k: _rename(v) for k, v in tr.aliases.items()})
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": tr.body["params"].get("temperature"), "top_p": req.top_p if req.top_p is not None else 1.0,
            "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "truncation": req.truncation or "disabled", "user": req.user,
            "store": False, "previous_response_id": None, "reasoning": None, "background": False,
            "service_tier": req.service_tier or "default"}
    return ResponseCall(tr, echo)


def _refuse_state(req: ResponseRequest) -> None:
    """What needs a response kept (this gateway keeps none) or what it does not serve."""
    if req.previous_response_id is not None or req.conversation is not None:
        name = "previous_response_id" if req.previous_response_id is not None else "conversation"
        raise unsupported(name, "responses are not kept: send the whole conversation in input")
    if req.store:
        raise unsupported("store", "responses are not kept (only false)")
    if req.background:
        raise unsupported("background", "responses run in the foreground (for work that may wait, see /v1/batches)")
    if req.prompt is not None:
        raise unsupported("prompt", "stored prompt templates are not kept: send the instructions and input")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise unsupported("reasoning", "reasoning settings are not served: leave reasoning out")
    if set(req.include or ()) - {"message.output_text.logprobs"}:
        raise unsupported("include", "only message.output_text.logprobs (the text's token log probabilities, with "
                                     "top_logprobs); no built-in tools or reasoning items to include")
    if req.max_tool_calls is not None:
        raise unsupported("max_tool_calls", "not served: use parallel_tool_calls false for one call")


def _instructions(text: str | None) -> list[dict[str, Any]]:
    return [] if text is None else [{"role": "system", "content": text}]


def _conversation(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; items are messages (their text parts joined),
    function calls (an assistant message's tool calls, consecutive ones together) and their outputs (tool
    messages)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise invalid("input", "must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(where, item))
        elif kind == "function_call":
            call = {"id": _text(f"{where}.call_id", item.get("call_id")), "type": "function",
                    "function": {"name": _text(f"{where}.name", item.get("name")),
                                 "arguments": _arguments(f"{where}.arguments", item.get("arguments"))}}
            if out and out[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _text(f"{where}.call_id", item.get("call_id")),
                        "content": _joined(f"{where}.output", item.get("output"))})
        elif kind == "reasoning":
            continue  # a reasoning model's item sent back: no reasoning is served, nothing to render
        else:
            raise unsupported(f"{where}.type", f"{kind!r} items are not served (messages, function_call and "
                                               "function_call_output are)")
    return out


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
    return {"role": role, "content": _joined(f"{where}.content", item.get("content"))}


def _joined(where: str, content: Any) -> str:
    """A string, or text parts joined as the chat route joins them (by newlines)."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str) or kind not in _TEXT_PARTS:
                raise unsupported(f"{where}[{j}].type", f"{kind!r} parts are not served (text is)")
            texts.append(_text(f"{where}[{j}].text", part.get("text")))
        content = "\n".join(texts)
    return _text(where, content)


def _arguments(where: str, value: Any) -> str:
    """A call's arguments: a JSON object, as text (a chat template renders them as an object)."""
    text = _text(where, value)
    try:
        ok = isinstance(json.loads(text), dict)
    except ValueError:
        ok = False
    if not ok:
        raise invalid(where, "must be a JSON object, as text")
    return text


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(where, "must be a string")
    return value


def _format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat route's `response_format`."""
    if fmt is None:
        return None
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema", "required with type json_schema: a JSON Schema object")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise unsupported(f"tools[{i}].type", f"{tool.get('type')!r} tools are not served (function tools are)")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise unsupported("tool_choice", f"{choice.get('type')!r} is not served (auto, none, required or a "
                                         "function)")
    return choice


# chat's parameter names as a response's (a message's index is not an input item's: the input, without one)
_CHAT_PARAMS = ((re.compile(r"^messages(\[\d+\])?"), "input"), (re.compile(r"^max_tokens"), "max_output_tokens"),
                (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
                (re.compile(r"^tools(\[\d+\])\.function"), r"tools\1"), (re.compile(r"^logprobs"), "top_logprobs"),
                (re.compile(r"^tool_choice\.function"), "tool_choice"))


def _rename(param: str) -> str:
    for pattern, name in _CHAT_PARAMS:
        if pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


def _renamed(err: OpenAIError) -> OpenAIError:
    if not err.param:
        return err
    new = _rename(err.param)
    message = new + err.message[len(err.param):] if err.message.startswith(err.param) else err.message
    message = message.replace("response_format", "text.format")
    return OpenAIError(err.status, message, code=err.code, param=new, retry=err.retry, retry_after=err.retry_after,
                       headers=err._headers)


# ------------------------------------------------------------------------------------------- responses

# the error codes a Responses API client knows for a failed response: the caller's input, or the server's
_INPUT_FAILURES = frozenset({"invalid_input", "input_too_long", "no_chat_template", "context_length_exceeded"})


def response_id(request_id: str) -> str:
    return "resp_" + request_id


def response_object(call: ResponseCall, view: dict[str, Any], created: int) -> dict[str, Any]:
    """A finished generation as a Responses API `response`: a message item for its text (an empty one where it
    has neither text nor calls), a function_call item per call."""
    chat = completion_response(call.chat, [view], created)
    (choice,) = chat["choices"]
    message = choice["message"]
    request_id = str(view.get("id"))
    incomplete = choice["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    items: list[dict[str, Any]] = []
    if message.get("content") is not None and (message["content"] or not message.get("tool_calls")):
        items.append(message_item(request_id, message["content"], status, _logprobs(choice)))
    items += [call_item(request_id, i, made, status) for i, made in enumerate(message.get("tool_calls") or ())]
    return _response(call, request_id, created, items, chat["usage"], incomplete, view)


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's token log probabilities, as an output_text part holds them (the same entries)."""
    return list((choice.get("logprobs") or {}).get("content") or ())


def message_item(request_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + request_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def call_item(request_id: str, index: int, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A function_call item; `incomplete` where max_output_tokens cut it (its arguments as far as they got)."""
    return {"type": "function_call", "id": f"fc_{request_id}_{index}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def _response(call: ResponseCall, request_id: str, created: int, items: list[dict[str, Any]],
              usage: dict[str, int] | None, incomplete: bool, view: dict[str, Any] | None,
              status: str | None = None) -> dict[str, Any]:
    status = status or ("incomplete" if incomplete else "completed")
    finished = (view or {}).get("finished_at")
    out = {"id": response_id(request_id), "object": "response", "created_at": created, "status": status,
           "completed_at": int(finished) if status == "completed" and isinstance(finished, int | float) else None,
           "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
           "model": call.chat.model, "output": items, **call.echo,
           "usage": None if usage is None else {
               "input_tokens": usage["prompt_tokens"],
               "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
               "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": usage["total_tokens"]}}
    if view is not None:
        out[EXTENSION] = extensions([view])
    return out


@dataclass(slots=True)
class ResponseEvents:
    """The typed events of one streamed response, from the chat route's chunks of the same generation: the
    response created, its message item opened at its first text and its text deltas, each function call whole as
    the chat stream gives it, then each item done and the response completed (or incomplete); the items streamed
    are the final response's output, in the same order."""

    call: ResponseCall
    request_id: str
    created: int
    chunks: ChunkMaker = field(init=False)
    seq: int = 0
    text: str | None = None  # the message item's text so far; None: not opened
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # its tokens', where asked for
    items: list[dict[str, Any]] = field(default_factory=list)  # finished items, in order
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # a stream's tool calls by index

    def __post_init__(self) -> None:
        self.chunks = ChunkMaker(self.call.chat, self.request_id, self.created)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def first(self) -> list[dict[str, Any]]:
        pending = _response(self.call, self.request_id, self.created, [], None, False, None, status="in_progress")
        return [self._event("response.created", response=pending),
                self._event("response.in_progress", response=pending)]

    def delta(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for chunk in self.chunks.delta(data) for e in self._from_chunk(chunk)]

    def final(self, view: dict[str, Any]) -> list[dict[str, Any]]:
        out = [e for chunk in self.chunks.final(view, with_usage=False) for e in self._from_chunk(chunk)]
        done = response_object(self.call, view, self.created)
        status = done["status"]
        if self.text is None and not self.calls:  # no text and no call: an empty message, as unstreamed
            out += self._open()
        out += self._close_text(status)
        for i in sorted(self.calls):
            out += self._call_events(i, self.calls[i], status)
        done["output"] = list(self.items)
        return [*out, self._event(f"response.{status}", response=done)]

    def failed(self, error: OpenAIError) -> list[dict[str, Any]]:
        """The response failed (its request failed, expired before any output, or was cancelled): its error, and
        what was streamed of it."""
        out = self._close_text("incomplete")
        failed = _response(self.call, self.request_id, self.created, list(self.items), None, False, None,
                           status="failed")
        code = "invalid_prompt" if error.code in _INPUT_FAILURES else "server_error"
        failed["error"] = {"code": code, "message": f"{error.message} ({error.code or error.status})"}
        return [*out, self._event("response.failed", response=failed)]

    def _from_chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"], _logprobs(choice))
            for call in delta.get("tool_calls") or ():
                held = self.calls.setdefault(call["index"], {"id": "", "function": {"name": "", "arguments": ""}})
                held["id"] = call.get("id") or held["id"]
                fn = call.get("function") or {}
                held["function"]["name"] = fn.get("name") or held["function"]["name"]
                held["function"]["arguments"] += fn.get("arguments") or ""
        return out

    def _open(self) -> list[dict[str, Any]]:
        self.text, index = "", len(self.items)
        item = {**message_item(self.request_id, "", "in_progress"), "content": []}
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=index,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = self._open() if self.text is None else []
        self.text = (self.text or "") + text
        self.logprobs += logprobs
        return [*out, self._event("response.output_text.delta", item_id="msg_" + self.request_id,
                                  output_index=len(self.items), content_index=0, delta=text, logprobs=logprobs)]

    def _close_text(self, status: str) -> list[dict[str, Any]]:
        if self.text is None:
            return []
        index, item = len(self.items), message_item(self.request_id, self.text, status, self.logprobs)
        self.text = None
        part = item["content"][0]
        self.items.append(item)
        ids = {"item_id": item["id"], "output_index": index}
        return [self._event("response.output_text.done", **ids, content_index=0, text=part["text"],
                            logprobs=part["logprobs"]),
                self._event("response.content_part.done", **ids, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call_events(self, i: int, call: dict[str, Any], status: str) -> list[dict[str, Any]]:
        index, item = len(self.items), call_item(self.request_id, i, call, status)
        self.items.append(item)
        opened = {**item, "arguments": "", "status": "in_progress"}
        return [self._event("response.output_item.added", output_index=index, item=opened),
                self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"]),
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]
