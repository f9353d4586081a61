"""The OpenAI-compatible routes, driven by OpenAI's own Python client (sync and async) against a real
gateway and worker on real Redis: models, completions and chat completions (streamed and not),
embeddings (float and the client's default base64), a 429 the client retries, errors as typed exceptions."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import httpx
import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from gateway import routes
from gateway.api import ApiRequest
from shared.keys import Keys
from shared.tenants import TenantStore
from tests.stack import RunningGateway, make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

PROMPT_IDS = [5, 17, 300, 42, 7]


def reference_ids(loaded: Any, prompt_ids: list[int], n: int, **generate: Any) -> list[int]:
    out = loaded.model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0, **generate)
    return out[0, len(prompt_ids):].tolist()


Clients = Callable[..., tuple[OpenAI, AsyncOpenAI]]


@pytest.fixture
async def clients() -> AsyncIterator[Clients]:
    """Makes OpenAI's sync and async clients for a gateway (`base_url` its /v1); closes them afterwards."""
    made: list[tuple[OpenAI, AsyncOpenAI]] = []

    def make(gw: RunningGateway, key: str = "none", **kw: Any) -> tuple[OpenAI, AsyncOpenAI]:
        made.append((OpenAI(base_url=f"{gw.base_url}/v1", api_key=key, **kw),
                     AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key=key, **kw)))
        return made[-1]

    yield make
    for sync, client in made:
        sync.close()
        await client.close()


@pytest.fixture
async def stack(redis_url: str, prefix: str, loaded_models: dict[str, Any]) -> AsyncIterator[RunningGateway]:
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        yield gw


async def test_models_list_and_retrieve(stack: RunningGateway, clients: Clients):
    sync, client = clients(stack)
    page = await client.models.list()
    assert {m.id for m in page.data} == {"minilm", "tiny-llama"}
    assert all(m.object == "model" and m.owned_by == "batchgate" for m in page.data)
    native = (await stack.client.get("/v1/models")).json()
    assert {m["name"] for m in native["models"]} == {"minilm", "tiny-llama"}  # the native answer is kept
    model = await asyncio.to_thread(sync.models.retrieve, "tiny-llama")
    assert model.id == "tiny-llama" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        await client.models.retrieve("nope")
    assert info.value.code == "model_not_found"


async def test_completion_matches_the_reference_generation(stack: RunningGateway, loaded_models, clients: Clients):
    sync, client = clients(stack)
    tok = loaded_models["tiny-llama"].tokenizer
    expected = tok.decode(reference_ids(loaded_models["tiny-llama"], PROMPT_IDS, 12), skip_special_tokens=True)
    resp = await asyncio.to_thread(sync.completions.create, model="tiny-llama", prompt=PROMPT_IDS, max_tokens=12,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-req_") and resp.model == "tiny-llama"
    (choice,) = resp.choices
    assert choice.text == expected and choice.finish_reason == "length" and choice.index == 0
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (5, 12, 17)
    # the same request as a stream: its chunks add up to the same text, then the finish_reason
    chunks = [c async for c in await client.completions.create(
        model="tiny-llama", prompt=PROMPT_IDS, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True})]
    assert all(c.object == "text_completion" and c.id.startswith("cmpl-req_") for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


async def test_penalties_reach_the_engine(stack: RunningGateway, loaded_models, clients: Clients):
    """OpenAI's penalties and vLLM's repetition_penalty (the same formulas as `generate`'s, checked token for token
    in tests/integration/test_penalties.py) change what is generated; out of range, they are 400s naming them."""
    sync, client = clients(stack, max_retries=0)
    loaded = loaded_models["tiny-llama"]
    expected = loaded.tokenizer.decode(reference_ids(loaded, PROMPT_IDS, 12, repetition_penalty=3.0),
                                       skip_special_tokens=True)
    resp = await asyncio.to_thread(sync.completions.create, model="tiny-llama", prompt=PROMPT_IDS, max_tokens=12,
                                   temperature=0, extra_body={"ignore_eos": True, "repetition_penalty": 3.0})
    assert resp.choices[0].text == expected
    assert expected != loaded.tokenizer.decode(reference_ids(loaded, PROMPT_IDS, 12), skip_special_tokens=True)
    forced = 42  # +100 outweighs everything else, the penalties on its repeats included
    resp = await client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, logit_bias={str(forced): 100}, frequency_penalty=2,
                                                presence_penalty=2, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == loaded.tokenizer.decode([forced] * 3, skip_special_tokens=True)
    first = reference_ids(loaded, PROMPT_IDS, 1)[0]  # banned: greedy picks another first token
    resp = await client.completions.create(model="tiny-llama", prompt=PROMPT_IDS, max_tokens=4, temperature=0,
                                           logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    biased = reference_ids(loaded, PROMPT_IDS, 4, sequence_bias={(first,): -100.0})
    assert biased[0] != first and resp.choices[0].text == loaded.tokenizer.decode(biased, skip_special_tokens=True)
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("logit_bias", {"x": 1}), ("logit_bias", {"10000000": 1})):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="tiny-llama", prompt="hi", extra_body={field: value})
        assert info.value.param == field and f"- {field}: " in info.value.message, info.value.message


async def test_chat_completion_streamed_and_not(stack: RunningGateway, clients: Clients):
    sync, client = clients(stack)
    messages: list[Any] = [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    resp = await client.chat.completions.create(model="tiny-llama", messages=messages, max_completion_tokens=10,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-req_")
    message = resp.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str) and message.content
    assert resp.choices[0].finish_reason == "length" and resp.usage and resp.usage.completion_tokens == 10

    def streamed() -> list[Any]:
        with sync.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True}) as stream:
            return list(stream)

    chunks = await asyncio.to_thread(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 10


async def test_continuous_usage_stats_from_the_official_client(stack: RunningGateway, clients: Clients):
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`), as its users send it: every chunk's
    usage counts the prompt and the output so far, chat and completions, and ends at the final usage."""
    sync, _ = clients(stack)
    options: Any = {"include_usage": True, "continuous_usage_stats": True}

    def streamed(create: Any, **kw: Any) -> list[Any]:
        with create(model="tiny-llama", max_tokens=9, temperature=0, stream=True, stream_options=options,
                    extra_body={"ignore_eos": True}, **kw) as stream:
            return list(stream)

    for create, kw in ((sync.chat.completions.create, {"messages": [{"role": "user", "content": "count"}]}),
                       (sync.completions.create, {"prompt": "Once upon a time"})):
        chunks = await asyncio.to_thread(streamed, create, **kw)
        final = chunks[-1].usage
        assert chunks[-1].choices == [] and final is not None and final.completion_tokens == 9
        assert all(c.usage is not None and c.usage.prompt_tokens == final.prompt_tokens > 0 for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 9 and len(set(counts)) > 2, counts
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        if create == sync.chat.completions.create:
            assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0


async def test_return_token_ids_from_the_official_client(stack: RunningGateway, loaded_models, clients: Clients):
    """vLLM's `return_token_ids`, as RL and agent frameworks send it: the prompt's token ids and the output's beside
    the text, chat and completions, whole and streamed (the prompt's with the first chunk, each chunk its text's)."""
    sync, _ = clients(stack)
    loaded = loaded_models["tiny-llama"]
    messages: list[Any] = [{"role": "user", "content": "count"}]
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    kw: dict[str, Any] = dict(model="tiny-llama", max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True, "return_token_ids": True})
    raw = await asyncio.to_thread(sync.chat.completions.with_raw_response.create, messages=messages, **kw)
    body = json.loads(raw.text)
    out = reference_ids(loaded, list(prompt), 7)
    assert body["prompt_token_ids"] == list(prompt) and body["choices"][0]["token_ids"] == out
    assert body["choices"][0]["message"]["content"] == loaded.tokenizer.decode(out, skip_special_tokens=True)

    def streamed(create: Any, **more: Any) -> list[dict[str, Any]]:
        with create(stream=True, **kw, **more) as stream:
            return [chunk.model_dump() for chunk in stream]

    chunks = await asyncio.to_thread(streamed, sync.chat.completions.create, messages=messages)
    assert chunks[0]["prompt_token_ids"] == list(prompt)
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()] == out
    chunks = await asyncio.to_thread(streamed, sync.completions.create, prompt=PROMPT_IDS)
    firsts = [ch for c in chunks for ch in c["choices"] if ch.get("prompt_token_ids")]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == PROMPT_IDS
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()] == reference_ids(
        loaded, PROMPT_IDS, 7)


async def test_chat_template_kwargs_and_documents_are_taken_from_the_official_client(stack: RunningGateway,
                                                                                    clients: Clients):
    """vLLM's `chat_template_kwargs`, as its users send them (`extra_body`): accepted and served through the whole
    stack (the built-in template reads no such variable, so the answer is the plain one; that they reach a template
    that reads them is `test_chat_template_kwargs.py`'s); a name the rendering sets itself is a 400 naming the
    field."""
    _, client = clients(stack)
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    kw: dict[str, Any] = dict(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)
    plain = await client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    given = await client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "chat_template_kwargs": {
        "enable_thinking": False}})
    assert given.choices[0].message.content == plain.choices[0].message.content
    assert given.usage and plain.usage and given.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"add_generation_prompt": 0}})
    assert info.value.param == "chat_template_kwargs" and "set by the rendering itself" in info.value.message
    # vLLM's `documents` alike (that a template reading them shows them is `test_documents.py`'s)
    docs = [{"title": "t", "text": "the bridge opened in 1932"}]
    grounded = await client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "documents": docs})
    assert grounded.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**kw, extra_body={"documents": [{"text": 1932}]})
    assert str(info.value.param).startswith("documents")
    # a template of the request's own: refused where the model's file does not trust it, as vLLM without
    # --trust-request-chat-template (that a trusting model renders it is `test_model_chat_template.py`'s)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**kw, extra_body={"chat_template": "{{ messages[0].content }}"})
    assert info.value.param == "chat_template" and "trust_request_chat_template" in info.value.message


async def test_vllms_output_fields_from_the_official_client(stack: RunningGateway, loaded_models, clients: Clients):
    """vLLM's `continue_final_message` (with `add_generation_prompt: false`), `min_tokens`,
    `include_stop_str_in_output`, `skip_special_tokens`, `allowed_token_ids` and `truncate_prompt_tokens`, as its
    users send them (`extra_body`), through the whole stack: the continued answer is the greedy continuation of
    the conversation transformers renders so; min_tokens holds a stop token off as generate's min_new_tokens
    does."""
    _, client = clients(stack)
    loaded = loaded_models["tiny-llama"]
    begun: list[Any] = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi there, I"}]
    ids = loaded.tokenizer.apply_chat_template(begun, add_generation_prompt=False, continue_final_message=True,
                                               return_dict=False)
    got = await client.chat.completions.create(model="tiny-llama", messages=begun, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True, "add_generation_prompt": False,
                                                           "continue_final_message": True})
    assert got.usage is not None and got.usage.prompt_tokens == len(ids)
    want = loaded.tokenizer.decode(reference_ids(loaded, list(ids), 6), skip_special_tokens=True)
    assert got.choices[0].message.content == want
    # with vLLM's chat `echo`, the answer is the begun message and its continuation, whole and streamed
    echo: dict[str, Any] = dict(model="tiny-llama", messages=begun, max_tokens=6, temperature=0, extra_body={
        "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True, "echo": True})
    whole = await client.chat.completions.create(**echo)
    assert whole.choices[0].message.content == "Hi there, I" + want
    streamed = [c async for c in await client.chat.completions.create(**echo, stream=True)]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "Hi there, I" + want
    stop = reference_ids(loaded, PROMPT_IDS, 1)[0]  # drawn first, and biased to be drawn every step
    kw: dict[str, Any] = dict(model="tiny-llama", prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                              logit_bias={str(stop): 100})
    early = await client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert early.choices[0].finish_reason == "stop" and early.usage and early.usage.completion_tokens == 1
    assert early.choices[0].text == ""  # the stop token's text left out
    held = await client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [stop],
                                                             "min_tokens": 4, "include_stop_str_in_output": True,
                                                             "skip_special_tokens": False})
    assert held.choices[0].finish_reason == "stop" and held.usage and held.usage.completion_tokens == 5, held
    text = loaded.tokenizer.decode([stop])
    assert held.choices[0].text.endswith(text) and len(held.choices[0].text) > len(text)
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(**kw, extra_body={"min_tokens": 9})
    assert info.value.param == "min_tokens"
    # allowed_token_ids outweighs the bias: the one token allowed, every step
    only = await client.completions.create(**kw, extra_body={"ignore_eos": True, "allowed_token_ids": [stop + 1]})
    assert only.choices[0].text == loaded.tokenizer.decode([stop + 1] * 8, skip_special_tokens=True)
    cut = await client.completions.create(model="tiny-llama", prompt=PROMPT_IDS * 3, max_tokens=4, temperature=0,
                                          extra_body={"truncate_prompt_tokens": len(PROMPT_IDS)})
    assert cut.usage is not None and cut.usage.prompt_tokens == len(PROMPT_IDS)
    want = loaded.tokenizer.decode(reference_ids(loaded, PROMPT_IDS, 4), skip_special_tokens=True)
    assert cut.choices[0].text == want  # the kept tokens' continuation
    for bad in ({"allowed_token_ids": []}, {"bad_words": [""]}, {"truncate_prompt_tokens": 0}):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(**kw, extra_body=bad)
        assert info.value.param == next(iter(bad))


async def test_a_stop_string_cut_inside_the_first_token_streams_the_same_text(stack: RunningGateway, loaded_models,
                                                                            clients: Clients):
    _, client = clients(stack)
    tok = loaded_models["tiny-llama"].tokenizer
    ref = reference_ids(loaded_models["tiny-llama"], PROMPT_IDS, 8)
    first, full = tok.decode(ref[:1], skip_special_tokens=True), tok.decode(ref, skip_special_tokens=True)
    stop = full[2:5]
    assert len(first) >= 5 and full.find(stop) == 2, (first, full)  # the cut falls inside the first token
    kw: dict[str, Any] = dict(model="tiny-llama", prompt=PROMPT_IDS, max_tokens=8, temperature=0, stop=[stop])
    whole = await client.completions.create(**kw)
    assert whole.choices[0].text == full[:2] and whole.choices[0].finish_reason == "stop"
    chunks = [c async for c in await client.completions.create(**kw, stream=True)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:2]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_embeddings_float_and_base64(stack: RunningGateway, clients: Clients):
    sync, client = clients(stack)
    native = (await stack.client.post("/v1/models/minilm/requests?wait=20",
                                      json={"input": {"texts": ["hello", "world"]}})).json()
    expected = torch.tensor(native["output"]["embeddings"])
    as_floats = await client.embeddings.create(model="minilm", input=["hello", "world"], encoding_format="float")
    default = await asyncio.to_thread(sync.embeddings.create, model="minilm", input=["hello", "world"])  # base64
    for resp in (as_floats, default):
        assert resp.object == "list" and resp.model == "minilm" and [d.index for d in resp.data] == [0, 1]
        got = torch.tensor([d.embedding for d in resp.data])
        assert got.shape == (2, 384) and torch.allclose(got, expected, atol=1e-5)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens > 0
    one = await client.embeddings.create(model="minilm", input="hello")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    # a text longer than the model takes: the context error, with the route's own way to cut it
    with pytest.raises(openai.BadRequestError) as info:
        await client.embeddings.create(model="minilm", input=["hi", "words " * 2000])
    assert info.value.code == "context_length_exceeded" and info.value.param == "input[1]"
    assert "truncate_prompt_tokens" in info.value.message and "params." not in info.value.message
    cut = await client.embeddings.create(model="minilm", input=["hi", "words " * 2000],
                                         extra_body={"truncate_prompt_tokens": -1})
    assert len(cut.data) == 2 and cut.usage.prompt_tokens == 256 + 3  # the long text cut to what MiniLM takes


async def test_the_deadline_header_and_body_field_reach_the_native_request(stack: RunningGateway, clients: Clients):
    _, client = clients(stack, default_headers={"X-Batchgate-Timeout": "7"})
    resp = await client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
    record = (await stack.client.get(f"/v1/requests/{resp.id.removeprefix('cmpl-')}")).json()
    assert record["deadline"] - record["created_at"] == pytest.approx(7, abs=0.01)
    resp = await client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2,
                                           extra_body={"timeout_s": 9, "priority": "batch"})
    record = (await stack.client.get(f"/v1/requests/{resp.id.removeprefix('cmpl-')}")).json()
    assert record["deadline"] - record["created_at"] == pytest.approx(9, abs=0.01)
    assert record["priority"] == "batch"


async def test_bad_requests_are_typed_openai_errors(stack: RunningGateway, clients: Clients):
    _, client = clients(stack, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="tiny-llama", prompt="hi", suffix="after")
    assert info.value.status_code == 400 and info.value.param == "suffix"
    assert info.value.code == "unsupported_parameter"
    assert info.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:  # the native limit, named as OpenAI's parameter
        await client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                             max_completion_tokens=100_000)
    assert info.value.param == "max_completion_tokens" and "100000" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await client.embeddings.create(model="tiny-llama", input="x")
    assert info.value.param == "model" and "/v1/completions" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        await client.completions.create(model="gpt-nope", prompt="x")
    assert info.value.code == "model_not_found"
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):  # a 405 in OpenAI's shape too
        r = await stack.client.get(path)
        assert r.status_code == 405 and r.headers["allow"] == "POST", (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "method_not_allowed", error
        assert "GET" in error["message"] and error["param"] is None


async def test_a_rate_limited_call_is_retried_by_the_client(redis_url, prefix, loaded_models, clients: Clients):
    settings = make_settings(redis_url, prefix, tenant_rate_per_s=2.0, tenant_burst=1)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        _, client = clients(gw)
        first = await gw.client.post("/v1/embeddings", json={"model": "minilm", "input": "x"})
        assert first.status_code == 200, first.text
        refused = await gw.client.post("/v1/embeddings", json={"model": "minilm", "input": "x"})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert 0 < int(refused.headers["retry-after-ms"]) <= 500 and refused.headers["retry-after"] == "1"
        raw = await client.embeddings.with_raw_response.create(model="minilm", input="hello")
        assert raw.retries_taken == 1 and len(raw.parse().data) == 1
        _, no_retry = clients(gw, max_retries=0)
        with pytest.raises(openai.RateLimitError):
            await no_retry.embeddings.create(model="minilm", input="hello")


async def test_n_choices_take_the_tenants_rate_together(redis_url, prefix, monkeypatch):
    """A call of n choices takes n of its tenant's rate tokens with its first choice: a call of 2 right after
    another is refused before any choice is accepted, and is accepted once the bucket holds 2 again (its
    Retry-After); a burst below n delays such a call, never refuses it for good."""
    from gateway import openai_api

    abandoned: list[str] = []
    monkeypatch.setattr(openai_api, "_abandon", lambda svc, tenant, rid: abandoned.append(rid))
    settings = make_settings(redis_url, prefix, tenant_rate_per_s=0.5, tenant_burst=1)  # a token per 2 s
    body = {"model": "tiny-llama", "prompt": "hi", "n": 2, "max_tokens": 4, "stream": True}
    async with running_gateway(settings) as gw:  # no worker: a streamed call is answered once its choices are in

        async def call() -> httpx.Response:
            async with gw.client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                return resp

        first = await call()
        ids = first.headers["x-batchgate-request-ids"].split(",")
        assert first.status_code == 200 and len(ids) == 2
        refused = await call()
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error", refused.text
        assert set(abandoned) <= set(ids)  # only the first call's (its stream closed): the refused one accepted none
        await asyncio.sleep(int(refused.headers["retry-after-ms"]) / 1000 + 0.05)
        again = await call()
        assert again.status_code == 200 and len(again.headers["x-batchgate-request-ids"].split(",")) == 2


async def test_n_choices_past_the_tenants_backlog_quota(redis_url, prefix, monkeypatch):
    """More choices than the quota can never fit: a 400 no client retries. Choices that fit the quota but meet it
    full part-way are refused whole: those accepted before are cancelled, since a retry makes new ones, unless an
    Idempotency-Key lets the retry find them."""
    from gateway import openai_api

    abandoned: list[str] = []
    abandon = openai_api._abandon
    monkeypatch.setattr(openai_api, "_abandon", lambda svc, tenant, rid: (abandoned.append(rid),
                                                                          abandon(svc, tenant, rid)))
    settings = make_settings(redis_url, prefix, tenant_max_backlog=2)
    async with running_gateway(settings) as gw:  # no worker: what is queued holds its slot
        body = {"model": "tiny-llama", "prompt": "hi", "n": 3, "max_tokens": 4}
        never = await gw.client.post("/v1/completions", json=body)
        assert never.status_code == 400 and never.json()["error"]["param"] == "n", never.text
        assert never.json()["error"]["code"] == "tenant_backlog_exceeded" and not abandoned
        long = {"input": {"prompt": "hi"}, "params": {"max_new_tokens": 256, "ignore_eos": True}}
        held = (await gw.client.post("/v1/models/tiny-llama/requests", json=long)).json()["id"]  # one slot taken
        refused = await gw.client.post("/v1/completions", json={**body, "n": 2, "max_tokens": 256})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_backlog_full", refused.text
        assert len(abandoned) == 1
        record = (await gw.client.get(f"/v1/requests/{abandoned[0]}", params={"wait": 10})).json()
        assert record["status"] == "cancelled", record
        keyed = await gw.client.post("/v1/completions", json={**body, "n": 2, "max_tokens": 256},
                                     headers={"Idempotency-Key": "n-two"})
        assert keyed.status_code == 429 and len(abandoned) == 1  # kept for the retry to find: it holds a slot
        full = await gw.client.post("/v1/models/tiny-llama/requests", json=long)
        assert full.status_code == 429 and full.json()["error"]["code"] == "tenant_backlog_full", full.text
        await gw.client.post(f"/v1/requests/{held}/cancel")


async def test_a_keyed_retry_that_changes_the_number_of_choices_is_a_conflict(redis_url, prefix):
    """Each choice is keyed on its own (the first with the call's key, the next with keys derived from it): a retry
    with the same key and another `n` matched the choices both calls have, made the new ones and answered a
    mix. It is another call: a 409, as a changed body is; the same call again finds its choices."""
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:  # no worker: the calls wait, their caller leaves, they go on
        body = {"model": "tiny-llama", "prompt": "hi", "n": 2, "max_tokens": 4}

        async def call(**change: object) -> httpx.Response | None:
            try:
                return await gw.client.post("/v1/completions", json={**body, **change}, timeout=1.0,
                                            headers={"Idempotency-Key": f"{prefix}-n"})
            except httpx.TimeoutException:
                return None  # waiting for its choices: accepted

        assert await call() is None
        for change in ({"n": 3}, {"n": 1}, {"best_of": 3}):
            conflict = await call(**change)
            assert conflict is not None and conflict.status_code == 409, (change, conflict)
            assert conflict.json()["error"]["code"] == "idempotency_conflict"
        assert await call() is None  # the same call: a replay, waiting for the same two
        from shared.idempotency_keys import derived_key

        svc, key = gw.service, f"{prefix}-n"
        kept = [await svc.redis.exists(svc.keys.idempotency("default", k))
                for k in (key, derived_key(key, 1), derived_key(key, 2))]
        assert kept == [1, 1, 0]  # the two choices' keys; no third choice made by a retry


async def test_a_deadline_its_own_compute_cannot_meet_is_not_retried_by_the_client(stack: RunningGateway):
    """A 429 that no retry can change (the request's own compute, with no queue, passes its deadline) carries
    `x-should-retry: false`: OpenAI's client raises at once instead of submitting it twice more."""
    body = {"model": "tiny-llama", "prompt": "once upon a time " * 20, "max_tokens": 256, "ignore_eos": True,
            "timeout_s": 0.05}
    warm = await stack.client.post("/v1/completions", json={**body, "max_tokens": 8, "timeout_s": 30})
    assert warm.status_code == 200, warm.text  # the worker has measured its step time: admission estimates
    for _ in range(100):  # until the worker's figures reach the gateway
        refused = await stack.client.post("/v1/completions", json=body)
        if refused.status_code == 429:
            break
        await asyncio.sleep(0.05)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "deadline_infeasible", refused.text
    assert refused.headers["x-should-retry"] == "false" and "of compute" in refused.json()["error"]["message"]
    sent: list[str] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request.url.path)

    async with AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=2,
                           http_client=httpx.AsyncClient(event_hooks={"request": [count]})) as client:
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(model="tiny-llama", prompt=body["prompt"], max_tokens=256,
                                            extra_body={"timeout_s": 0.05, "ignore_eos": True})
    assert info.value.code == "deadline_infeasible" and sent == ["/v1/completions"]
    # the native route says the same (its 429 keeps Retry-After, as documented)
    native = await stack.client.post("/v1/models/tiny-llama/requests", json={
        "input": {"prompt": "hi"}, "params": {"max_new_tokens": 256, "ignore_eos": True}, "timeout_s": 0.05})
    assert native.status_code == 429 and native.headers["x-should-retry"] == "false" and native.headers["retry-after"]


async def test_a_wrong_api_key_is_an_authentication_error(redis_url, prefix, loaded_models, clients: Clients):
    settings = make_settings(redis_url, prefix, auth="api_key")
    async with running_gateway(settings) as gw:
        key = await TenantStore(gw.service.redis, Keys(prefix)).create_key("acme")
        _, client = clients(gw, key="bg_wrong")
        with pytest.raises(openai.AuthenticationError) as info:  # in OpenAI's shape on its routes, /v1/models too
            await client.models.list()
        assert info.value.code == "invalid_api_key" and info.value.type == "authentication_error"
        wrong = await gw.client.delete("/v1/models")
        assert wrong.status_code == 405 and "GET" in wrong.headers["allow"]
        assert wrong.json()["error"]["type"] == "invalid_request_error" and "param" in wrong.json()["error"]
        with pytest.raises(openai.AuthenticationError) as info:
            await client.completions.create(model="tiny-llama", prompt="x")
        assert info.value.code == "invalid_api_key" and info.value.type == "authentication_error"
        _, client = clients(gw, key=key)
        with pytest.raises(openai.NotFoundError):  # authenticated: the model is unknown, not the key
            await client.completions.create(model="gpt-nope", prompt="x")


async def test_the_stream_on_the_wire_and_buffered_for_lambda(stack: RunningGateway):
    """Plain `data:` lines ending with `data: [DONE]` (what curl and other SSE clients read), over HTTP and
    through `routes.handle` (Lambda, Cloud Functions), which sends the same frames at once."""
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "temperature": 0}
    async with stack.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("req_")
        lines = [line async for line in r.aiter_lines() if line and not line.startswith(":")]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    resp = await routes.handle(stack.service, ApiRequest("POST", "/v1/chat/completions",
                                                         headers={"content-type": "application/json"},
                                                         body=json.dumps(body).encode()))
    assert resp.status == 200 and resp.raw is not None
    frames = resp.raw.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and all(f.startswith("data: {") for f in frames[:-2])
    assert json.loads(frames[-3][6:])["choices"][0]["finish_reason"] in ("stop", "length")


async def test_a_stream_the_caller_leaves_is_cancelled(stack: RunningGateway, clients: Clients):
    _, client = clients(stack)
    stream = await client.completions.create(model="tiny-llama", prompt="hi", max_tokens=256, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        request_id = chunk.id.removeprefix("cmpl-")
        break
    await stream.close()
    for _ in range(100):
        record = (await stack.client.get(f"/v1/requests/{request_id}")).json()
        if record["status"] != "running":
            break
        await asyncio.sleep(0.05)
    assert record["status"] == "cancelled", record
    assert record["output"] is None or record["output"]["completion_tokens"] < 256


async def test_n_choices_streamed_and_not(stack: RunningGateway, loaded_models, clients: Clients):
    """`n` choices, each a request of its own batched with the others: greedy ones are the reference each; seeded
    sampled ones differ from each other and come again on the next call; streamed, each choice's chunks (by
    index) add up to the same text, then one usage chunk for all."""
    _, client = clients(stack)
    loaded = loaded_models["tiny-llama"]
    expected = loaded.tokenizer.decode(reference_ids(loaded, PROMPT_IDS, 6), skip_special_tokens=True)
    resp = await client.completions.create(model="tiny-llama", prompt=PROMPT_IDS, max_tokens=6, temperature=0, n=3,
                                           extra_body={"ignore_eos": True})
    assert [(c.index, c.text, c.finish_reason) for c in resp.choices] == [(i, expected, "length") for i in range(3)]
    assert resp.usage is not None and (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (5, 18)
    ask: dict[str, Any] = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                           "n": 2, "seed": 11, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    first, again = [await client.chat.completions.create(**ask) for _ in range(2)]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]
    stream = await client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    streamed = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts and len({c.id for c in chunks}) == 1
    ends = sorted((ch.index, ch.finish_reason) for c in chunks for ch in c.choices if ch.finish_reason)
    assert ends == [(0, "length"), (1, "length")]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1 and usages[0].completion_tokens == 16 and chunks[-1].choices == []


async def test_a_stream_of_n_choices_the_caller_leaves_is_cancelled_whole(stack: RunningGateway, clients: Clients):
    _, client = clients(stack)
    stream = await client.completions.create(model="tiny-llama", prompt="hi", max_tokens=256, temperature=0, n=2,
                                             stream=True, extra_body={"ignore_eos": True})
    ids = stream.response.headers["x-batchgate-request-ids"].split(",")
    async for _ in stream:
        break
    await stream.close()
    assert len(ids) == 2 and ids[0] == stream.response.headers["x-request-id"]
    for request_id in ids:  # a long-poll answers once the request is terminal
        record = (await stack.client.get(f"/v1/requests/{request_id}", params={"wait": 10})).json()
        assert record["status"] == "cancelled", record


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_a_caller_that_times_out_has_its_request_cancelled(stack: RunningGateway, clients: Clients, prefix,
                                                                 route):
    """OpenAI's clients retry a timeout as a new request: each try the caller left is cancelled, not computed in
    full for nobody (a 0.4 s timeout with the client's 2 retries generated 3 x 256 tokens)."""
    sync, _ = clients(stack, timeout=0.5, max_retries=1)
    kw: dict[str, Any] = dict(model="tiny-llama", max_tokens=256, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APITimeoutError):
        if route == "chat":
            await asyncio.to_thread(sync.chat.completions.create, messages=[{"role": "user", "content": "hi"}], **kw)
        else:
            await asyncio.to_thread(sync.completions.create, prompt="hi", **kw)
    records = [k async for k in stack.service.redis.scan_iter(match=Keys(prefix).record("*"))]
    assert len(records) == 2  # the try and its retry
    ids = [k.decode().split("{r:")[1].split("}")[0] for k in records]
    views = [(await stack.client.get(f"/v1/requests/{rid}", params={"wait": 10})).json() for rid in ids]  # long-polls
    assert [v["status"] for v in views] == ["cancelled", "cancelled"], views
    assert all(v["output"] is None or v["output"]["completion_tokens"] < 256 for v in views)


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_keyed_call_its_caller_leaves_goes_on_for_the_retry(stack: RunningGateway, clients: Clients,
                                                                     streamed: bool):
    """A call with an Idempotency-Key whose caller times out, or closes its stream, is not cancelled, none of its
    choices: the retry with that key finds the same requests and gets the whole answer (cancelled, every retry was
    a 409 for good)."""
    sync, client = clients(stack, max_retries=0)
    short, _ = clients(stack, timeout=0.5, max_retries=0)
    kw: dict[str, Any] = dict(model="tiny-llama", prompt="hi", max_tokens=256, temperature=0, n=2,
                              extra_body={"ignore_eos": True}, extra_headers={"Idempotency-Key": f"left-{streamed}"})
    if streamed:
        stream = await client.completions.create(**kw, stream=True)
        first = stream.response.headers["x-request-id"]
        async for _ in stream:
            break
        await stream.close()
    else:
        with pytest.raises(openai.APITimeoutError):
            await asyncio.to_thread(short.completions.create, **kw)
    await asyncio.sleep(0.3)  # the gateway has seen the caller go
    if streamed:
        again = await client.completions.create(**kw, stream=True)
        assert again.response.headers["x-request-id"] == first
        ids = again.response.headers["x-batchgate-request-ids"].split(",")
        chunks = [c async for c in again]
        texts = ["".join(ch.text for c in chunks for ch in c.choices if ch.index == i) for i in range(2)]
        assert sorted(ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason) == ["length"] * 2
    else:
        raw = await asyncio.to_thread(sync.completions.with_raw_response.create, **kw)
        resp, ids = raw.parse(), raw.headers["x-batchgate-request-ids"].split(",")
        assert [c.finish_reason for c in resp.choices] == ["length"] * 2
        assert resp.usage and resp.usage.completion_tokens == 2 * 256
        texts = [c.text for c in resp.choices]
    for rid, text in zip(ids, texts, strict=True):  # every choice went on, none cancelled for the retry to replay
        record = (await stack.client.get(f"/v1/requests/{rid}", params={"wait": 10})).json()
        assert record["status"] == "succeeded" and record["output"]["text"] == text


async def test_what_a_new_openai_user_meets_at_the_edges(stack: RunningGateway, clients: Clients):
    """An OpenAI endpoint this gateway lacks, a batch parameter it has no policy for, a prompt past the model's
    context: each an error the openai client reads, in OpenAI's shape and with OpenAI's code."""
    sync, _ = clients(stack, max_retries=0)
    r = await stack.client.post("/v1/moderations", json={"model": "tiny-llama", "input": "hi"})
    assert r.status_code == 404
    assert r.json()["error"] | {"message": ""} == {"code": "not_found", "message": "", "type": "invalid_request_error",
                                                   "param": None}
    with pytest.raises(openai.BadRequestError) as bad:
        await asyncio.to_thread(sync.batches.create, input_file_id="file-x", endpoint="/v1/chat/completions",
                                completion_window="24h", output_expires_after={"anchor": "created_at", "seconds": 3600})
    assert (bad.value.param, bad.value.code) == ("output_expires_after", "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as long:
        await asyncio.to_thread(sync.chat.completions.create, model="tiny-llama",
                                messages=[{"role": "user", "content": "hello " * 3000}])
    assert long.value.code == "context_length_exceeded"  # here the worker's count (the test gateway has no tokenizer)


async def test_a_wait_past_the_gateways_limit_is_504_naming_the_request(redis_url, prefix):
    """No worker, and the gateway's longest wait 0.2 s: 504 `wait_exceeded`, with the request's id in the body
    and in `X-Request-Id` (as every OpenAI-route answer carries it), so the caller can fetch the result later."""
    settings = make_settings(redis_url, prefix, max_wait_s=0.2)
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/chat/completions", json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 504 and r.json()["error"]["code"] == "wait_exceeded", r.text
        rid = r.headers["x-request-id"]
        assert rid.startswith("req_") and rid in r.json()["error"]["message"]
        assert (await gw.client.get(f"/v1/requests/{rid}")).json()["status"] == "queued"


async def test_a_model_on_the_wrong_route_is_named_in_plain_words(redis_url, prefix):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/chat/completions", json={
            "model": "minilm", "messages": [{"role": "user", "content": "hi"}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "wrong_model_task" and err["param"] == "model"
        assert err["message"] == "model: 'minilm' is an embedding model: use /v1/embeddings", err
        r = await gw.client.post("/v1/embeddings", json={"model": "tiny-llama", "input": "hi"})
        assert r.json()["error"]["message"].startswith("model: 'tiny-llama' is a generation model: use /v1/completions")


def model_logprobs(loaded: Any, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Each output token's log probability under the model: one uncached forward of prompt and output."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([prompt_ids + output_ids])).logits[0].float()
    scores = torch.log_softmax(logits, dim=-1)
    return [scores[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(output_ids)]


async def test_log_probabilities_streamed_and_not(stack: RunningGateway, loaded_models, clients: Clients):
    """OpenAI's logprobs as its client reads them: chat's `content` entries with `top_logprobs`, completions' four
    lists; the model's own log probabilities of the tokens generated, the same streamed or not."""
    _, client = clients(stack)
    loaded = loaded_models["tiny-llama"]
    ref = reference_ids(loaded, PROMPT_IDS, 8)
    want = model_logprobs(loaded, PROMPT_IDS, ref)
    tokens = [loaded.tokenizer.decode([t], skip_special_tokens=True) for t in ref]
    kw: dict[str, Any] = dict(model="tiny-llama", prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True})
    whole = (await client.completions.create(**kw, logprobs=3)).choices[0].logprobs
    assert whole is not None and whole.tokens == tokens and whole.token_logprobs == pytest.approx(want, abs=2e-4)
    assert whole.top_logprobs is not None and all(len(top) >= 3 and top[t] == lp for top, t, lp in zip(
        whole.top_logprobs, whole.tokens, whole.token_logprobs, strict=True))
    assert whole.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    chunks = [c async for c in await client.completions.create(**kw, logprobs=3, stream=True)]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens or ()] == tokens
    assert [o for lp in streamed for o in lp.text_offset or ()] == whole.text_offset
    assert [x for lp in streamed for x in lp.token_logprobs or ()] == whole.token_logprobs
    # vLLM's return_tokens_as_token_ids: the same tokens, named by their ids
    named = (await client.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                                    "return_tokens_as_token_ids": True}},
                                             logprobs=3)).choices[0].logprobs
    assert named is not None and named.tokens == [f"token_id:{t}" for t in ref]
    assert named.token_logprobs == whole.token_logprobs and named.text_offset == whole.text_offset

    messages: list[Any] = [{"role": "user", "content": "hello"}]
    chat_kw: dict[str, Any] = dict(model="tiny-llama", messages=messages, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2)
    resp = await client.chat.completions.create(**chat_kw)
    content = resp.choices[0].logprobs.content if resp.choices[0].logprobs else None
    assert content is not None and len(content) == 6
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
               and e.bytes == list(e.token.encode()) for e in content)
    chunks = [c async for c in await client.chat.completions.create(**chat_kw, stream=True)]
    sent = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or ()]
    assert [(e.token, e.logprob) for e in sent] == [(e.token, e.logprob) for e in content]
    plain = await client.chat.completions.create(**{**chat_kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**{**chat_kw, "top_logprobs": 21})
    assert info.value.param == "top_logprobs"


async def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(stack: RunningGateway, loaded_models,
                                                                   clients: Clients):
    """`echo` with `logprobs` and `max_tokens` 0 (or 1), as lm-evaluation-harness scores a continuation: the
    prompt's tokens with their log probabilities (the first null), the model's own."""
    _, client = clients(stack)
    loaded = loaded_models["tiny-llama"]
    tokens = [loaded.tokenizer.decode([t], skip_special_tokens=True) for t in PROMPT_IDS]
    want = model_logprobs(loaded, PROMPT_IDS[:1], PROMPT_IDS[1:])
    scored = await client.completions.create(model="tiny-llama", prompt=PROMPT_IDS, max_tokens=0, echo=True,
                                             logprobs=1, temperature=0)
    (choice,) = scored.choices
    assert choice.text == loaded.tokenizer.decode(PROMPT_IDS, skip_special_tokens=True)
    assert choice.logprobs is not None and choice.logprobs.tokens == tokens
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    # echo, then the continuation: the prompt's entries, then the completion's
    ref = reference_ids(loaded, PROMPT_IDS, 3)
    both = (await client.completions.create(model="tiny-llama", prompt=PROMPT_IDS, max_tokens=3, echo=True,
                                            logprobs=2, temperature=0, extra_body={"ignore_eos": True})).choices[0]
    assert both.text == loaded.tokenizer.decode(PROMPT_IDS, skip_special_tokens=True) + loaded.tokenizer.decode(
        ref, skip_special_tokens=True)
    assert both.logprobs is not None and len(both.logprobs.tokens) == len(PROMPT_IDS) + 3
    assert both.logprobs.token_logprobs[len(PROMPT_IDS):] == pytest.approx(
        model_logprobs(loaded, PROMPT_IDS, ref), abs=2e-4)
    said = (await client.completions.create(model="tiny-llama", prompt="once upon", max_tokens=2, echo=True,
                                            temperature=0)).choices[0]
    assert said.text.startswith("once upon") and said.logprobs is None


async def test_best_of_answers_the_candidate_likeliest_per_token(stack: RunningGateway, clients: Clients):
    """`best_of` candidates are requests of their own (named by X-Batchgate-Request-Ids); the answer is the one
    whose tokens have the highest mean log probability, and usage counts every candidate."""
    _, client = clients(stack)
    raw = await client.completions.with_raw_response.create(model="tiny-llama", prompt=PROMPT_IDS, max_tokens=6,
                                                            best_of=3, temperature=1.5, seed=11,
                                                            extra_body={"ignore_eos": True})
    resp = raw.parse()
    ids = raw.headers["x-batchgate-request-ids"].split(",")
    assert len(ids) == 3 and len(resp.choices) == 1 and resp.choices[0].logprobs is None
    records = [(await stack.client.get(f"/v1/requests/{rid}")).json() for rid in ids]
    means = [sum(e["logprob"] for e in r["output"]["logprobs"]) / 6 for r in records]
    assert len({r["output"]["text"] for r in records}) > 1  # sampled apart: the choice is a real one
    assert resp.choices[0].text == records[means.index(max(means))]["output"]["text"]
    assert resp.usage is not None and resp.usage.completion_tokens == 18
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="tiny-llama", prompt="hi", best_of=2, stream=True)
    assert info.value.param == "best_of"


async def test_structured_output_from_the_clients_own_helpers(stack: RunningGateway, clients: Clients):
    """`chat.completions.parse` with a pydantic model (the client sends a strict json_schema and parses the
    answer into the model), JSON mode streamed, vLLM's guided_choice and guided_regex through `extra_body`, and a
    schema that cannot be compiled refused as a typed 400 naming `response_format`."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)
        pet: Literal["cat", "dog"]

    sync, client = clients(stack, max_retries=0)
    messages = [{"role": "user", "content": "Who are you?"}]
    parsed = await asyncio.to_thread(sync.chat.completions.parse, model="tiny-llama", messages=messages,
                                     response_format=Person, max_tokens=80, temperature=0)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed
    # the Responses API's own helper: text.format from the model, the answer parsed back into it
    answered = await client.responses.parse(model="tiny-llama", input="Who are you?", text_format=Person,
                                            max_output_tokens=80, temperature=0)
    assert answered.status == "completed" and isinstance(answered.output_parsed, Person), answered
    assert answered.output_text == choice.message.content  # the same generation as chat's, greedy

    stream = await client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=30, stream=True, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": {
            "type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
            "additionalProperties": False}}})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(text)["pet"] in ("cat", "dog") and chunks[-1].choices[0].finish_reason == "stop"

    picked = await client.completions.create(model="tiny-llama", prompt="Colour:", max_tokens=10, temperature=1.0,
                                             n=3, seed=4, extra_body={"guided_choice": ["red", "dark blue"]})
    assert {c.text for c in picked.choices} <= {"red", "dark blue"} and len(picked.choices) == 3
    code = await client.completions.create(model="tiny-llama", prompt="Code:", max_tokens=10,
                                           extra_body={"guided_regex": "[A-Z]{2}-[0-9]{2}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{2}", code.choices[0].text), code.choices[0].text

    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="tiny-llama", messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert info.value.param == "response_format" and "objectx" in info.value.message


async def test_the_deprecated_functions_answer_function_call_to_the_client(stack: RunningGateway,
                                                                           clients: Clients):
    """Older clients' function calling (`functions`, `function_call`): a forced function's call comes back as
    `message.function_call` whose arguments follow its parameters, streamed too; the next turn carries the call and
    the function's result (role `function`)."""
    _, client = clients(stack, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Time in Oslo?"}]
    clock = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                                "required": ["tz"]}}
    answer = await client.chat.completions.create(model="tiny-llama", messages=messages, functions=[clock],
                                                  function_call={"name": "get_time"}, max_tokens=30, temperature=0)
    message = answer.choices[0].message
    assert message.function_call.name == "get_time" and not message.tool_calls and message.content is None
    assert json.loads(message.function_call.arguments)["tz"] in ("UTC", "CET")
    stream = await client.chat.completions.create(model="tiny-llama", messages=messages, functions=[clock],
                                                  function_call={"name": "get_time"}, max_tokens=30, temperature=0,
                                                  stream=True)
    deltas = [c.choices[0].delta.function_call for c in [c async for c in stream]
              if c.choices and c.choices[0].delta.function_call]
    assert deltas[0].name == "get_time"
    assert "".join(d.arguments or "" for d in deltas) == message.function_call.arguments  # greedy: the same call
    turn = [*messages, {"role": "assistant", "content": None, "function_call": {
        "name": "get_time", "arguments": message.function_call.arguments}},
        {"role": "function", "name": "get_time", "content": "09:00"}]
    reply = await client.chat.completions.create(model="tiny-llama", messages=turn, functions=[clock],
                                                 function_call="none", max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].message.function_call is None
    with pytest.raises(openai.BadRequestError) as info:  # auto: the model's own format, which tiny-llama has none of
        await client.chat.completions.create(model="tiny-llama", messages=messages, functions=[clock])
    assert info.value.param == "function_call"


async def test_tool_calls_forced_or_required_come_back_as_calls_the_client_reads(stack: RunningGateway,
                                                                                 clients: Clients):
    """A named function (the client's `pydantic_function_tool` and `parse`, which reads the call's arguments into
    the model), `required` over two tools, streamed calls, and a conversation that carries earlier calls and
    their results; `auto`, which needs a model's own call format parsed, is a typed 400."""
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=8)
        unit: Literal["c", "f"]

    sync, client = clients(stack, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    tool = openai.pydantic_function_tool(GetWeather)
    parsed = await asyncio.to_thread(sync.chat.completions.parse, model="tiny-llama", messages=messages,
                                     tools=[tool], tool_choice={"type": "function", "function": {"name": "GetWeather"}},
                                     max_tokens=60, temperature=0)
    (call,) = parsed.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
    assert parsed.choices[0].finish_reason == "stop"

    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
    answer = await client.chat.completions.create(model="tiny-llama", messages=messages, tools=[tool, clock],
                                                  tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                                  temperature=0)  # one call: a list a random model would run on
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    plain = await client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=1)
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the chat template told the model the tools
    for made in choice.message.tool_calls:
        arguments = json.loads(made.function.arguments)
        assert made.function.name in ("GetWeather", "get_time") and made.id.startswith("call_")
        if made.function.name == "get_time":
            assert arguments["tz"] in ("UTC", "CET")
        else:
            GetWeather.model_validate(arguments)

    stream = await client.chat.completions.create(model="tiny-llama", messages=messages, tools=[clock], stream=True,
                                                  tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                  max_tokens=30, temperature=0)
    deltas = [c.choices[0].delta for c in [c async for c in stream] if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].tool_calls[0].function.name == "get_time" and deltas[0].tool_calls[0].id
    assert json.loads("".join(d.tool_calls[0].function.arguments or "" for d in deltas))["tz"] in ("UTC", "CET")

    turn = [*messages, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "GetWeather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, rain"}]
    reply = await client.chat.completions.create(model="tiny-llama", messages=turn, tools=[tool], tool_choice="none",
                                                 max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls

    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="tiny-llama", messages=messages, tools=[tool])
    assert info.value.param == "tool_choice" and info.value.code == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError) as info:  # the model first: no word of auto for a model not there
        await client.chat.completions.create(model="nope", messages=messages, tools=[tool])
    assert info.value.code == "model_not_found"
