"""Function calling on the chat route: `tools` and `tool_choice` translated into the chat template's tools and a
structured output that holds the answer to the call; the answer read back as `tool_calls`, whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared import openai_shapes as oa
from shared.config import BUILTIN_MODELS
from shared.params import GenerateParams
from shared.submit import build_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "Weather in Paris?"}], **kw}


def test_a_named_function_holds_the_answer_to_its_parameters():
    tr = oa.translate_chat(chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}}))
    assert tr.body["input"]["tools"][0]["function"]["name"] == "get_weather"  # the template tells the model of both
    assert len(tr.body["input"]["tools"]) == 2
    assert tr.body["params"]["response_format"] == {"type": "json_schema",
                                                    "schema": WEATHER["function"]["parameters"]}
    req = build_request(tr.body, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)  # the native checks take it
    assert req.input["tools"] == tr.body["input"]["tools"]
    view = {"id": "req_abc", "status": "succeeded", "finish_reason": "stop",
            "output": {"text": '{"city": "Paris"}', "token_ids": [1, 2], "prompt_tokens": 3, "completion_tokens": 2}}
    choice = oa.completion_response(tr, [view], 0)["choices"][0]
    assert choice["finish_reason"] == "stop"  # OpenAI's, for a forced function
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "call_abc_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}, "none"])
@pytest.mark.parametrize("kind", ["string", "array", ["object", "null"]])
def test_a_function_whose_parameters_are_not_an_object_is_refused(choice, kind):
    """A call's arguments are a JSON object: a schema of another type was taken, the answer followed it (arguments
    '" does"'), and the next turn, sending that call back, was refused for arguments that are no object."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": kind, "maxLength": 5}}}
    with pytest.raises(oa.OpenAIError) as err:
        oa.translate_chat(chat(tools=[WEATHER, bad], tool_choice=choice))
    assert err.value.status == 400 and err.value.param == "tools[1].function.parameters"
    assert "type 'object'" in err.value.message


def test_required_is_a_list_of_calls_to_the_tools_given():
    tr = oa.translate_chat(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    schema = tr.body["params"]["response_format"]["schema"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [b["properties"]["name"] for b in schema["items"]["anyOf"]] == [{"enum": ["get_weather"]},
                                                                          {"enum": ["get_time"]}]
    GenerateParams.parse(tr.body["params"], limit=100, default_max_new_tokens=10)  # llguidance compiles it
    text = json.dumps([{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}])
    view = {"id": "req_x", "status": "succeeded", "finish_reason": "eos",
            "output": {"text": text, "token_ids": [1], "prompt_tokens": 3, "completion_tokens": 1}}
    choice = oa.completion_response(tr, [view], 0)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [("call_x_0", "get_weather", {"city": "Oslo"}),
                                                          ("call_x_1", "get_time", {})]
    cut = {**view, "finish_reason": "length", "output": {**view["output"], "text": '[{"name": "get_w'}}
    choice = oa.completion_response(tr, [cut], 0)["choices"][0]  # cut short: its text, as a plain answer's
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == '[{"name": "get_w'
    assert "tool_calls" not in choice["message"]


def test_required_takes_tools_whose_parameters_refer_to_their_own_defs():
    """pydantic's nested (and recursive) models refer to `#/$defs/...` of their own schema: inside the list of
    calls they are rebased, so the grammar compiles and takes exactly the calls the schemas allow."""
    import openai
    from pydantic import BaseModel

    from shared.structured_output import from_wire, grammar_of
    from tests.unit.test_structured_output import accepts, bytes_tokenizer

    class Loc(BaseModel):
        city: str

    class Trip(BaseModel):
        stops: list[Loc]

    class Tree(BaseModel):
        name: str
        kids: list[Tree]

    tools = [openai.pydantic_function_tool(Trip), openai.pydantic_function_tool(Tree)]
    tr = oa.translate_chat(chat(tools=tools, tool_choice="required"))
    params = GenerateParams.parse(tr.body["params"], limit=100, default_max_new_tokens=10)
    grammar = grammar_of(from_wire(params.to_dict()["response_format"]))

    def takes(value: Any) -> bool:
        return accepts(bytes_tokenizer(), grammar, json.dumps(value))

    assert takes([{"name": "Trip", "arguments": {"stops": [{"city": "Oslo"}]}},
                  {"name": "Tree", "arguments": {"name": "a", "kids": [{"name": "b", "kids": []}]}}])
    assert not takes([{"name": "Trip", "arguments": {"stops": [{"town": "Oslo"}]}}])
    assert not takes([{"name": "Tree", "arguments": {"name": "a", "kids": [{"name": 1, "kids": []}]}}])


def test_a_forced_call_streams_its_arguments_and_a_list_comes_whole_at_the_end():
    tr = oa.translate_chat(chat(stream=True, tools=[WEATHER], tool_choice={"type": "function",
                                                                            "function": {"name": "get_weather"}}))
    maker = oa.ChunkMaker(tr, "req_s", 0)
    chunks = [c for text in ('{"city', '": "Rome"}') for c in maker.delta({"text": text})]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks]
    assert calls[0]["id"] == "call_s_0" and calls[0]["function"]["name"] == "get_weather"
    assert "id" not in calls[1] and "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}'
    view = {"id": "req_s", "status": "succeeded", "finish_reason": "stop", "output": {}}
    assert maker.final(view)[-1]["choices"][0]["finish_reason"] == "stop"

    tr = oa.translate_chat(chat(stream=True, tools=[TIME], tool_choice="required"))
    maker = oa.ChunkMaker(tr, "req_r", 0)
    assert maker.delta({"text": '[{"name": "get_time", '}) == [] and maker.delta({"text": '"arguments": {}}]'}) == []
    first, last = maker.final({**view, "id": "req_r"})
    assert first["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_r_0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_earlier_calls_and_tool_results_reach_the_chat_template():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tr = oa.translate_chat(chat(messages=messages, tools=[WEATHER], tool_choice="none"))
    assert tr.body["input"]["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tr.body["input"]["messages"][2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert "tools" not in tr.body["input"] and "response_format" not in tr.body["params"]  # "none": free text
    build_request(tr.body, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)


def test_the_built_in_chat_template_renders_tools_and_calls_as_the_gateway_counts_them(tmp_path):
    from shared.config import SIMPLE_CHAT_TEMPLATE
    from shared.token_limits import load_chat_template

    found = load_chat_template(tmp_path, SIMPLE_CHAT_TEMPLATE)
    assert found is not None
    template = found[0]["default"]
    tr = oa.translate_chat(chat(tools=[WEATHER], tool_choice="required"))
    text = template.render(**tr.body["input"], add_generation_prompt=True, bos_token="<s>")
    assert text.startswith('<s><|tools|>\n[{"type": "function", "function": {"name": "get_weather"')
    assert text.endswith("<|user|>\nWeather in Paris?\n<|assistant|>\n")
    called = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                                   "function": {"name": "f", "arguments": {"a": 1}}}]}]
    assert '<|assistant|>\n[{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]' in \
        template.render(messages=called, bos_token="")


def refused(**kw: Any) -> oa.OpenAIError:
    with pytest.raises(oa.OpenAIError) as err:
        oa.translate_chat(chat(**kw))
    assert err.value.status == 400
    return err.value


def test_what_is_not_served_is_a_400_naming_it():
    err = refused(tools=[WEATHER])  # tool_choice defaults to "auto" with tools
    assert err.param == "tool_choice" and err.code == "unsupported_parameter" and "required" in err.message
    assert refused(tools=[WEATHER], tool_choice="auto").param == "tool_choice"
    assert refused(tool_choice="required").param == "tool_choice"  # no tools
    assert refused(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}).param == \
        "tool_choice.function.name"
    assert refused(tools=[{"type": "code_interpreter", "function": {"name": "x"}}], tool_choice="required").param \
        == "tools[0].type"
    assert refused(tools=[WEATHER, WEATHER], tool_choice="required").param == "tools"
    assert refused(tools=[{"type": "function", "function": {"name": "bad name!"}}]).param.startswith("tools[0]")
    assert refused(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}).param == \
        "tool_choice"
    bad_args = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    assert refused(messages=bad_args).param == "messages[0].tool_calls[0].function.arguments"
    assert refused(messages=[{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]).param == \
        "messages[0].tool_calls"


def test_auto_reads_hermes_calls_for_a_model_that_names_its_parser():
    tr = oa.translate_chat(chat(tools=[WEATHER, TIME]), parser_of={"tiny-llama": "hermes"}.get)
    assert "response_format" not in tr.body["params"] and len(tr.body["input"]["tools"]) == 2  # the model chooses
    said = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    view = {"id": "req_h", "status": "succeeded", "finish_reason": "eos",
            "output": {"text": said, "token_ids": [1], "prompt_tokens": 3, "completion_tokens": 1}}
    (choice,) = oa.completion_response(tr, [view], 0)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I will look.\n"
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] \
        == [("call_h_0", "get_weather", '{"city": "Rome"}'), ("call_h_1", "get_time", "{}")]
    for text in ("no call at all", '<tool_call>{"name": "get_time", "arguments": {}}',
                 "<tool_call>not json</tool_call>", '<tool_call>{"name": "get_time", "argu'):
        (choice,) = oa.completion_response(tr, [{**view, "output": {**view["output"], "text": text}}], 0)["choices"]
        complete = text.endswith("{}}")  # a last call cut before its closing tag still reads whole
        assert (choice["finish_reason"], choice["message"]["content"]) == (
            ("tool_calls", None) if complete else ("stop", text)), text

    maker = oa.ChunkMaker(oa.translate_chat(chat(stream=True, tools=[TIME]), parser_of=lambda m: "hermes"), "req_s", 0)
    pieces = ["Let me ", "see <", "b>ok</b> <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    content = "".join(c["choices"][0]["delta"]["content"] for p in pieces for c in maker.delta({"text": p}))
    assert content == "Let me see <b>ok</b> "  # a tag's possible start held back until known, then all held
    *calls, last = maker.final({"id": "req_s", "status": "succeeded", "finish_reason": "eos", "output": {}})
    assert calls[0]["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_takes_only_calls_a_client_can_send_back():
    """Arguments an assistant message could not carry back on the next turn (not an object) leave the answer
    text; arguments written as JSON text are read; parallel_tool_calls false keeps the first call."""
    def read(text: str, **kw: Any) -> tuple[Any, Any]:
        tr = oa.translate_chat(chat(tools=[WEATHER, TIME], **kw), parser_of=lambda m: "hermes")
        view = {"id": "req_a", "status": "succeeded", "finish_reason": "eos",
                "output": {"text": text, "token_ids": [1], "prompt_tokens": 1, "completion_tokens": 1}}
        message = oa.completion_response(tr, [view], 0)["choices"][0]["message"]
        return message["content"], [(c["function"]["name"], c["function"]["arguments"])
                                    for c in message.get("tool_calls") or ()]

    for arguments in ('"Paris"', "null", "[1]", '"{not json"'):
        text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
        assert read(text) == (text, []), arguments
    two = ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
           '<tool_call>{"name": "get_time", "parameters": {}}</tool_call>')
    assert read(two) == (None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])
    assert read(two, parallel_tool_calls=False) == (None, [("get_weather", '{"city": "Oslo"}')])


def test_auto_without_a_parser_is_refused_in_calls_and_batch_lines():
    """A model without a tool-call parser: "auto" is refused, on the route and in batch lines alike, saying why;
    a batch line for a model with one is read as the route reads it (its `Calls` kept with the line's ref)."""
    import msgspec

    from shared.batches import BatchError, ItemRef, parse_line
    from tests.unit.test_batches import lined

    assert refused(tools=[WEATHER], tool_choice="auto").param == "tool_choice"
    err = refused(tools=[WEATHER])
    assert "tool_call_parser" in err.message
    tr = oa.translate_chat(chat(tools=[WEATHER], tool_choice="none"), parser_of=lambda m: "hermes")
    assert tr.calls is None and "tools" not in tr.body["input"]
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat(tools=[TIME])})
    with pytest.raises(BatchError) as info:
        parse_line(line, 0, "/v1/chat/completions")
    assert info.value.param == "body.tool_choice" and "tool_call_parser" in info.value.message
    for parser, said in (("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
                         ("mistral", '[{"name": "get_time", "arguments": {}}]')):
        item = parse_line(line, 0, "/v1/chat/completions", parser_of=lambda m, p=parser: p)
        ref = msgspec.msgpack.decode(msgspec.msgpack.encode(item.ref("req_b")), type=ItemRef)
        view = {"id": "req_b", "status": "succeeded", "finish_reason": "eos",
                "output": {"text": said, "token_ids": [6], "prompt_tokens": 2, "completion_tokens": 1}}
        ok, out = lined(ref, view, 100)
        (choice,) = out["response"]["body"]["choices"]
        assert ok and choice["finish_reason"] == "tool_calls", parser
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_time", "arguments": "{}"}
        assert (len(call["id"]) == 9) == (parser == "mistral"), call["id"]  # Mistral's ids in batches too


def test_what_auto_cannot_be_asked_with():
    hermes: Any = lambda m: "hermes"  # noqa: E731
    with pytest.raises(oa.OpenAIError) as err:  # a format leaves the model no room to write a call
        oa.translate_chat(chat(tools=[TIME], response_format={"type": "json_object"}), parser_of=hermes)
    assert err.value.param == "tool_choice"
    with pytest.raises(oa.OpenAIError) as err:  # streamed text is held back: its log probabilities cannot follow
        oa.translate_chat(chat(tools=[TIME], stream=True, logprobs=True), parser_of=hermes)
    assert err.value.param == "logprobs"
    oa.translate_chat(chat(tools=[TIME], logprobs=True), parser_of=hermes)  # not streamed: they come whole


def test_free_form_json_with_an_integer_past_64_bits_is_refused_not_a_500():
    """Tool call arguments, tool parameters and schemas are any JSON: an integer msgpack cannot carry is a 422 naming
    it, caught where the body's text is checked (found by the OpenAPI fuzz test on a cluster run)."""
    from shared.errors import ValidationError

    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {
        "a": [1, 2**70]}}}]}
    with pytest.raises(ValidationError) as err:
        build_request({"input": {"messages": [call]}}, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)
    assert err.value.field == "input.messages[0].tool_calls[0].function.arguments.a[1]"
    schema = {"type": "json_schema", "schema": {"type": "integer", "maximum": -(2**64)}}
    with pytest.raises(ValidationError) as err:
        build_request({"input": {"prompt": "x"}, "params": {"response_format": schema}}, BUILTIN_MODELS["tiny-llama"],
                      "t", 1_000.0)
    assert err.value.field == "params.response_format.schema.maximum" and "64 bits" in err.value.message
    build_request({"input": {"input_ids": [1, 2, 3]}}, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)


def auto_answer(parser: str, text: str, **kw: Any) -> tuple[Any, Any, list[dict[str, Any]]]:
    """An "auto" answer read back for a model of `parser`'s format: (finish_reason, content, tool_calls)."""
    tr = oa.translate_chat(chat(tools=[WEATHER, TIME], **kw), parser_of=lambda m: parser)
    view = {"id": "req_f", "status": "succeeded", "finish_reason": "eos",
            "output": {"text": text, "token_ids": [1], "prompt_tokens": 1, "completion_tokens": 1}}
    (choice,) = oa.completion_response(tr, [view], 0)["choices"]
    return choice["finish_reason"], choice["message"]["content"], choice["message"].get("tool_calls") or []


def streamed(parser: str, pieces: list[str]) -> tuple[str, list[dict[str, Any]], str]:
    """The same, streamed in `pieces`: (content, tool_calls, finish_reason)."""
    maker = oa.ChunkMaker(oa.translate_chat(chat(stream=True, tools=[WEATHER, TIME]), parser_of=lambda m: parser),
                          "req_s", 0)
    chunks = [c for p in pieces for c in maker.delta({"text": p})]
    chunks += maker.final({"id": "req_s", "status": "succeeded", "finish_reason": "eos", "output": {}})
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or ()]
    return content, calls, chunks[-1]["choices"][0]["finish_reason"]


def named(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_auto_reads_llama3_json_calls():
    """Llama 3.1-3.3's JSON tool calls (vLLM's `llama3_json`): the answer is one `{"name", "parameters"}` object,
    or several joined by `;`, perhaps after `<|python_tag|>`; anything else is text."""
    two = '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    for text in (two, f"  {two}\n", f"<|python_tag|>{two};"):
        reason, content, calls = auto_answer("llama3_json", text)
        assert (reason, content) == ("tool_calls", None), text
        assert named(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
        assert [c["id"] for c in calls] == ["call_f_0", "call_f_1"]
    one = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'  # arguments as JSON text
    assert named(auto_answer("llama3_json", one)[2]) == [("get_weather", {"city": "Oslo"})]
    assert named(auto_answer("llama3_json", two, parallel_tool_calls=False)[2]) == [("get_weather", {"city": "Rome"})]
    for text in ("It is sunny.", 'Here: {"name": "get_time", "parameters": {}}', '{"name": "get_time", "param',
                 '{"name": "get_time", "parameters": {}} and more', '{"city": "Rome"}',
                 '{"name": "get_time", "parameters": [1]}'):
        assert auto_answer("llama3_json", text) == ("stop", text, []), text
    # streamed: an answer that opens with "{" may be calls, held to the end; any other streams at once
    assert streamed("llama3_json", ["", " ", '{"name": "get_time", ', '"parameters": {}}']) == (
        "", [{"index": 0, "id": "call_s_0", "type": "function",
              "function": {"name": "get_time", "arguments": "{}"}}], "tool_calls")
    assert streamed("llama3_json", ["It ", "is {sunny}."]) == ("It is {sunny}.", [], "stop")
    assert streamed("llama3_json", ["<|pyth", "on", " no"]) == ("<|python no", [], "stop")
    assert streamed("llama3_json", ['{"not": ', '"a call"}']) == ('{"not": "a call"}', [], "stop")
    # an answer that is JSON with a "name" but no arguments is an answer, not a call (no tag says otherwise)
    assert auto_answer("llama3_json", '{"name": "Alice", "age": 30}') == ("stop", '{"name": "Alice", "age": 30}', [])


def test_auto_reads_mistral_calls_with_ids_its_template_takes():
    """Mistral's calls (vLLM's `mistral`): a JSON list of `{"name", "arguments"}` after `[TOOL_CALLS]`, a control
    token the decoded text usually lacks. Call ids are 9 letters and digits, forced ones too: Mistral's chat
    templates refuse any other id when the calls come back on the next turn."""
    listed = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]'
    for text, content in ((listed, None), (f"[TOOL_CALLS] {listed}", None), (f"Sure. [TOOL_CALLS]{listed}", "Sure. ")):
        reason, got, calls = auto_answer("mistral", text)
        assert (reason, got) == ("tool_calls", content), text
        assert named(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
        ids = [c["id"] for c in calls]
        assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids) and len(set(ids)) == 2, ids
        assert ids == [c["id"] for c in auto_answer("mistral", text)[2]]  # the same answer, the same ids
    for text in ("[1, 2]", "[]", "[a list] of things", '[{"name": "get_time", "arguments": {}}] more', "Plain.",
                 '[{"name": "get_time", "arguments": {}}, {"name": 1}]'):
        assert auto_answer("mistral", text) == ("stop", text, []), text
    assert auto_answer("mistral", '[{"name": "Alice", "age": 3}]') == ("stop", '[{"name": "Alice", "age": 3}]', [])
    tagged = auto_answer("mistral", '[TOOL_CALLS][{"name": "get_time"}]')  # the tag says it is a call
    assert tagged[0] == "tool_calls" and named(tagged[2]) == [("get_time", {})]
    # after the tag, text the model wrote after its list is not read (as vLLM's parser); without it, it is text
    assert named(auto_answer("mistral", f"[TOOL_CALLS]{listed} Done.")[2]) == named(calls)
    content, calls, reason = streamed("mistral", ["Sure. [TOOL", "_CALLS]", listed])
    assert (content, reason) == ("Sure. ", "tool_calls") and [c["index"] for c in calls] == [0, 1]
    assert streamed("mistral", ["[1, ", "2]"]) == ("[1, 2]", [], "stop")
    tr = oa.translate_chat(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                stream=True), parser_of=lambda m: "mistral")
    (chunk,) = oa.ChunkMaker(tr, "req_m", 0).delta({"text": '{"city": '})
    forced_id = chunk["choices"][0]["delta"]["tool_calls"][0]["id"]
    assert len(forced_id) == 9 and forced_id.isalnum()


def test_auto_reads_mistral_v11_calls_one_tag_each():
    """Mistral's v11 and later tokenizers (Mistral Small 3.x, Ministral, Magistral, Devstral) write each call as
    `[TOOL_CALLS]name[ARGS]{arguments}`, v11 itself with `[CALL_ID]id` before `[ARGS]`; the text before the first tag
    is content; text after a call is not read, as vLLM's parser. A call cut short, or arguments that are not an
    object, leave the answer as text."""
    two = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'
    for text, content in ((two, None), (f"Sure. {two}", "Sure. "), (f"{two}\n", None),
                          (two.replace("[ARGS]", "[CALL_ID]a1B2c3D4e[ARGS]"), None),
                          (two.replace("[ARGS]", ""), None),  # [ARGS] missing: the arguments open at "{", as vLLM
                          ('[TOOL_CALLS] get_weather [ARGS] {"city": "Rome"} [TOOL_CALLS]get_time[ARGS]{} ', None),
                          (f"{two} and then some", None),
                          ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}, then[TOOL_CALLS]get_time[ARGS]{}', None)):
        reason, got, calls = auto_answer("mistral", text)
        assert (reason, got) == ("tool_calls", content), text
        assert named(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {})], text
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    one = '[TOOL_CALLS]get_weather[ARGS]"{\\"city\\": \\"Oslo\\"}"'  # arguments as JSON text of an object
    assert named(auto_answer("mistral", one)[2]) == [("get_weather", {"city": "Oslo"})]
    assert named(auto_answer("mistral", two, parallel_tool_calls=False)[2]) == [("get_weather", {"city": "Rome"})]
    for text in ('[TOOL_CALLS]get_weather[ARGS]{"city": "Ro', '[TOOL_CALLS]get_weather[ARGS][1, 2]',
                 "[TOOL_CALLS]", "[TOOL_CALLS]get_weather",
                 '[TOOL_CALLS]get weather[ARGS]{}', '[TOOL_CALLS]get_weather[ARGS]{}[TOOL_CALLS]oops',
                 'get_weather[ARGS]{"city": "Rome"}'):
        assert auto_answer("mistral", text) == ("stop", text, []), text
    content, calls, reason = streamed("mistral", ["Sure. [TOOL", "_CALLS]get_wea", 'ther[ARGS]{"city": ', '"Rome"}',
                                                  "[TOOL_CALLS]get_time[ARGS]{}"])
    assert (content, reason) == ("Sure. ", "tool_calls")
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert streamed("mistral", ["[TOOL_CALLS]get_weather[ARGS]", '{"city": "Ro']) == (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Ro', [], "stop")  # cut short: the text as it came


def test_auto_reads_pythonic_calls():
    """Llama 3.2's and 4's pythonic tool calls (vLLM's `pythonic`, `llama4_pythonic`): the answer is a Python list
    of calls by keyword, each value a literal; Llama 4 writes it between `<|python_start|>` and `<|python_end|>`.
    Anything else (text around it, positional arguments, an expression, a call cut short) is text."""
    two = '[get_weather(city="Rome", days=3, units=None), get_time(tz=\'CET\', offset=-1.5, exact=True)]'
    want = [("get_weather", {"city": "Rome", "days": 3, "units": None}),
            ("get_time", {"tz": "CET", "offset": -1.5, "exact": True})]
    for parser, text in (("pythonic", two), ("pythonic", f"  {two}\n"), ("llama4_pythonic", two),
                         ("llama4_pythonic", f"<|python_start|>{two}<|python_end|>"),
                         ("llama4_pythonic", f"<|python_start|>{two}")):
        reason, content, calls = auto_answer(parser, text)
        assert (reason, content) == ("tool_calls", None), (parser, text)
        assert named(calls) == want and [c["id"] for c in calls] == ["call_f_0", "call_f_1"]
    nested = '[search(query={"terms": ["a", "b"], "limit": 5}, tags=[])]'
    assert named(auto_answer("pythonic", nested)[2]) == [("search", {"query": {"terms": ["a", "b"], "limit": 5},
                                                                     "tags": []})]
    assert named(auto_answer("pythonic", "[get_time()]")[2]) == [("get_time", {})]
    (call,) = auto_answer("pythonic", '[get_weather(city="Zürich\\n")]')[2]
    assert call["function"]["arguments"] == '{"city": "Zürich\\n"}'  # as vLLM writes it: non-ASCII kept
    assert named(auto_answer("pythonic", two, parallel_tool_calls=False)[2]) == want[:1]
    for text in ("It is sunny.", f"Sure: {two}", f"{two} done", "[]", "[1, 2]", '[get_time("CET")]',
                 "[get_time(tz=zone)]", "[get_time(tz=1 + 2)]", '[get_time(tz="CET"', "[a.b(x=1)]",
                 "[get_time(**opts)]", '[f(x={1: "a"})]', '[f(x=(1, 2))]', '[f(x=-"a")]', "[f(x=b'raw')]",
                 "[f(x=1)] [g(y=2)]", "[" * 500 + "]" * 500, "[f(x=1e999)]"):
        assert auto_answer("pythonic", text) == ("stop", text, []), text
    # streamed: an answer that opens with "[" (or Llama 4's tag) may be calls, held to the end
    content, calls, reason = streamed("llama4_pythonic", ["<|python_start|>[get_", 'time(tz="CET")]', "<|python_end|>"])
    assert (content, reason) == ("", "tool_calls") and named(calls) == [("get_time", {"tz": "CET"})]
    assert streamed("pythonic", ["[not ", "a call]"]) == ("[not a call]", [], "stop")
    assert streamed("pythonic", ["Plain ", "[text]"]) == ("Plain [text]", [], "stop")


def test_the_worker_keeps_the_control_tokens_a_format_writes_its_calls_with():
    from shared.tool_call_formats import kept_tokens

    assert kept_tokens("mistral") == ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    assert kept_tokens("hermes") == ("<tool_call>", "</tool_call>")  # special in Hermes 2 Pro, text in Qwen's
    assert kept_tokens("llama3_json") == ("<|python_tag|>",)
    assert kept_tokens("llama4_pythonic") == ("<|python_start|>", "<|python_end|>")
    assert kept_tokens("") == kept_tokens("pythonic") == kept_tokens("granite") == ()


def test_every_parser_a_model_file_may_name_is_read():
    from shared.config import TOOL_CALL_PARSERS, ConfigError, ModelSpec
    from shared.states import Task
    from shared.tool_call_formats import FORMATS

    assert set(FORMATS) == set(TOOL_CALL_PARSERS)
    for parser in TOOL_CALL_PARSERS:
        ModelSpec(name="m", task=Task.GENERATE, source="builtin:tiny-llama", tool_call_parser=parser).validate()
    with pytest.raises(ConfigError, match="hermes, llama3_json, mistral, pythonic, llama4_pythonic"):
        ModelSpec(name="m", task=Task.GENERATE, source="builtin:tiny-llama", tool_call_parser="granite").validate()


WEATHER_FN = WEATHER["function"]


def test_the_deprecated_functions_are_served_as_tools_and_answered_as_function_call():
    """`functions` and `function_call` (OpenAI's deprecated function calling, which older clients still send): the
    same planning as `tools`, one call at most, the answer's `function_call` and finish_reason `function_call`."""
    forced = oa.translate_chat(chat(functions=[WEATHER_FN, TIME["function"]], function_call={"name": "get_weather"}))
    assert forced.body["params"]["response_format"] == {"type": "json_schema", "schema": WEATHER_FN["parameters"]}
    assert [t["function"]["name"] for t in forced.body["input"]["tools"]] == ["get_weather", "get_time"]
    view = {"id": "req_l", "status": "succeeded", "finish_reason": "stop",
            "output": {"text": '{"city": "Oslo"}', "token_ids": [1], "prompt_tokens": 1, "completion_tokens": 1}}
    (choice,) = oa.completion_response(forced, [view], 0)["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "refusal": None,
                                 "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert choice["finish_reason"] == "stop"  # as a forced tool call
    maker = oa.ChunkMaker(oa.translate_chat(chat(functions=[WEATHER_FN], function_call={"name": "get_weather"},
                                                 stream=True)), "req_l", 0)
    deltas = [c["choices"][0]["delta"] for p in ('{"city": ', '"Oslo"}') for c in maker.delta({"text": p})]
    assert deltas == [{"function_call": {"name": "get_weather", "arguments": '{"city": '}},
                      {"function_call": {"arguments": '"Oslo"}'}}]

    auto = oa.translate_chat(chat(functions=[WEATHER_FN, TIME["function"]]), parser_of=lambda m: "hermes")
    assert "response_format" not in auto.body["params"] and auto.calls is not None and auto.calls.single
    said = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    (choice,) = oa.completion_response(auto, [{**view, "finish_reason": "eos",
                                               "output": {**view["output"], "text": said}}], 0)["choices"]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"] == {"name": "get_time", "arguments": "{}"}  # the first call alone
    assert "tool_calls" not in choice["message"]
    maker = oa.ChunkMaker(oa.translate_chat(chat(functions=[TIME["function"]], stream=True),
                                            parser_of=lambda m: "hermes"), "req_a", 0)
    assert maker.delta({"text": said}) == []
    *calls, last = maker.final({"id": "req_a", "status": "succeeded", "finish_reason": "eos", "output": {}})
    assert calls[0]["choices"][0]["delta"] == {"function_call": {"name": "get_time", "arguments": "{}"}}
    assert last["choices"][0]["finish_reason"] == "function_call"
    none = oa.translate_chat(chat(functions=[WEATHER_FN], function_call="none"))
    assert none.calls is None and "tools" not in none.body["input"]


def test_the_deprecated_functions_refusals_name_the_deprecated_parameters():
    def param(**kw: Any) -> str | None:
        with pytest.raises(oa.OpenAIError) as err:
            oa.translate_chat(chat(**kw))
        return err.value.param

    assert param(functions=[WEATHER_FN]) == "function_call"  # "auto" with no parser for the model
    assert param(functions=[WEATHER_FN], function_call={"name": "nope"}) == "function_call.name"
    assert param(functions=[WEATHER_FN, WEATHER_FN], function_call="none") == "functions"
    assert param(functions=[{"description": "no name"}], function_call="none") == "functions[0].name"
    assert param(functions=[WEATHER_FN], function_call="sometimes") == "function_call"
    assert param(function_call={"name": "get_weather"}) == "function_call"  # no functions to choose from
    assert param(functions=[WEATHER_FN], tools=[WEATHER]) == "functions"  # one way or the other
    assert param(functions=[WEATHER_FN], function_call="required") == "function_call"  # not a value it takes
    assert param(functions=[WEATHER_FN], function_call={"name": "get_weather"},
                 response_format={"type": "json_object"}) == "function_call"
    with pytest.raises(oa.OpenAIError) as err:
        oa.translate_chat(chat(functions=[WEATHER_FN]))
    assert "{'name': ...}" in err.value.message and "required" not in err.value.message  # its own advice


def test_a_conversation_with_the_deprecated_function_turns_reaches_the_template_as_tool_turns():
    tr = oa.translate_chat(chat(functions=[WEATHER_FN], function_call="none", messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}},
        {"role": "function", "name": "get_weather", "content": "12 degrees"}]))
    assert tr.body["input"]["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call00001", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12 degrees", "tool_call_id": "call00001"}]  # 9 characters: Mistral's templates
    req = build_request(tr.body, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)  # the native checks take it
    assert req.input["messages"][2]["tool_call_id"] == "call00001"
    lone = oa.translate_chat(chat(messages=[{"role": "user", "content": "x"},
                                            {"role": "function", "name": "f", "content": "1"}]))
    assert lone.body["input"]["messages"][1]["tool_call_id"] == "call00001"  # no call before it: an id all the same
    call = {"name": "f", "arguments": "{}"}
    for message, param in (({"role": "user", "content": "x", "function_call": call}, "messages[0].function_call"),
                           ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "[1]"}},
                            "messages[0].function_call.arguments"),
                           ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{"}},
                            "messages[0].function_call.arguments"),
                           ({"role": "assistant", "content": None, "function_call": call, "tool_calls": [
                               {"id": "c", "type": "function", "function": call}]}, "messages[0].function_call")):
        with pytest.raises(oa.OpenAIError) as err:
            oa.translate_chat(chat(messages=[message]))
        assert err.value.param == param, message
