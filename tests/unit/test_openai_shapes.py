"""The OpenAI-compatible shapes (`shared.openai_shapes`): request translation into the native submit body,
what is refused and how, and the responses, chunks and errors built from native results. Pure."""

from __future__ import annotations

import array
import base64
from typing import Any

import pytest

from shared import openai_shapes as oa
from shared.api_errors import Conflict, NotFound, TooManyRequests, Unprocessable
from shared.config import BUILTIN_MODELS
from shared.errors import ValidationError
from shared.params import parse_generate_input
from shared.submit import build_request


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], **kw}


def refused(fn: Any, body: dict[str, Any], **kw: Any) -> oa.OpenAIError:
    with pytest.raises(oa.OpenAIError) as info:
        fn(body, **kw)
    assert info.value.status == 400
    return info.value


# ------------------------------------------------------------------------------------------ completions

def test_a_completion_becomes_the_native_submit_body():
    tr = oa.translate_completion({"model": "tiny-llama", "prompt": "Once", "max_tokens": 8, "temperature": 0,
                                  "top_p": 0.9, "seed": 3, "stop": "\n", "n": 1, "user": "u1",
                                  "presence_penalty": 0, "logit_bias": {}, "timeout_s": 5, "priority": "batch"})
    assert tr.kind == "completion" and tr.model == "tiny-llama" and not tr.stream
    assert tr.body == {"input": {"prompt": "Once"}, "stream": False, "timeout_s": 5, "priority": "batch",
                       "params": {"max_new_tokens": 8, "temperature": 0, "top_p": 0.9, "seed": 3, "stop": "\n"}}


@pytest.mark.parametrize(("prompt", "native"), [
    ("x", {"prompt": "x"}),
    (["x"], {"prompt": "x"}),
    ([5, 17, 300], {"input_ids": [5, 17, 300]}),
    ([[5, 17]], {"input_ids": [5, 17]}),
])
def test_prompt_forms(prompt: Any, native: dict[str, Any]):
    assert oa.translate_completion({"model": "m", "prompt": prompt}).body["input"] == native


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [], [{"x": 1}], [True, 1]])
def test_several_or_malformed_prompts_are_refused_at_prompt(prompt: Any):
    err = refused(oa.translate_completion, {"model": "m", "prompt": prompt})
    assert err.param == "prompt"


@pytest.mark.parametrize("prompt", [[1, "a"], [True, False], ["a", [1, 2]]])
def test_a_prompt_list_of_mixed_types_is_named_for_its_types_not_its_length(prompt: Any):
    err = refused(oa.translate_completion, {"model": "m", "prompt": prompt})
    assert err.param == "prompt" and err.code != "multiple_prompts" and "token ids" in err.message


@pytest.mark.parametrize(("field", "value", "native"), [
    ("top_p", 0, 1e-6), ("seed", -1, 2**63 - 1), ("seed", 2**63 + 5, 5), ("top_k", -1, 0),
])
def test_openai_and_vllm_values_the_native_params_spell_otherwise(field: str, value: Any, native: Any):
    body = oa.translate_chat(chat(**{field: value})).body
    assert body["params"][field] == native
    build_request(body, BUILTIN_MODELS["tiny-llama"], "t", 0.0)  # the native checks pass


def test_defaults_are_openai_s_temperature_and_the_model_s_max_tokens():
    tr = oa.translate_completion({"model": "m", "prompt": "x"})
    assert tr.body["params"] == {"temperature": 1.0}  # max_new_tokens left to the model's default


def test_stream_and_include_usage():
    tr = oa.translate_completion({"model": "m", "prompt": "x", "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert tr.stream and tr.include_usage and tr.body["stream"] is True
    tr = oa.translate_completion({"model": "m", "prompt": "x", "stream_options": None})
    assert not tr.stream and not tr.include_usage
    # options of a stream not asked for: a 400, as OpenAI and vLLM answer (not silently ignored)
    for translate, body in ((oa.translate_completion, {"model": "m", "prompt": "x"}), (oa.translate_chat, chat())):
        for stream in ({}, {"stream": False}):
            err = refused(translate, {**body, **stream, "stream_options": {"include_usage": True}})
            assert err.param == "stream_options" and "stream" in err.message


@pytest.mark.parametrize(("field", "value"), [
    ("suffix", "end"), ("service_tier", "flex"),
])
def test_completion_fields_we_cannot_honour_are_refused_by_name(field: str, value: Any):
    err = refused(oa.translate_completion, {"model": "m", "prompt": "x", field: value})
    assert err.param == field and err.code == "unsupported_parameter"
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": field,
                                    "code": "unsupported_parameter"}}


@pytest.mark.parametrize(("field", "value"), [
    ("n", 1), ("presence_penalty", 0), ("frequency_penalty", 0.0), ("logit_bias", {}), ("echo", False),
    ("best_of", 1), ("logprobs", None), ("suffix", ""), ("user", "x"), ("service_tier", "auto"),
])
def test_harmless_defaults_are_accepted(field: str, value: Any):
    oa.translate_completion({"model": "m", "prompt": "x", field: value})


@pytest.mark.parametrize("translate", [oa.translate_completion, oa.translate_chat])
def test_penalties_are_passed_on_as_native_params(translate: Any):
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}],
            "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "logit_bias": {"50256": -100}}
    body.pop("messages" if translate is oa.translate_completion else "prompt")
    params = translate(body).body["params"]
    assert (params["presence_penalty"], params["frequency_penalty"], params["repetition_penalty"],
            params["logit_bias"]) == (0.5, -1, 1.2, {"50256": -100})
    plain = translate({**body, "presence_penalty": 0, "frequency_penalty": None, "repetition_penalty": None,
                       "logit_bias": {}})
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"} & set(plain.body["params"])


@pytest.mark.parametrize("translate", [oa.translate_completion, oa.translate_chat])
def test_n_choices_are_n_native_bodies_with_their_own_seeds(translate: Any):
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}], "n": 3, "seed": 2**63 - 2}
    body.pop("messages" if translate is oa.translate_completion else "prompt")
    tr = translate(body)
    assert tr.n == 3
    bodies = tr.bodies()
    assert [b["params"]["seed"] for b in bodies] == [2**63 - 2, 2**63 - 1, 0]  # counting up, within the native range
    assert all({**b, "params": {**b["params"], "seed": 0}} == {**tr.body, "params": {**tr.body["params"], "seed": 0}}
               for b in bodies)
    assert "seed" not in translate({**body, "seed": None}).bodies()[2]["params"]  # unseeded choices stay unseeded
    assert translate({**body, "n": None}).n == 1
    for n in (0, 17, -1):
        err = refused(translate, {**body, "n": n})
        assert err.param == "n" and "between 1 and 16" in err.message


def test_n_choices_make_one_response_with_every_choice_and_their_usage():
    tr = oa.translate_chat(chat(n=2))
    views = [view(text="one", reason="eos", tokens=3), view(text="two words", reason="length", tokens=5)]
    views[1]["id"] = "req_two"
    body = oa.completion_response(tr, views, 123)
    assert body["id"] == "chatcmpl-" + views[0]["id"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "one", "stop"), (1, "two words", "length")]
    prompt = body["usage"]["prompt_tokens"]
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 8, "total_tokens": prompt + 8}
    assert [c["request_id"] for c in body["batchgate"]["choices"]] == [views[0]["id"], "req_two"]
    chunks = oa.ChunkMaker(oa.translate_chat(chat(n=2, stream=True, stream_options={"include_usage": True})),
                           "req_one", 123, index=1)
    assert chunks.text("hi")["choices"][0]["index"] == 1
    assert len(chunks.final(views[1], with_usage=False)) == 1
    assert chunks.usage_chunk(views)["usage"]["completion_tokens"] == 8


def test_unknown_and_mistyped_fields_are_400s_naming_them():
    err = refused(oa.translate_completion, {"model": "m", "prompt": "x", "bogus": 1})
    assert err.param == "bogus" and "unknown field" in err.message
    err = refused(oa.translate_completion, {"model": "m", "prompt": "x", "max_tokens": "8"})
    assert err.param == "max_tokens"
    err = refused(oa.translate_completion, {"model": "m", "prompt": "x", "temperature": 3})
    assert err.param == "temperature"
    err = refused(oa.translate_completion, {"model": "m"})
    assert err.param == "prompt" and "required" in err.message
    assert refused(oa.translate_completion, ["not", "an", "object"]).param is None  # type: ignore[arg-type]


def test_the_deadline_comes_from_the_body_or_else_the_header():
    assert oa.translate_completion({"model": "m", "prompt": "x"}, timeout_header="2.5").body["timeout_s"] == 2.5
    body = oa.translate_completion({"model": "m", "prompt": "x", "timeout_s": 4}, timeout_header="2.5").body
    assert body["timeout_s"] == 4
    assert "timeout_s" not in oa.translate_completion({"model": "m", "prompt": "x"}).body
    for header in ("soon", "nan", "inf", "0", "-3", "1_0"):
        err = refused(oa.translate_completion, {"model": "m", "prompt": "x"}, timeout_header=header)
        assert err.param == "X-Batchgate-Timeout", header



@pytest.mark.parametrize("translate, body", [
    (oa.translate_completion, {"model": "m", "prompt": "x"}),
    (oa.translate_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    (oa.translate_embeddings, {"model": "m", "input": "x"}),
])
def test_a_timeout_the_model_refuses_is_named_where_the_caller_set_it(translate, body):
    """The native range check names `timeout_s`; a caller who sent the header gets the header named."""
    err = Unprocessable("timeout_s: at most 600 seconds for this model", extra={"field": "timeout_s"})
    by_header = oa.from_api_error(err, translate(body, timeout_header="9999").aliases)
    assert by_header.param == "X-Batchgate-Timeout" and by_header.status == 400
    assert by_header.message == "X-Batchgate-Timeout: at most 600 seconds for this model"
    assert oa.from_api_error(err, translate({**body, "timeout_s": 9999}).aliases).param == "timeout_s"
    assert oa.from_api_error(err, translate(body).aliases).param == "timeout_s"  # the model's default: no header


# ----------------------------------------------------------------------------------------------- chat

def test_chat_messages_become_native_messages_with_text_parts_joined():
    tr = oa.translate_chat(chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
        {"role": "assistant", "content": "ok"}], max_completion_tokens=7))
    assert tr.kind == "chat"
    assert tr.body["input"] == {"messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "a\nb"},
                                             {"role": "assistant", "content": "ok"}]}
    assert tr.body["params"]["max_new_tokens"] == 7 and tr.aliases["params.max_new_tokens"] == "max_completion_tokens"
    assert oa.translate_chat(chat(max_tokens=5)).body["params"]["max_new_tokens"] == 5


def test_an_answers_message_appended_to_the_history_as_the_sdk_sends_it_is_taken():
    """`messages.append(resp.choices[0].message)`: the SDK sends the answer's own fields back, OpenAI's
    `annotations` and, after `chat.completions.parse`, `parsed` and each call's `parsed_arguments`. They are read
    past (a 400 `unknown field` broke the parse-then-call-tools loop), as vLLM reads past them."""
    answer = {"role": "assistant", "content": '{"a": 1}', "refusal": None, "annotations": [], "parsed": {"a": 1},
              "audio": None, "function_call": None,
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "f", "arguments": '{"x": 2}', "parsed_arguments": {"x": 2}}}]}
    tr = oa.translate_chat(chat(messages=[{"role": "user", "content": "q"}, answer,
                                          {"role": "tool", "tool_call_id": "call_1", "content": "4"}]))
    assert tr.body["input"]["messages"][1] == {
        "role": "assistant", "content": '{"a": 1}',
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 2}}}]}
    err = refused(oa.translate_chat, chat(messages=[{"role": "user", "content": "q", "annotation": []}]))
    assert err.param == "messages[0].annotation"  # a typo is still refused


def test_a_history_of_as_many_messages_as_openai_takes_is_taken():
    """2,048 messages, OpenAI's own limit (a long agent loop met an undocumented 256); one more is a 400 naming
    the field. The prompt's tokens are what bounds the cost."""
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "m"} for i in range(2049)]
    native = oa.translate_chat(chat(messages=many[:2048])).body["input"]
    kw = dict(max_prompt_chars=100_000, max_input_tokens=100_000)
    assert len(parse_generate_input(native, **kw)["messages"]) == 2048
    with pytest.raises(ValidationError, match="at most 2048"):
        parse_generate_input(oa.translate_chat(chat(messages=many)).body["input"], **kw)


def test_chat_refusals():
    err = refused(oa.translate_chat, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]))
    assert err.param == "messages[0].content[0]" and "image_url" in err.message
    assert refused(oa.translate_chat, chat(messages=[{"role": "robot", "content": "x"}])).param == \
        "messages[0].role"
    # the deprecated function calling's result message is served (as a tool's), and names its function
    assert refused(oa.translate_chat, chat(messages=[{"role": "function", "content": "x"}])).param == \
        "messages[0].name"
    assert refused(oa.translate_chat, chat(messages=[{"role": "assistant", "content": None}])).param == \
        "messages[0].content"
    assert refused(oa.translate_chat, chat(messages=[{"role": "assistant", "tool_calls": [{"id": "1"}]}])).param \
        == "messages[0].tool_calls[0]"  # a call without its function
    assert refused(oa.translate_chat, chat(messages=[])).param == "messages"
    # as OpenAI: an empty list of parts is no content; a tool's result names the call it answers
    err = refused(oa.translate_chat, chat(messages=[{"role": "user", "content": []}]))
    assert err.param == "messages[0].content" and "empty list" in err.message
    err = refused(oa.translate_chat, chat(messages=[{"role": "user", "content": "hi"},
                                                    {"role": "tool", "content": "x"}]))
    assert err.param == "messages[1].tool_call_id" and "required" in err.message
    err = refused(oa.translate_chat, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]))
    assert err.param == "messages[0].content[0].text" and err.code == "invalid_request" and "required" in err.message
    assert refused(oa.translate_chat, chat(max_tokens=3, max_completion_tokens=4)).param == "max_completion_tokens"
    for field, value in [("tool_choice", "auto"), ("store", True), ("reasoning_effort", "low"),
                         ("modalities", ["text", "audio"])]:
        assert refused(oa.translate_chat, chat(**{field: value})).param == field
    assert refused(oa.translate_chat, chat(tools=[{"type": "function"}])).param == "tools[0].function"
    err = refused(oa.translate_chat, chat(response_format={"type": "grammar", "grammar": "start: 'a'"}))
    assert err.param == "response_format.type" and "json_schema" in err.message


def test_chat_harmless_fields():
    oa.translate_chat(chat(logprobs=False, tools=[], tool_choice="none", response_format={"type": "text"},
                           store=False, metadata={"a": "b"}, parallel_tool_calls=True, modalities=["text"]))
    oa.translate_chat(chat(stream=True, stream_options={"include_usage": False, "include_obfuscation": False}))


def test_translated_bodies_pass_the_native_checks():
    spec = BUILTIN_MODELS["tiny-llama"]
    for tr in (oa.translate_chat(chat(max_tokens=5, stop=["\n", "."], seed=1, top_k=4)),
               oa.translate_completion({"model": "tiny-llama", "prompt": [1, 2, 3], "stream": True})):
        req = build_request(tr.body, spec, "t", 1_000.0)
        assert req.stream is tr.stream
    embed = oa.translate_embeddings({"model": "minilm", "input": ["a", "b"]})
    assert build_request(embed.body, BUILTIN_MODELS["minilm"], "t", 1_000.0).input == {"texts": ["a", "b"]}


# ---------------------------------------------------------------------------------------------- errors

def test_native_errors_name_the_openai_parameter():
    tr = oa.translate_chat(chat(max_completion_tokens=9999))
    exc = Unprocessable("params.max_new_tokens: must be between 1 and 256 for this model, got 9999",
                        extra={"field": "params.max_new_tokens"})
    err = oa.from_api_error(exc, tr.aliases)
    assert err.status == 400 and err.param == "max_completion_tokens"
    assert err.message.startswith("max_completion_tokens: must be between 1 and 256")
    assert oa.openai_param("input.messages[1].content", tr.aliases) == "messages[1].content"
    assert oa.openai_param("params.temperature", tr.aliases) == "temperature"
    assert oa.openai_param("input.texts[2]", oa.translate_embeddings({"model": "m", "input": "x"}).aliases) == \
        "input[2]"
    assert oa.from_api_error(NotFound("nope", code="model_not_found")).body()["error"]["type"] == \
        "invalid_request_error"


def test_a_refused_prompt_or_text_names_the_openai_parameter_and_hints_in_its_terms():
    comp = oa.translate_completion({"model": "m", "prompt": "x"})
    for native in ("input.prompt", "input.input_ids"):
        err = oa.from_api_error(Unprocessable(f"{native}: is 3000 tokens; this model takes at most 2048",
                                              extra={"field": native}), comp.aliases)
        assert err.param == "prompt" and err.message.startswith("prompt: is 3000 tokens"), err.message
    emb = oa.translate_embeddings({"model": "m", "input": ["a", "b"]})
    err = oa.from_api_error(Unprocessable(
        "input.texts[1]: is 602 tokens; this model takes at most 512 per text (or set params.truncate to cut it, "
        "reported in the result)", extra={"field": "input.texts[1]"}), emb.aliases)
    assert err.param == "input[1]" and err.message == "input[1]: is 602 tokens; this model takes at most 512 per text"
    # a hint the route has a counterpart of is given in its terms
    err = oa.from_api_error(Unprocessable(
        "input.texts[1]: is 602 tokens; this model takes at most 512 per text (or set params.truncate_prompt_tokens "
        "to cut it: -1 keeps what the model takes)", extra={"field": "input.texts[1]"}), emb.aliases)
    assert err.message == ("input[1]: is 602 tokens; this model takes at most 512 per text (or set "
                           "truncate_prompt_tokens to cut it: -1 keeps what the model takes)"), err.message


def test_a_prompt_past_the_context_names_the_parameter_the_caller_sent():
    """The context check's sentence names the native `max_new_tokens`: an OpenAI caller sent `max_tokens` (or
    `max_completion_tokens`), and reads that name in it."""
    from shared.model_context import context_message

    native = "params.max_new_tokens: " + context_message(2048, 9, 4000)
    for tr, name in ((oa.translate_completion({"model": "m", "prompt": "x", "max_tokens": 4000}), "max_tokens"),
                     (oa.translate_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "max_completion_tokens": 4000}), "max_completion_tokens")):
        err = oa.from_api_error(Unprocessable(native, extra={"field": "params.max_new_tokens"}), tr.aliases)
        assert err.param == name and "max_new_tokens" not in err.message, err.message
        assert err.message.startswith(f"{name}: prompt (9 tokens) + {name} (4000) = 4009 exceeds"), err.message


def test_a_conflict_no_wait_resolves_is_not_retried_and_one_that_a_wait_does_is():
    final = oa.from_api_error(Conflict("used with another body", code="idempotency_conflict"))
    assert final.status == 409 and final.headers()["x-should-retry"] == "false"
    later = oa.from_api_error(Conflict("being accepted", code="idempotency_in_progress", retry_after=1))
    assert "x-should-retry" not in later.headers() and later.headers()["Retry-After"] == "1"


def test_a_prompt_past_the_model_is_context_length_exceeded():
    spec = BUILTIN_MODELS["tiny-llama"]
    body = oa.translate_completion({"model": "tiny-llama", "prompt": list(range(spec.max_input_tokens + 1))}).body
    with pytest.raises(Exception) as info:
        build_request(body, spec, "t", 0.0)
    assert getattr(info.value, "code", "") == "context_length_exceeded"


def test_a_429_keeps_retry_after_and_adds_milliseconds():
    err = oa.from_api_error(TooManyRequests("slow down", code="rate_limited", retry_after=0.25))
    assert err.status == 429 and err.body()["error"]["type"] == "rate_limit_error"
    assert err.headers() == {"Retry-After": "1", "retry-after-ms": "250"}


def view(status: str = "succeeded", reason: str | None = "eos", text: str = "hello", tokens: int = 2,
         error: dict[str, str] | None = None) -> dict[str, Any]:
    return {"id": "req_x", "status": status, "finish_reason": reason, "error": error,
            "output": {"text": text, "token_ids": list(range(tokens)), "prompt_tokens": 3,
                       "completion_tokens": tokens}}


@pytest.mark.parametrize(("v", "status", "code"), [
    (view("expired", "deadline", "", 0, {"code": "deadline_exceeded", "message": "m"}), 504, "deadline_exceeded"),
    (view("cancelled", "cancelled", "", 0, {"code": "cancelled", "message": "m"}), 409, "cancelled"),
    (view("failed", "error", "", 0, {"code": "no_chat_template", "message": "m"}), 400, "no_chat_template"),
    (view("failed", "error", "", 0, {"code": "model_error", "message": "m"}), 500, "model_error"),
    (view("failed", "error", "", 0, {"code": "context_length_exceeded", "message": "m"}), 400,
     "context_length_exceeded"),
    ({**view("failed", "error", "", 0, {"code": "input_too_long", "message": "m"}), "task": "generate"}, 400,
     "context_length_exceeded"),
    ({**view("failed", "error", "", 0, {"code": "input_too_long", "message": "m"}), "task": "embed"}, 400,
     "context_length_exceeded"),  # as the gateway's refusal of the same text, where it can count
    (view("failed", "error", "", 0, {"code": "input_too_long", "message": "m"}), 400, "input_too_long"),  # no task
])
def test_results_without_an_answer_are_errors_that_are_not_retried(v: dict[str, Any], status: int, code: str):
    err = oa.result_error(v)
    assert err is not None and (err.status, err.code) == (status, code)
    assert err.headers()["x-should-retry"] == "false"


def test_a_workers_hint_names_the_routes_field():
    from shared.params import TRUNCATE_HINT

    failed = {**view("failed", "error", "", 0, {"code": "input_too_long",
                                                "message": f"text 1 is 602 tokens; at most 512 {TRUNCATE_HINT}"}),
              "task": "embed"}
    err = oa.result_error(failed)
    assert err is not None and "set truncate_prompt_tokens to cut it" in err.message and "params." not in err.message


def test_finish_reasons():
    assert oa.finish_reason(view(reason="eos")) == "stop"
    assert oa.finish_reason(view(reason="stop")) == "stop"
    assert oa.finish_reason(view(reason="length")) == "length"
    cut = view("expired", "deadline", "hel", 1, {"code": "deadline_exceeded", "message": "m"})
    assert oa.result_error(cut) is None and oa.finish_reason(cut) == "length"


# ------------------------------------------------------------------------------------------- responses

def test_completion_and_chat_responses():
    tr = oa.translate_completion({"model": "tiny-llama", "prompt": "x"})
    body = oa.completion_response(tr, [view()], 123)
    assert body["id"] == "cmpl-req_x" and body["object"] == "text_completion" and body["created"] == 123
    assert body["choices"] == [{"index": 0, "finish_reason": "stop", "logprobs": None, "text": "hello"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert body["batchgate"] == {"request_id": "req_x", "status": "succeeded", "finish_reason": "eos"}
    body = oa.completion_response(oa.translate_chat(chat()), [view(reason="length")], 123)
    assert body["id"] == "chatcmpl-req_x" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello", "refusal": None}
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_chunks():
    tr = oa.translate_chat(chat(stream=True, stream_options={"include_usage": True}))
    maker = oa.ChunkMaker(tr, "req_x", 7)
    first = maker.first()
    assert first is not None and first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-req_x"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    assert maker.text("he")["choices"][0]["delta"] == {"content": "he"}
    last, used = maker.final(view())
    assert last["choices"][0] == {"index": 0, "finish_reason": "stop", "logprobs": None, "delta": {}}
    assert used["choices"] == [] and used["usage"]["total_tokens"] == 5


def test_usage_counts_the_tokens_a_stop_strings_cut_left_out():
    """OpenAI and vLLM bill every token generated: usage counts those a stop string's cut left out of the output
    (`generated_tokens`), whole and in the usage chunk."""
    cut = view(reason="stop", text="con", tokens=1)
    cut["output"]["generated_tokens"] = 3
    body = oa.completion_response(oa.translate_chat(chat()), [cut], 1)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert body["choices"][0]["message"]["content"] == "con"
    maker = oa.ChunkMaker(oa.translate_chat(chat(stream=True, stream_options={"include_usage": True})), "req_x", 7)
    assert maker.final(cut)[-1]["usage"]["completion_tokens"] == 3
    assert oa.usage(view(tokens=2))["completion_tokens"] == 2  # no cut: the output's tokens


def test_continuous_usage_counts_every_chunk():
    """vLLM's `continuous_usage_stats`: with `include_usage`, every chunk carries the usage so far (the prompt's
    tokens as the worker tells them, the output's tokens up to the chunk); the opening chunk waits for the first
    output (it tells the prompt's tokens) and counts none of it; the last chunks count the final output's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    tr = oa.translate_chat(chat(stream=True, stream_options=options))
    assert tr.include_usage and tr.continuous_usage
    maker = oa.ChunkMaker(tr, "req_x", 7)
    assert maker.first() is None  # held: the prompt's tokens are not known yet
    opening, one = maker.delta({"index": 0, "text": "he", "token_ids": [5], "prompt_tokens": 3})
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert opening["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    assert one["choices"][0]["delta"] == {"content": "he"}
    assert one["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert maker.delta({"index": 1, "text": "", "token_ids": [6], "prompt_tokens": 3}) == []  # nothing to show
    (two,) = maker.delta({"index": 2, "text": "llo", "token_ids": [7, 8], "prompt_tokens": 3})
    assert two["usage"]["completion_tokens"] == 4
    last, used = maker.final(view(tokens=5, text="hello"))
    assert last["usage"] == used["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    # a generation with no delta before its end opens with its final chunk
    maker = oa.ChunkMaker(tr, "req_x", 7)
    opening, last, used = maker.final(view(tokens=2))
    assert opening["choices"][0]["delta"]["role"] == "assistant" and opening["usage"]["completion_tokens"] == 0
    assert last["usage"]["completion_tokens"] == 2 and used["choices"] == []
    # completions alike (no opening chunk); without include_usage the option counts for nothing, as vLLM reads it
    tr = oa.translate_completion({"model": "m", "prompt": "x", "stream": True, "stream_options": options})
    (chunk,) = oa.ChunkMaker(tr, "req_x", 7).delta({"index": 0, "text": "a", "token_ids": [1], "prompt_tokens": 2})
    assert chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    tr = oa.translate_chat(chat(stream=True, stream_options={"continuous_usage_stats": True}))
    assert not tr.include_usage and not tr.continuous_usage
    maker = oa.ChunkMaker(tr, "req_x", 7)
    assert maker.first() is not None and "usage" not in maker.text("he")


def test_chats_echo_begins_the_answer_with_the_last_message():
    """vLLM's chat `echo`: where the last message is the answering role's (the assistant's; without a generation
    prompt, the last message's own), the answer's content begins with it, whole and streamed (right after the
    opening chunk); otherwise nothing is added."""
    begun = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}]
    tr = oa.translate_chat({"model": "m", "messages": begun, "echo": True, "add_generation_prompt": False,
                            "continue_final_message": True})
    assert tr.prefix == "one, two,"
    (choice,) = oa.completion_response(tr, [view(text=" three")], 1)["choices"]
    assert choice["message"]["content"] == "one, two, three"
    opening = oa.ChunkMaker(tr, "req_x", 7).opening()
    assert [c["choices"][0]["delta"] for c in opening] == [{"role": "assistant", "content": ""},
                                                           {"content": "one, two,"}]
    assert oa.translate_chat({"model": "m", "messages": begun, "echo": True}).prefix == "one, two,"
    asked = [{"role": "user", "content": "Count"}]
    assert oa.translate_chat({"model": "m", "messages": asked, "echo": True}).prefix == ""  # not the assistant's
    assert oa.translate_chat({"model": "m", "messages": asked, "echo": True,
                              "add_generation_prompt": False}).prefix == "Count"  # the last message's own role
    assert oa.translate_chat({"model": "m", "messages": begun}).prefix == ""
    plain = oa.ChunkMaker(oa.translate_chat({"model": "m", "messages": begun, "stream": True}), "req_x", 7)
    assert len(plain.opening()) == 1
    # with continuous usage the opening waits for the first output; the echo comes right after it
    tr = oa.translate_chat({"model": "m", "messages": begun, "echo": True, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    maker = oa.ChunkMaker(tr, "req_x", 7)
    assert maker.opening() == []
    chunks = maker.delta({"index": 0, "text": " three", "token_ids": [4], "prompt_tokens": 6})
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "one, two,", " three"]


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids():
    """vLLM's `return_token_ids`: chat answers the prompt's ids on the response and each choice's output ids;
    completions both on each choice. Streamed, the prompt's come first (chat's opening chunk, held for the first
    output, which tells them; a completion's first chunk) and each chunk carries the ids of its text."""
    v = {**view(), "output": {**view()["output"], "prompt_token_ids": [1, 5, 9]}}
    tr = oa.translate_chat(chat(return_token_ids=True))
    assert tr.with_ids and tr.body["params"]["echo"] is True  # the worker tells the prompt's ids
    body = oa.completion_response(tr, [v], 1)
    assert body["prompt_token_ids"] == [1, 5, 9] and body["choices"][0]["token_ids"] == [0, 1]
    tr = oa.translate_completion({"model": "m", "prompt": "x", "return_token_ids": True})
    (choice,) = oa.completion_response(tr, [v], 1)["choices"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == ([1, 5, 9], [0, 1])
    assert "token_ids" not in oa.completion_response(oa.translate_chat(chat()), [v], 1)["choices"][0]
    # streamed chat
    maker = oa.ChunkMaker(oa.translate_chat(chat(stream=True, return_token_ids=True)), "req_x", 7)
    assert maker.opening() == []
    opening, one = maker.delta({"index": 0, "text": "he", "token_ids": [0], "prompt_token_ids": [1, 5, 9]})
    assert opening["prompt_token_ids"] == [1, 5, 9] and opening["choices"][0]["delta"]["role"] == "assistant"
    assert one["choices"][0]["token_ids"] == [0]
    assert maker.delta({"index": 1, "text": "", "token_ids": [1]}) == []  # its text is not decided: its id waits
    (last,) = maker.final(v)
    assert last["choices"][0]["token_ids"] == [1] and last["choices"][0]["finish_reason"] == "stop"
    # streamed completion: the prompt's ids on the first chunk's choice
    maker = oa.ChunkMaker(oa.translate_completion({"model": "m", "prompt": "x", "stream": True,
                                                   "return_token_ids": True}), "req_x", 7)
    (first,) = maker.delta({"index": 0, "text": "he", "token_ids": [0], "prompt_token_ids": [1, 5, 9]})
    assert first["choices"][0]["prompt_token_ids"] == [1, 5, 9] and first["choices"][0]["token_ids"] == [0]
    (second,) = maker.delta({"index": 1, "text": "llo", "token_ids": [1]})
    assert "prompt_token_ids" not in second["choices"][0] and second["choices"][0]["token_ids"] == [1]


def test_completion_chunks():
    tr = oa.translate_completion({"model": "m", "prompt": "x", "stream": True})
    maker = oa.ChunkMaker(tr, "req_x", 7)
    assert maker.first() is None
    chunk = maker.text("he")
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "he" and "usage" not in chunk
    (last,) = maker.final(view(reason="length"))
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["text"] == ""


def test_embeddings_float_and_base64():
    v = {"id": "req_e", "status": "succeeded", "output": {"embeddings": [[0.5, -1.25], [1.0, 0.0]], "tokens": [3, 4]}}
    tr = oa.translate_embeddings({"model": "minilm", "input": "hi"})
    body = oa.embedding_response(tr, v)
    assert body["object"] == "list" and body["model"] == "minilm"
    assert body["data"][1] == {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    b64 = oa.embedding_response(oa.translate_embeddings({"model": "minilm", "input": ["a", "b"],
                                                         "encoding_format": "base64"}), v)
    # how OpenAI's client decodes it without numpy (array "f": float32, native order)
    assert array.array("f", base64.b64decode(b64["data"][0]["embedding"])).tolist() == [0.5, -1.25]


def test_embedding_refusals():
    assert refused(oa.translate_embeddings, {"model": "m", "input": [1, 2]}).param == "input"
    assert refused(oa.translate_embeddings, {"model": "m", "input": []}).param == "input"
    assert refused(oa.translate_embeddings, {"model": "m", "input": "x", "dimensions": 8}).param == "dimensions"
    assert refused(oa.translate_embeddings, {"model": "m", "input": "x", "encoding_format": "int8"}).param == \
        "encoding_format"


def test_model_entries():
    assert oa.model_entry("a") == {"id": "a", "object": "model", "created": 0, "owned_by": "batchgate"}
    assert oa.model_entry("a", max_model_len=2048)["max_model_len"] == 2048


# ------------------------------------------------------------------------------------------- log probabilities

ENTRIES = [{"token_id": 7, "token": "he", "logprob": -0.5,
            "top_logprobs": [{"token_id": 7, "token": "he", "logprob": -0.5},
                             {"token_id": 9, "token": "é", "logprob": -1.25}]},
           {"token_id": 8, "token": "llo", "logprob": -0.1, "top_logprobs": [{"token_id": 3, "token": "x",
                                                                              "logprob": -0.05}]}]


def test_logprobs_are_asked_for_as_native_params():
    tr = oa.translate_chat(chat(logprobs=True, top_logprobs=3))
    assert tr.logprobs == 3 and tr.body["params"]["logprobs"] == 3
    assert oa.translate_chat(chat(logprobs=True)).body["params"]["logprobs"] == 0
    for off in (chat(), chat(logprobs=False), chat(logprobs=False, top_logprobs=0)):
        tr = oa.translate_chat(off)
        assert tr.logprobs is None and "logprobs" not in tr.body["params"]
    assert refused(oa.translate_chat, chat(top_logprobs=2)).param == "top_logprobs"  # without logprobs: true
    assert refused(oa.translate_chat, chat(logprobs=True, top_logprobs=21)).param == "top_logprobs"
    tr = oa.translate_completion({"model": "m", "prompt": "x", "logprobs": 2})
    assert tr.logprobs == 2 and tr.body["params"]["logprobs"] == 2
    assert oa.translate_completion({"model": "m", "prompt": "x", "logprobs": 0}).body["params"]["logprobs"] == 0
    assert refused(oa.translate_completion, {"model": "m", "prompt": "x", "logprobs": -1}).param == "logprobs"
    req = build_request(oa.translate_chat(chat(logprobs=True, top_logprobs=20)).body, BUILTIN_MODELS["tiny-llama"],
                        "t", 1_000.0)
    assert req.params["logprobs"] == 20
    for ask in (chat(logprobs=True), chat(logprobs=True, top_logprobs=0)):  # 0 alternatives: still asked for
        req = build_request(oa.translate_chat(ask).body, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)
        assert req.params["logprobs"] == 0
    echo = oa.translate_completion({"model": "tiny-llama", "prompt": [1, 2], "echo": True, "logprobs": 0})
    assert build_request(echo.body, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0).params["prompt_logprobs"] == 0
    plain = build_request(oa.translate_chat(chat()).body, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)
    assert "logprobs" not in plain.params  # as the penalties: a worker of before reads what it knows


def test_chat_logprobs_in_the_response_and_the_chunks():
    tr = oa.translate_chat(chat(logprobs=True, top_logprobs=2))
    v = {**view(), "output": {**view()["output"], "logprobs": ENTRIES}}
    (choice,) = oa.completion_response(tr, [v], 1)["choices"]
    assert choice["logprobs"] == {"refusal": None, "content": [
        {"token": "he", "logprob": -0.5, "bytes": [104, 101], "top_logprobs": [
            {"token": "he", "logprob": -0.5, "bytes": [104, 101]},
            {"token": "é", "logprob": -1.25, "bytes": [195, 169]}]},
        {"token": "llo", "logprob": -0.1, "bytes": [108, 108, 111], "top_logprobs": [
            {"token": "x", "logprob": -0.05, "bytes": [120]}]}]}
    maker = oa.ChunkMaker(tr, "req_x", 7)
    sent_before = {**ENTRIES[0], "logprob": None, "top_logprobs": []}  # a resumed stream's record: what was sent
    chunk = maker.text("hello", [sent_before, *ENTRIES[1:]])
    assert [e["token"] for e in chunk["choices"][0]["logprobs"]["content"]] == ["llo"]
    assert oa.ChunkMaker(oa.translate_chat(chat()), "req_x", 7).text("he", ENTRIES)["choices"][0]["logprobs"] is None


def test_completion_logprobs_with_text_offsets_that_go_on_across_chunks():
    tr = oa.translate_completion({"model": "m", "prompt": "x", "logprobs": 1, "stream": True})
    v = {**view(), "output": {**view()["output"], "logprobs": ENTRIES}}
    (choice,) = oa.completion_response(tr, [v], 1)["choices"]
    assert choice["logprobs"] == {"tokens": ["he", "llo"], "token_logprobs": [-0.5, -0.1],
                                  "top_logprobs": [{"he": -0.5, "é": -1.25}, {"x": -0.05, "llo": -0.1}],
                                  "text_offset": [0, 2]}
    maker = oa.ChunkMaker(tr, "req_x", 7)
    assert maker.text("he", ENTRIES[:1])["choices"][0]["logprobs"]["text_offset"] == [0]
    assert maker.text("llo", ENTRIES[1:])["choices"][0]["logprobs"]["text_offset"] == [2]
    assert oa.completion_response(oa.translate_completion({"model": "m", "prompt": "x"}), [v], 1)[
        "choices"][0]["logprobs"] is None


def test_return_tokens_as_token_ids_names_every_token_by_its_id():
    """vLLM's `return_tokens_as_token_ids`: the logprobs' tokens and alternatives are `token_id:N`, with that
    name's bytes, chat and completions, whole and streamed; a completion's text_offset still counts the text."""
    v = {**view(), "output": {**view()["output"], "logprobs": ENTRIES}}
    tr = oa.translate_chat(chat(logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True))
    (choice,) = oa.completion_response(tr, [v], 1)["choices"]
    first = choice["logprobs"]["content"][0]
    assert (first["token"], first["bytes"]) == ("token_id:7", list(b"token_id:7"))
    assert [t["token"] for t in first["top_logprobs"]] == ["token_id:7", "token_id:9"]
    assert choice["message"]["content"] == "hello"  # the text itself is as always
    chunk = oa.ChunkMaker(tr, "req_x", 7).text("he", ENTRIES[:1])
    assert chunk["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:7"
    tr = oa.translate_completion({"model": "m", "prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True})
    (choice,) = oa.completion_response(tr, [v], 1)["choices"]
    assert choice["logprobs"] == {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -0.1],
                                  "top_logprobs": [{"token_id:7": -0.5, "token_id:9": -1.25},
                                                   {"token_id:3": -0.05, "token_id:8": -0.1}],
                                  "text_offset": [0, 2]}
    plain = oa.translate_completion({"model": "m", "prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": False})
    assert oa.completion_response(plain, [v], 1)["choices"][0]["logprobs"]["tokens"] == ["he", "llo"]


PROMPT_ENTRIES = [{"token_id": 1, "token": "", "logprob": None, "top_logprobs": []},
                  {"token_id": 5, "token": "hi", "logprob": -2.0, "top_logprobs": [{"token_id": 6, "token": "yo",
                                                                                   "logprob": -1.0}]}]


def test_echo_puts_the_prompt_and_its_log_probabilities_first():
    echoed = {**view(), "output": {**view()["output"], "logprobs": ENTRIES, "prompt_logprobs": PROMPT_ENTRIES,
                                   "prompt_text": "hi", "prompt_token_ids": [1, 5]}}
    tr = oa.translate_completion({"model": "m", "prompt": "hi", "echo": True, "logprobs": 1})
    assert tr.body["params"]["prompt_logprobs"] == 1 and tr.body["params"]["logprobs"] == 1
    (choice,) = oa.completion_response(tr, [echoed], 1)["choices"]
    assert choice["text"] == "hihello"
    assert choice["logprobs"]["tokens"] == ["", "hi", "he", "llo"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -0.5, -0.1]
    assert choice["logprobs"]["top_logprobs"][:2] == [None, {"yo": -1.0, "hi": -2.0}]
    assert choice["logprobs"]["text_offset"] == [0, 0, 2, 4]
    # a string prompt echoed without log probabilities needs nothing from the worker; token ids need their text
    tr = oa.translate_completion({"model": "m", "prompt": "hi", "echo": True})
    assert "prompt_logprobs" not in tr.body["params"]
    assert oa.completion_response(tr, [echoed], 1)["choices"][0] == {
        "index": 0, "finish_reason": "stop", "logprobs": None, "text": "hihello"}
    tr = oa.translate_completion({"model": "m", "prompt": [1, 5], "echo": True})
    assert tr.body["params"]["echo"] is True and "prompt_logprobs" not in tr.body["params"]  # no scoring
    assert oa.completion_response(tr, [echoed], 1)["choices"][0]["text"] == "hihello"


def test_echo_with_max_tokens_0_scores_the_prompt_alone():
    echoed = {**view(), "output": {**view()["output"], "logprobs": ENTRIES, "prompt_logprobs": PROMPT_ENTRIES,
                                   "prompt_text": "hi", "prompt_token_ids": [1, 5]}}
    tr = oa.translate_completion({"model": "m", "prompt": [1, 5], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert tr.body["params"]["max_new_tokens"] == 1 and tr.score_only
    body = oa.completion_response(tr, [echoed], 1)
    (choice,) = body["choices"]
    assert choice["text"] == "hi" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    assert refused(oa.translate_completion, {"model": "m", "prompt": "x", "echo": True, "stream": True}).param == "echo"
    assert oa.translate_completion({"model": "m", "prompt": "x", "max_tokens": 0}).body["params"][
        "max_new_tokens"] == 0  # without echo, the native check refuses it (a 400 naming max_tokens)


def test_best_of_generates_candidates_and_answers_the_likeliest_per_token():
    tr = oa.translate_completion({"model": "m", "prompt": "x", "best_of": 3, "n": 2, "seed": 5})
    assert (tr.n, tr.best_of, tr.requests) == (2, 3, 3)
    bodies = tr.bodies()
    assert len(bodies) == 3 and all(b["params"]["logprobs"] == 0 for b in bodies)  # asked for the ranking
    assert [b["params"]["seed"] for b in bodies] == [5, 6, 7]

    def candidate(rid: str, scores: list[float], text: str) -> dict[str, Any]:
        entries = [{"token_id": 1, "token": "t", "logprob": s, "top_logprobs": []} for s in scores]
        return {**view(text=text, tokens=len(scores)), "id": rid,
                "output": {**view(text=text, tokens=len(scores))["output"], "logprobs": entries}}

    views = [candidate("req_a", [-1.0, -3.0], "a"), candidate("req_b", [-0.5], "b"),
             candidate("req_c", [-1.5, -1.5, -0.5], "c")]
    body = oa.completion_response(tr, views, 1)
    assert [c["text"] for c in body["choices"]] == ["b", "c"] and [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])  # not asked for: used for the ranking alone
    assert body["id"] == "cmpl-req_a" and body["usage"]["completion_tokens"] == 6  # every candidate's tokens
    asked = oa.translate_completion({"model": "m", "prompt": "x", "best_of": 2, "logprobs": 1})
    assert all(b["params"]["logprobs"] == 1 for b in asked.bodies())
    assert oa.completion_response(asked, views[:2], 1)["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]
    assert oa.translate_completion({"model": "m", "prompt": "x", "best_of": 1}).requests == 1
    for bad in ({"best_of": 2, "n": 3}, {"best_of": 17}, {"best_of": 0}, {"best_of": 2, "stream": True}):
        assert refused(oa.translate_completion, {"model": "m", "prompt": "x", **bad}).param == "best_of"
    for n in (1, 2):  # n choices streamed (best_of left out, or equal to n: no ranking) are not candidates
        for best_of in ({}, {"best_of": n}):
            assert oa.translate_completion({"model": "m", "prompt": "x", "n": n, "stream": True, **best_of}).stream


def test_a_token_that_is_part_of_a_character_keeps_its_own_bytes():
    half = {"token_id": 9, "token": "\ufffd", "logprob": -0.2, "bytes": [0xC3], "top_logprobs": [
        {"token_id": 9, "token": "\ufffd", "logprob": -0.2, "bytes": [0xC3]}, {"token_id": 4, "token": "a",
                                                                             "logprob": -3.0}]}
    (entry,) = oa.openai_logprobs("chat", [half])["content"]
    assert entry["bytes"] == [0xC3] and entry["token"] == "\ufffd"
    assert [t["bytes"] for t in entry["top_logprobs"]] == [[0xC3], [97]]
