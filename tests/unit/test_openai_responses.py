"""The Responses API's translation to the chat route and back (pure: no gateway, no Redis)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared import openai_responses as oar
from shared import openai_shapes as oa


def translate(**body: Any) -> oar.ResponseCall:
    return oar.translate_response({"model": "m", "input": "hi", **body}, parser_of=lambda m: "hermes")


def view(text: str, reason: str = "eos", rid: str = "req_1") -> dict[str, Any]:
    return {"id": rid, "status": "succeeded", "finish_reason": reason,
            "output": {"text": text, "token_ids": [1, 2], "prompt_tokens": 3, "completion_tokens": 2}}


def test_input_items_become_the_conversation():
    call = translate(instructions="be brief", max_output_tokens=7, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "wea"}, {"type": "input_text", "text": "ther?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "CET"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"}])
    messages = call.chat.body["input"]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[0]["content"] == "be brief" and messages[1]["content"] == "wea\nther?"  # as chat joins parts
    assert [c["function"]["name"] for c in messages[2]["tool_calls"]] == ["get_weather", "get_time"]  # one turn
    assert messages[3]["content"] == "sunny" and messages[4]["content"] == "CET"
    assert messages[5]["content"] == "Let me see." and messages[5]["tool_calls"][0]["id"] == "c3"  # its text, calls
    assert call.chat.body["params"]["max_new_tokens"] == 7 and call.echo["instructions"] == "be brief"


def test_format_tools_and_options_become_the_chat_routes():
    call = translate(text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                                      "strict": True}}, truncation="auto", top_logprobs=2, seed=5)
    params = call.chat.body["params"]
    assert params["response_format"] == {"type": "json_schema", "schema": {"type": "object"}}
    assert params["truncate_prompt_tokens"] == -1 and params["logprobs"] == 2 and params["seed"] == 5
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    call = translate(tools=tools, tool_choice={"type": "function", "name": "get_weather"})
    assert call.chat.calls is not None and call.chat.calls.forced == "get_weather"
    assert call.echo["tools"] == tools and call.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert translate(tools=tools).chat.calls.parser == "hermes"  # auto: read in the model's own format


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": {"a": 1}}]}]}, "input[0].content[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [{"type": "function", "name": "f"}]},
     "tool_choice.name"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"store": True}, "store"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": "plain"}, "text"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"temperature": 3}, "temperature"),
    ({"bogus": 1}, "bogus"),
])
def test_what_is_not_served_or_not_valid_is_a_400_naming_it(body, param):
    with pytest.raises(oa.OpenAIError) as err:
        translate(**body)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert err.value.message.startswith(param)


def test_a_native_fields_error_names_the_responses_parameter():
    call = translate(max_output_tokens=5)
    assert oa.openai_param("params.max_new_tokens", call.chat.aliases) == "max_output_tokens"
    assert oa.openai_param("input.messages", call.chat.aliases) == "input"


def test_a_finished_generation_is_a_response():
    call = translate()
    r = oar.response_object(call, view("Hello"), 100)
    assert (r["id"], r["object"], r["status"], r["created_at"]) == ("resp_req_1", "response", "completed", 100)
    assert r["output"] == [oar.message_item("req_1", "Hello")] and r["incomplete_details"] is None
    assert r["usage"]["input_tokens"] == 3 and r["usage"]["output_tokens"] == 2 and r["usage"]["total_tokens"] == 5
    assert r["completed_at"] is None  # a view without its finishing time
    assert oar.response_object(call, {**view("Hello"), "finished_at": 104.7}, 100)["completed_at"] == 104
    cut = oar.response_object(call, {**view("Hel", "length"), "finished_at": 104.7}, 100)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["completed_at"] is None  # only a completed response has one, as OpenAI's
    said = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    r = oar.response_object(translate(tools=[{"type": "function", "name": "get_weather"}]), view(said), 100)
    assert [i["type"] for i in r["output"]] == ["message", "function_call"]
    assert r["output"][0]["content"][0]["text"] == "Let me look." and r["output"][1]["name"] == "get_weather"
    assert json.loads(r["output"][1]["arguments"]) == {"city": "Rome"} and r["output"][1]["call_id"]


def test_a_stream_is_the_typed_events_of_the_same_response():
    events = oar.ResponseEvents(translate(stream=True), "req_2", 100)
    out = events.first() + events.delta({"text": "Hel"}) + events.delta({"text": "lo"})
    out += events.final(view("Hello", rid="req_2"))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[0]["response"]["status"] == "in_progress" and out[-1]["response"]["output"][0]["content"][0][
        "text"] == "Hello"
    tools = [{"type": "function", "name": "get_weather"}]
    events = oar.ResponseEvents(translate(stream=True, tools=tools), "req_3", 100)
    said = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    out = events.first() + events.delta({"text": said[:20]}) + events.delta({"text": said[20:]})
    out += events.final(view(said, rid="req_3"))
    kinds = [e["type"] for e in out]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    (item,) = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert item["type"] == "function_call" and json.loads(item["arguments"]) == {"city": "Rome"}
    assert item == out[-1]["response"]["output"][0]  # the streamed item is the response's
    failed = oar.ResponseEvents(translate(stream=True), "req_4", 100)
    events = failed.first() + failed.delta({"text": "Par"})
    *closed, event = failed.failed(oa.OpenAIError(500, "the model failed", code="model_error"))
    assert event["type"] == "response.failed" and event["response"]["error"] == {
        "code": "server_error", "message": "the model failed (model_error)"}  # a code the client knows
    assert [c["type"] for c in closed][-1] == "response.output_item.done"
    assert event["response"]["output"] == [oar.message_item("req_4", "Par", "incomplete")]  # what was streamed


def stream_of(call: oar.ResponseCall, pieces: list[str], done: dict[str, Any]) -> list[dict[str, Any]]:
    events = oar.ResponseEvents(call, str(done["id"]), 100)
    return [*events.first(), *(e for p in pieces for e in events.delta({"text": p})), *events.final(done)]


def test_the_items_streamed_are_the_final_responses_in_the_same_order():
    tools = [{"type": "function", "name": "get_weather"}]
    said = '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    out = stream_of(translate(stream=True, tools=tools), ["\n", said[1:]], view(said, rid="req_5"))
    done = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["message", "function_call"] and out[-1]["response"]["output"] == done
    # an empty answer: an empty message item, announced and done, as unstreamed
    out = stream_of(translate(stream=True), [], view("", rid="req_6"))
    assert [e["type"] for e in out][2:] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.completed"]
    assert out[-1]["response"]["output"] == [oar.message_item("req_6", "")]
    assert oar.response_object(translate(), view("", rid="req_6"), 100)["output"] == out[-1]["response"]["output"]
    # a forced call cut by max_output_tokens: the call item is incomplete, its arguments as far as they got
    forced = translate(tools=tools, tool_choice={"type": "function", "name": "get_weather"})
    r = oar.response_object(forced, view('{"city": "Ro', "length"), 100)
    assert r["status"] == "incomplete" and r["output"][0]["status"] == "incomplete"
    assert r["output"][0]["arguments"] == '{"city": "Ro'


def test_log_probabilities_are_the_output_texts():
    call = translate(top_logprobs=1, include=["message.output_text.logprobs"])
    assert call.chat.body["params"]["logprobs"] == 1
    assert translate(include=["message.output_text.logprobs"]).chat.body["params"]["logprobs"] == 0
    entry = {"token": "Hi", "logprob": -0.5, "top_logprobs": [{"token": "Hi", "logprob": -0.5}]}
    lp_view = view("Hi")
    lp_view["output"]["logprobs"] = [{"token_id": 1, "token": "Hi", "logprob": -0.5,
                                      "top_logprobs": [{"token_id": 1, "token": "Hi", "logprob": -0.5}]}]
    part = oar.response_object(call, lp_view, 100)["output"][0]["content"][0]
    assert [(e["token"], e["logprob"]) for e in part["logprobs"]] == [(entry["token"], entry["logprob"])]
