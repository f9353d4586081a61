"""The echo model (`kind: echo`) end to end: the real gateway over HTTP, real Redis, a real worker, no model."""

from __future__ import annotations

import pytest

from shared.config import ModelSpec
from shared.states import Task
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

ECHO = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=128,
                 max_new_tokens=64).validate()


async def test_an_echo_model_answers_through_the_gateway_and_the_worker(redis_url, prefix):
    settings = make_settings(redis_url, prefix, models=(ECHO,))
    async with running_worker(settings, {}) as w, running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/echo/requests?wait=10", json={
            "input": {"prompt": "hello"}, "params": {"max_new_tokens": 8}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "succeeded" and body["finish_reason"] == "length"
        assert body["output"]["text"] == "hellohel" and body["output"]["prompt_tokens"] == 5
        assert body["timings"]["compute_ms"] >= 0 and body["attempts"] == 1
        # the asynchronous path: a 202, then a long-poll woken by the done event
        r = await gw.client.post("/v1/models/echo/requests", json={
            "input": {"input_ids": [104, 105]}, "params": {"max_new_tokens": 3, "stop": ["ih"]}})
        assert r.status_code == 202, r.text
        got = (await gw.client.get(f"/v1/requests/{r.json()['id']}?wait=10")).json()
        assert got["status"] == "succeeded" and got["finish_reason"] == "stop" and got["output"]["text"] == "h"
        # the gateway counts the echo model's tokens (UTF-8 bytes) and refuses what is too long at submit
        r = await gw.client.post("/v1/models/echo/requests", json={"input": {"prompt": "é" * 65}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "input.prompt"
        models = (await gw.client.get("/v1/models")).json()["models"]
        assert models[0]["kind"] == "echo" and models[0]["workers"] == 1
        assert w.model_calls("echo") and all(n == 1 for n in w.model_calls("echo").values())


async def test_tool_choice_auto_reads_a_models_hermes_calls_from_its_text(redis_url, prefix):
    """A model whose file names `tool_call_parser: hermes` serves OpenAI's tool_choice "auto": the calls it writes
    in <tool_call> blocks come back as `tool_calls`, the text before them as content, streamed or not (the echo
    model writes back what it is sent, so the test chooses what the model says)."""
    import dataclasses
    import json

    echo = dataclasses.replace(ECHO, name="hermes-echo", max_input_tokens=512, max_new_tokens=256,
                               tool_call_parser="hermes").validate()
    said = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
    body = {"model": "hermes-echo", "messages": [{"role": "user", "content": said}], "tools": tools,
            "max_tokens": len(said.encode()), "temperature": 0}
    settings = make_settings(redis_url, prefix, models=(echo, ECHO))
    async with running_worker(settings, {}), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking. "
        calls = choice["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
        r = await gw.client.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        streamed = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or ()]
        assert content == "Checking. " and [t["function"]["name"] for t in streamed] == ["get_weather", "get_time"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        plain = {**body, "messages": [{"role": "user", "content": "just <tool text"}], "max_tokens": 15}
        r = await gw.client.post("/v1/chat/completions", json=plain)  # no call: a plain answer
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "just <tool text",
                                                      "refusal": None}
        r = await gw.client.post("/v1/chat/completions", json={**body, "model": "echo"})  # no parser: refused
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize(("parser", "said"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"tz": "CET"}}'),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"tz": "CET"}}]'),
    # Mistral's v11 tokenizers on: a tag before each call, [ARGS] after its name (the echo says them as text)
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'),
    ("pythonic", '[get_weather(city="Paris"), get_time(tz="CET")]'),
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Paris"), get_time(tz="CET")]<|python_end|>'),
])
async def test_tool_choice_auto_reads_llama3_mistral_and_pythonic_calls(redis_url, prefix, parser, said):
    """Models whose files name `tool_call_parser: llama3_json`, `mistral`, `pythonic` or `llama4_pythonic`: an
    answer that is their calls comes back as `tool_calls` (no content), streamed or not; a plain answer streams as
    text."""
    import dataclasses
    import json

    echo = dataclasses.replace(ECHO, name="calls-echo", max_input_tokens=512, max_new_tokens=256,
                               tool_call_parser=parser).validate()
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
    body = {"model": "calls-echo", "messages": [{"role": "user", "content": said}], "tools": tools,
            "max_tokens": len(said.encode()), "temperature": 0}
    want = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    settings = make_settings(redis_url, prefix, models=(echo,))
    async with running_worker(settings, {}), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
        if parser == "mistral":
            assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
        r = await gw.client.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        streamed = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or ()]
        assert content == "" and [(t["function"]["name"], json.loads(t["function"]["arguments"]))
                                  for t in streamed] == want
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        plain = {**body, "messages": [{"role": "user", "content": "just {text}"}], "max_tokens": 11, "stream": True}
        r = await gw.client.post("/v1/chat/completions", json=plain)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "just {text}"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # not tool_calls: the echo ran to max_tokens
