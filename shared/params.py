"""What a request asks for, per task: its `input` and `params`, as schema types (msgspec Structs).

The types are the rule: `shared.validation.convert` checks a body against them, and the OpenAPI
document is generated from them. Model-dependent limits (a model's `max_new_tokens`, prompt length,
texts per request) cannot be written in a type; they are checked right after, in the functions below.
The gateway validates once at submit and puts the normalised dicts on the wire; the worker builds its
typed params once from them: `GenerateParams(**req.params)` (a list `stop` becomes a tuple).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from shared.errors import ValidationError
from shared.model_context import CONTEXT_EXCEEDED
from shared.structured_output import ResponseFormat, checked, from_wire
from shared.validation import convert

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_LENGTH = 64
MAX_SEED = 2**63 - 1
MIN_TOP_P = 1e-6  # the smallest nucleus: the likeliest token alone
MAX_TOKEN_ID = 2**31 - 1
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range, [-2, 2]
MIN_REPETITION_PENALTY = 0.01  # below, a float32 logit divided by it overflows
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 1024  # tokens a request may bias
MAX_BIAS = 100.0  # OpenAI's range, [-100, 100]: -100 bans a token, 100 all but forces it
MAX_TOP_LOGPROBS = 20  # OpenAI's chat top_logprobs range, [0, 20]
MAX_ALLOWED_TOKEN_IDS = 65_536  # tokens a request may restrict its output to
MAX_BAD_WORDS = 128  # vLLM's own bound (its GPU model runner's MAX_NUM_BAD_WORDS)
MAX_BAD_WORD_LENGTH = 256
# the sampling fields a request sets only to change them: on the wire only where set (a worker of the release
# before them serves every request that leaves them out)
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")

NonEmptyStr = Annotated[str, Meta(min_length=1)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LENGTH)]
BadWord = Annotated[str, Meta(min_length=1, max_length=MAX_BAD_WORD_LENGTH)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
# lists of short values: an error on one item is reported at the list ("params.stop: item 0: ...")
ITEM_LISTS = ("params.stop", "params.stop_token_ids", "params.allowed_token_ids", "params.bad_words", "input.input_ids")


def finite_number(value: Any) -> float | None:
    """The value as a finite float, or None if it is not a number, a bool, infinite, NaN or too large."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def check_kept_tokens(t: int | None, limit: int, what: str) -> None:
    """A `truncate_prompt_tokens` keeps what the model can take: 1 to `limit` (`what`, as the error names it), or -1
    (that limit); None: no cut."""
    if t is not None and (t == 0 or t > limit):
        raise ValidationError("params.truncate_prompt_tokens", f"must be between 1 and this model's {what}, or -1 "
                                                               f"(that limit); got {t}")


class GenerateParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sampling and stopping for a generation (`params` of a generate request)."""

    max_new_tokens: Annotated[int, Meta(ge=1, description="at most the model's max_new_tokens; "
                                                          "default: the model's default")] = 64
    temperature: Annotated[float, Meta(ge=0.0, le=10.0, description="0: greedy")] = 0.0
    top_p: Annotated[float, Meta(ge=MIN_TOP_P, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=1_000_000, description="0: off")] | None = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0, description=(
        "drop the tokens less likely than this fraction of the likeliest one, after temperature (vLLM's min_p); "
        "0: off"))] = 0.0
    seed: Annotated[int, Meta(ge=0, le=MAX_SEED)] | None = None
    stop: Annotated[tuple[StopString, ...], Meta(max_length=MAX_STOP_STRINGS)] | StopString = ()
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, description=(
        "the fewest tokens the output holds: until then the model's EOS and stop_token_ids are not drawn and a stop "
        "string ends it only where it completes past them (vLLM's min_tokens); at most max_new_tokens, and a "
        "default max_new_tokens grows to it; a structured output still ends once complete; 0: off"))] = 0
    skip_special_tokens: Annotated[bool, Meta(description=(
        "leave the tokenizer's special tokens out of the text (vLLM's and transformers' skip_special_tokens); "
        "false: they are spelled in it (the EOS or stop token that ends it only with include_stop_str_in_output)"))
    ] = True
    include_stop_str_in_output: Annotated[bool, Meta(description=(
        "the text goes on to the end of the stop string that ended it, or holds the stop token's text (vLLM's "
        "include_stop_str_in_output); false: it ends before them"))] = False
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_STOP_TOKEN_IDS, description=(
        "tokens that end the output where one is drawn, finish_reason stop, its id kept in token_ids and its text "
        "not (vLLM's stop_token_ids); ignore_eos leaves them in force"))] = ()
    allowed_token_ids: Annotated[tuple[TokenId, ...], Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
                                                          description=(
        "the only tokens the output may hold: every other token's logit is -inf before the penalties and sampling "
        "(vLLM's allowed_token_ids); leave the EOS out and the output runs to max_new_tokens or a stop; with "
        "response_format, a format that can only go on through a token left out fails the request; null: off"))
    ] | None = None
    bad_words: Annotated[tuple[BadWord, ...], Meta(max_length=MAX_BAD_WORDS, description=(
        "words banned as vLLM bans them (bad_words): each is tokenized as it is and after a space, and where the "
        "output holds all of such a token sequence but its last token, that token is banned (a word the model "
        "spells with other tokens gets through)"))] = ()
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description=(
        "keep only the prompt's last this many tokens (vLLM's truncate_prompt_tokens: the start of a long prompt, or "
        "of a conversation as its template renders it, is cut); -1: the most the model takes; at most that; null: "
        "no cut (a prompt longer than the model takes is refused)"))] | None = None
    truncation_side: Annotated[Literal["left", "right"], Meta(description=(
        "which end of the prompt truncate_prompt_tokens keeps (vLLM's): left cuts the start and keeps its last "
        "tokens, right keeps its first"))] = "left"
    presence_penalty: Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY, description=(
        "subtracted from the logit of every token the output holds so far (OpenAI's presence_penalty)"))] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY, description=(
        "subtracted from a token's logit once per time the output holds it so far (OpenAI's frequency_penalty)"))
    ] = 0.0
    repetition_penalty: Annotated[float, Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, description=(
        "divides the positive logits (multiplies the negative ones) of every token of the prompt and output so "
        "far, as transformers' generate does; 1: off; default: the model's generation_config"))] | None = None
    logit_bias: Annotated[dict[TokenId, Annotated[float, Meta(ge=-MAX_BIAS, le=MAX_BIAS)]], Meta(
        max_length=MAX_LOGIT_BIAS, extra_json_schema={"propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"}},
        description="token id -> added to its logit before the penalties and sampling "
                                               "(OpenAI's logit_bias; -100 bans a token)")] = msgspec.field(
        default_factory=dict)
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS, description=(
        "return each output token's log probability under the model (its raw logits: before temperature, "
        "penalties and bias) and this many likeliest alternatives; null: none"))] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS, description=(
        "return each prompt token's log probability given the tokens before it (the first: null) and this many "
        "likeliest alternatives, with the prompt's token ids and text; null: none"))] | None = None
    echo: Annotated[bool, Meta(description="return the prompt's token ids and text with the output")] = False
    response_format: Annotated[ResponseFormat, Meta(description=(
        "constrain the output to a JSON Schema, any JSON object, a regular expression, one of a list of strings or "
        "a grammar (Lark or GBNF); the output stops when it is complete (finish_reason stop); null: free text"))
    ] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.stop, tuple):  # one string, or a list from the wire dict
            msgspec.structs.force_setattr(self, "stop", (self.stop,) if isinstance(self.stop, str)
                                          else tuple(self.stop))
        if self.top_k is None:
            msgspec.structs.force_setattr(self, "top_k", 0)
        for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):  # a list from the wire dict
            if isinstance(value := getattr(self, name), list):
                msgspec.structs.force_setattr(self, name, tuple(value))
        if any(isinstance(k, str) for k in self.logit_bias):  # the wire's JSON spells the ids as strings
            msgspec.structs.force_setattr(self, "logit_bias", {int(k): v for k, v in self.logit_bias.items()})
        if isinstance(self.response_format, dict):  # the wire's dict
            msgspec.structs.force_setattr(self, "response_format", from_wire(self.response_format))

    def bias_beyond(self, vocab: int | None) -> int | None:
        """The smallest `logit_bias` token id that is not in a vocabulary of `vocab` tokens (None: all are, or the
        size is unknown)."""
        return min((t for t in self.logit_bias if t >= vocab), default=None) if vocab is not None else None

    def stop_beyond(self, vocab: int | None) -> int | None:
        """The first `stop_token_ids` id that is not in a vocabulary of `vocab` tokens (None: all are, or unknown)."""
        return next((t for t in self.stop_token_ids if t >= vocab), None) if vocab is not None else None

    def allowed_beyond(self, vocab: int | None) -> int | None:
        """The first `allowed_token_ids` id that is not in a vocabulary of `vocab` tokens (None: all are, or
        unknown)."""
        if vocab is None or self.allowed_token_ids is None:
            return None
        return next((t for t in self.allowed_token_ids if t >= vocab), None)

    def outside_vocabulary(self, vocab: int | None) -> tuple[str, int] | None:
        """(field, token id) of the first of `logit_bias`, `stop_token_ids` and `allowed_token_ids` to name a token
        outside a vocabulary of `vocab` tokens; None: none does, or the size is unknown."""
        for field, bad in (("logit_bias", self.bias_beyond(vocab)), ("stop_token_ids", self.stop_beyond(vocab)),
                           ("allowed_token_ids", self.allowed_beyond(vocab))):
            if bad is not None:
                return field, bad
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        out = msgspec.structs.asdict(self)
        out["stop"] = list(self.stop)
        for name in PENALTY_FIELDS:
            if not out[name]:  # None, 0 or {}: the default (a repetition penalty is at least 0.01)
                del out[name]
        if out["skip_special_tokens"]:  # the default: left out (a worker that predates it reads it as before)
            del out["skip_special_tokens"]
        for name in ("logprobs", "prompt_logprobs", "echo", "response_format", "include_stop_str_in_output",
                     "allowed_token_ids", "truncate_prompt_tokens"):
            if out[name] is None or out[name] is False:  # left out as the penalties are (0 is a count: kept)
                del out[name]
        if out["truncation_side"] == "left":  # the default: left out (a worker that predates it reads it as before)
            del out["truncation_side"]
        for name in ("min_p", "stop_token_ids", "min_tokens", "bad_words"):  # off: left out, so a worker that
            # predates them reads it as before
            if not out[name]:
                del out[name]
        for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
            if name in out:
                out[name] = list(out[name])
        if self.response_format is not None:
            out["response_format"] = msgspec.to_builtins(self.response_format)
        return out

    def within(self, *, given: bool, limit: int, default_max_new_tokens: int) -> GenerateParams:
        """These params under a model's limits: its default `max_new_tokens` (at least `min_tokens`) unless `given`,
        at most `limit`; `min_tokens` at most `max_new_tokens`."""
        if not given:
            params = msgspec.structs.replace(
                self, max_new_tokens=min(max(default_max_new_tokens, self.min_tokens), limit))
        elif self.max_new_tokens > limit:
            raise ValidationError("params.max_new_tokens",
                                  f"must be between 1 and {limit} for this model, got {self.max_new_tokens}")
        else:
            params = self
        if params.min_tokens > params.max_new_tokens:
            bound = (f"the new tokens asked for ({params.max_new_tokens})" if given
                     else f"this model's limit of {limit} new tokens")
            raise ValidationError("params.min_tokens", f"must be at most {bound}, got {params.min_tokens}")
        return params

    def prompt_kept(self, max_input_tokens: int, context: int | None = None) -> int | None:
        """How many of a prompt's last tokens it keeps (`truncate_prompt_tokens`; -1: the most the model takes, its
        prompt limit and, where its `context` is known, what that leaves beside `max_new_tokens`); None: all."""
        t = self.truncate_prompt_tokens
        if t != -1:
            return t
        return max_input_tokens if context is None else max(1, min(max_input_tokens, context - self.max_new_tokens))

    def cut_prompt(self, ids: list[int], max_input_tokens: int, context: int | None = None) -> list[int]:
        """A prompt's token ids as the model reads them: its last `prompt_kept` (left truncation, vLLM's default
        for generation), or its first (`truncation_side` right)."""
        keep = self.prompt_kept(max_input_tokens, context)
        if keep is None or len(ids) <= keep:
            return ids
        return ids[:keep] if self.truncation_side == "right" else ids[len(ids) - keep:]

    def check_truncation(self, max_input_tokens: int) -> None:
        """`truncate_prompt_tokens` keeps a prompt the model can take: 1 to its prompt limit, or -1."""
        check_kept_tokens(self.truncate_prompt_tokens, max_input_tokens, f"prompt limit of {max_input_tokens} tokens")

    def check_format(self) -> None:
        """A `response_format` that cannot constrain anything (a schema or pattern llguidance cannot compile) is
        refused now, where llguidance is installed (else the worker refuses it)."""
        if self.response_format is not None:
            checked(self.response_format)

    @classmethod
    def parse(cls, raw: Any, *, limit: int, default_max_new_tokens: int) -> GenerateParams:
        raw = {} if raw is None else raw
        params = convert(raw, cls, "params", item_lists=ITEM_LISTS)
        params.check_format()
        return params.within(given="max_new_tokens" in raw, limit=limit, default_max_new_tokens=default_max_new_tokens)


class EmbedParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`params` of an embed request."""

    normalize: bool = True
    truncate: Annotated[bool, Meta(description="cut texts longer than the model takes (the result's `truncated` "
                                               "says which); false: such a text is refused (422)")] = False
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description=(
        "cut each text to its first this many tokens, special tokens included (vLLM's truncate_prompt_tokens on "
        "embeddings; the result's `truncated` says which were cut); -1: the most the model takes; null: off"))
    ] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = msgspec.structs.asdict(self)
        if out["truncate_prompt_tokens"] is None:  # off: left out, so a worker that predates it reads it as before
            del out["truncate_prompt_tokens"]
        return out

    def cuts(self) -> bool:
        """Texts longer than the model takes are cut, not refused (`truncate` or `truncate_prompt_tokens`)."""
        return self.truncate or self.truncate_prompt_tokens is not None

    def text_tokens(self, cap: int) -> int:
        """The most tokens a text keeps under a model that takes `cap` per text."""
        t = self.truncate_prompt_tokens
        return cap if t is None or t == -1 else min(t, cap)

    def check_truncation(self, cap: int) -> None:
        check_kept_tokens(self.truncate_prompt_tokens, cap, f"{cap} tokens per text")

    @classmethod
    def parse(cls, raw: Any) -> EmbedParams:
        return convert({} if raw is None else raw, cls, "params")


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
MAX_MESSAGES = 2048  # as OpenAI's chat completions take


MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32
MAX_DOCUMENTS = 64
MAX_TEMPLATE_CHARS = 65_536
# how a text longer than an embedding model takes is cut instead of refused (`params.truncate` too, natively)
TRUNCATE_HINT = ("(or set params.truncate_prompt_tokens to cut it: -1 keeps what the model takes, reported in the "
                 "result)")
# what `apply_chat_template` takes as its own arguments, and what the template is rendered with already: a
# template variable of one of these names cannot be set by a request
RESERVED_TEMPLATE_NAMES = frozenset({
    "self", "messages", "conversation", "conversations", "tools", "documents", "sanitize_control_tokens",
    "chat_template", "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs", "kwargs", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
    "mask_token", "additional_special_tokens",
    # the template's own functions (transformers' and jinja2's globals)
    "raise_exception", "strftime_now", "namespace", "dict", "range", "lipsum", "cycler", "joiner"})
TEMPLATE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
FunctionName = Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]{1,64}$", description="OpenAI's function names")]


class CalledFunction(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: FunctionName
    arguments: dict[str, Any]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A call an assistant message made (the chat template renders it, as transformers' templates take it; its
    fields in OpenAI's order, which a template that dumps it as JSON shows)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: FunctionName
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)  # a JSON Schema of its arguments


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A function the model is told it may call (rendered by the chat template: its `tools`, in transformers'
    shape and order)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One message of a conversation; the worker renders the list with the model's chat template. An assistant's
    message may carry the `tool_calls` it made, a tool's the `tool_call_id` it answers."""

    role: ChatRole
    content: str
    tool_calls: Annotated[list[ToolCall], Meta(min_length=1)] | UnsetType = UNSET
    tool_call_id: str | UnsetType = UNSET

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if isinstance(self.tool_calls, list):
            out["tool_calls"] = [msgspec.to_builtins(c) for c in self.tool_calls]
        if isinstance(self.tool_call_id, str):
            out["tool_call_id"] = self.tool_call_id
        return out


class GenerateInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Exactly one of `prompt` (text), `input_ids` (token ids) or `messages` (a conversation, rendered with
    the model's chat template, ending with the assistant's turn to speak; with it, `tools`: the functions the
    template tells the model of)."""

    prompt: NonEmptyStr | UnsetType = UNSET
    input_ids: Annotated[list[TokenId], Meta(min_length=1)] | UnsetType = UNSET
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)] | UnsetType = UNSET
    tools: Annotated[list[ToolSpec], Meta(max_length=MAX_TOOLS)] | UnsetType = UNSET
    chat_template_kwargs: Annotated[dict[str, Any], Meta(max_length=MAX_TEMPLATE_KWARGS, extra_json_schema={
        "propertyNames": {"pattern": f"^{TEMPLATE_NAME.pattern}$", "not": {"enum": sorted(RESERVED_TEMPLATE_NAMES)}}},
        description=(
        "variables the chat template is rendered with besides the conversation (vLLM's `chat_template_kwargs`), "
        "e.g. {\"enable_thinking\": false} for Qwen3's; null: none"))] | UnsetType | None = UNSET
    documents: Annotated[list[dict[str, str]], Meta(max_length=MAX_DOCUMENTS, description=(
        "documents a retrieval-augmented chat template shows the model (transformers' and vLLM's `documents`: "
        "each a dict of strings, usually `title` and `text`); a template that does not read them leaves them "
        "out"))] | UnsetType | None = UNSET
    chat_template: Annotated[str, Meta(min_length=1, max_length=MAX_TEMPLATE_CHARS, description=(
        "a Jinja chat template to render this conversation with instead of the model's (vLLM's request field): "
        "only for a model whose file sets trust_request_chat_template"))] | UnsetType | None = UNSET
    add_generation_prompt: Annotated[bool, Meta(description=(
        "render the template's opening of the assistant's turn after the conversation (transformers' and vLLM's "
        "add_generation_prompt); false: the rendering ends with the last message"))] = True
    continue_final_message: Annotated[bool, Meta(description=(
        "the model goes on with the last message (an answer begun for it) instead of starting a new one: the "
        "rendering ends inside it, with no end of turn after it (transformers' and vLLM's continue_final_message); "
        "with add_generation_prompt false"))] = False

    def normalised(self, *, max_prompt_chars: int | None, max_input_tokens: int | None,
                   templates_trusted: bool = False) -> dict[str, Any]:
        """The wire form, {"prompt"}, {"input_ids"} or {"messages"}, under a model's limits (None: unbounded, a
        prompt the worker truncates: the body's size bounds it); `templates_trusted`: the model takes a request's
        own chat template."""
        given = [name for name in ("prompt", "input_ids", "messages") if getattr(self, name) is not UNSET]
        self._check_template_options(chat=given == ["messages"], trusted=templates_trusted)
        if given == ["prompt"] and isinstance(self.prompt, str):
            if max_prompt_chars is not None and len(self.prompt) > max_prompt_chars:
                raise ValidationError("input.prompt", f"longer than {max_prompt_chars} characters",
                                      code=CONTEXT_EXCEEDED)
            return {"prompt": self.prompt}
        if given == ["input_ids"] and isinstance(self.input_ids, list):
            if max_input_tokens is not None and len(self.input_ids) > max_input_tokens:
                raise ValidationError("input.input_ids", f"more than {max_input_tokens} tokens",
                                      code=CONTEXT_EXCEEDED)
            return {"input_ids": self.input_ids}
        if given == ["messages"] and isinstance(self.messages, list):
            out = self._chat_wire(self.messages)
            extra = [out.get("tools"), out.get("chat_template_kwargs"), out.get("documents"),
                     *(m.get("tool_calls") for m in out["messages"])]
            chars = sum(len(m.content) for m in self.messages) + sum(len(json.dumps(x)) for x in extra if x)
            if max_prompt_chars is not None and chars > max_prompt_chars:
                raise ValidationError("input.messages", f"longer than {max_prompt_chars} characters in all",
                                      code=CONTEXT_EXCEEDED)
            return out
        raise ValidationError("input", "give exactly one of `prompt`, `input_ids` or `messages`")

    def _check_template_options(self, *, chat: bool, trusted: bool) -> None:
        """What the chat template's rendering takes comes with `messages` alone, and its options agree."""
        if self.tools is not UNSET and not chat:
            raise ValidationError("input.tools", "only with `messages` (the chat template renders them)")
        for name in ("chat_template_kwargs", "documents", "chat_template"):
            if getattr(self, name) not in (UNSET, None) and not chat:
                raise ValidationError(f"input.{name}", "only with `messages` (the chat template takes them)")
        if self.chat_template not in (UNSET, None) and not trusted:  # as vLLM without --trust-request-chat-template
            raise ValidationError("input.chat_template", "this model renders conversations with its own chat "
                                                         "template: its model file does not set "
                                                         "trust_request_chat_template, so a request's is refused")
        for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
            if getattr(self, name) is not default and not chat:
                raise ValidationError(f"input.{name}", "only with `messages` (the chat template's rendering)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValidationError("input.continue_final_message", "the last message is continued, so no assistant's "
                                                                  "turn is opened after it: set "
                                                                  "add_generation_prompt false with it")

    def _chat_wire(self, messages: list[ChatMessage]) -> dict[str, Any]:
        """A conversation's wire form: its messages, and its tools, template variables and rendering options where
        given (the options only where not the default)."""
        out: dict[str, Any] = {"messages": [m.wire() for m in messages]}
        if isinstance(self.tools, list) and self.tools:
            out["tools"] = [msgspec.to_builtins(t) for t in self.tools]
        if isinstance(self.chat_template_kwargs, dict) and self.chat_template_kwargs:
            out["chat_template_kwargs"] = template_kwargs(self.chat_template_kwargs)
        if isinstance(self.documents, list) and self.documents:
            out["documents"] = [dict(d) for d in self.documents]
        if isinstance(self.chat_template, str):
            out["chat_template"] = self.chat_template
        if not self.add_generation_prompt:
            out["add_generation_prompt"] = False
        if self.continue_final_message:
            out["continue_final_message"] = True
        return out


def template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A request's chat template variables, each named as a template variable can be and none that the rendering
    sets itself (the conversation, the special tokens, `apply_chat_template`'s own arguments)."""
    for name in kwargs:
        if not TEMPLATE_NAME.fullmatch(name):
            raise ValidationError("input.chat_template_kwargs", f"{name[:40]!r} is not a template variable name: a "
                                                                "letter, then up to 63 letters, digits or '_'")
        if name in RESERVED_TEMPLATE_NAMES:
            raise ValidationError("input.chat_template_kwargs", f"{name!r} is set by the rendering itself, not by a "
                                                                "request")
    return dict(kwargs)


class EmbedInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`texts` (list of strings) or `text` (one string); normalised to `texts`."""

    texts: Annotated[list[NonEmptyStr], Meta(min_length=1)] | UnsetType = UNSET
    text: NonEmptyStr | UnsetType = UNSET

    def normalised(self, *, max_texts: int, max_text_chars: int | None) -> dict[str, Any]:
        """The wire form, {"texts"}, under a model's limits (`max_text_chars` None: no bound on a text's length)."""
        if isinstance(self.text, str) and self.texts is UNSET:
            texts, field = [self.text], "input.text"
        elif isinstance(self.texts, list) and self.text is UNSET:
            texts, field = self.texts, "input.texts"
        else:
            raise ValidationError("input", "give exactly one of `texts` or `text`")
        if len(texts) > max_texts:
            raise ValidationError(field, f"at most {max_texts} texts per request")
        for i, text in enumerate(texts):
            if max_text_chars is not None and len(text) > max_text_chars:
                raise ValidationError(field if field == "input.text" else f"{field}[{i}]",
                                      f"longer than {max_text_chars} characters, refused before tokenizing (16 "
                                      f"per token the model takes) {TRUNCATE_HINT}", code=CONTEXT_EXCEEDED)
        return {"texts": list(texts)}


def exactly_one(*names: str) -> Meta:
    """The JSON Schema half of an "exactly one of these fields" rule (`normalised` checks it)."""
    return Meta(extra_json_schema={"oneOf": [{"required": [n]} for n in names]})


def parse_generate_input(raw: Any, *, max_prompt_chars: int, max_input_tokens: int) -> dict[str, Any]:
    inp = convert(raw, GenerateInput, "input", item_lists=ITEM_LISTS)
    return inp.normalised(max_prompt_chars=max_prompt_chars, max_input_tokens=max_input_tokens)


def parse_embed_input(raw: Any, *, max_texts: int, max_text_chars: int | None) -> dict[str, Any]:
    return convert(raw, EmbedInput, "input").normalised(max_texts=max_texts, max_text_chars=max_text_chars)
