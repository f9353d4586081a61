"""OpenAI's Responses API (`POST /v1/responses`) driven by OpenAI's own client against a real gateway and worker
(the echo model, whose answer is its prompt) on real Redis: text, instructions, the client's stream helper, a tool
call and its output sent back, and the errors for what is not served."""

from __future__ import annotations

import dataclasses
import json
import time

import openai
import pytest
from openai import AsyncOpenAI

from tests.integration.test_echo_model import ECHO
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

SAID = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


async def test_the_official_client_gets_responses_streamed_or_not(redis_url, prefix):
    echo = dataclasses.replace(ECHO, max_input_tokens=512, max_new_tokens=256, tool_call_parser="hermes").validate()
    settings = make_settings(redis_url, prefix, models=(echo,))
    async with running_worker(settings, {}), running_gateway(settings) as gw, \
            AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key="none", max_retries=0) as client:
        r = await client.responses.create(model="echo", input="hello", max_output_tokens=8)
        assert r.object == "response" and r.id.startswith("resp_req_") and r.output_text == "hellohel"
        assert r.status == "incomplete" and r.incomplete_details and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage and (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (5, 8, 13)
        # instructions are the conversation's system message; text parts are joined as chat's (the echo says all)
        r = await client.responses.create(model="echo", instructions="sys", max_output_tokens=7, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "h"}, {"type": "input_text", "text": "i"}]}])
        assert r.output_text == "sys\nh\ni" and r.instructions == "sys"
        # streamed: the typed events, in order; cut by max_output_tokens, the stream ends response.incomplete
        events = [e async for e in await client.responses.create(model="echo", input="hello", max_output_tokens=8,
                                                                 stream=True)]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hellohel"
        assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        # the client's stream helper assembles them into the response (a stop string, the chat route's extension,
        # ends it: completed)
        async with client.responses.stream(model="echo", input="hello", max_output_tokens=8,
                                           extra_body={"stop": ["lo"]}) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == "hel" and final.output_text == "hel" and final.status == "completed"
        assert final.usage and final.usage.input_tokens == 5
        # a call the model chose (its parser's format): a function_call item, whole or streamed
        r = await client.responses.create(model="echo", input=SAID, tools=TOOLS, max_output_tokens=len(SAID))
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
        assert r.completed_at is not None and r.created_at <= r.completed_at <= time.time()
        stream_events = [e async for e in await client.responses.create(
            model="echo", input=SAID, tools=TOOLS, max_output_tokens=len(SAID), stream=True)]
        done = [e.item for e in stream_events if e.type == "response.output_item.done"]
        assert [(i.type, i.name, json.loads(i.arguments)) for i in done] == [("function_call", "get_weather",
                                                                              {"city": "Paris"})]
        assert stream_events[-1].type == "response.completed"
        # the next turn sends the call and its output back as items: they reach the template as a tool turn
        r = await client.responses.create(model="echo", max_output_tokens=12, input=[
            {"role": "user", "content": "w?"},
            {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert r.output_text.startswith("w?\n") and "sunny" in r.output_text
        # what needs a response kept, or is not served, is a 400 naming it
        for kwargs, param in (({"previous_response_id": "resp_x"}, "previous_response_id"),
                              ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                              ({"max_output_tokens": 0}, "max_output_tokens"),
                              ({"background": True}, "background")):
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(model="echo", input="hi", **kwargs)
            assert info.value.param == param, (kwargs, info.value)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="nope", input="hi")
