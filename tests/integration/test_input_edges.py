"""Input that must never produce a 500 (issue 17): invalid text refused at the edge, and nothing that
admission took (a tenant's quota slot, an idempotency key) leaked by a step that fails after it."""

from __future__ import annotations

import asyncio
import importlib
import json
import socket
import sys
import time

import pytest

from shared import operations as ops
from shared.config import BUILTIN_MODELS
from shared.keys import Keys
from tests.stack import make_settings, running_gateway

pytestmark = [pytest.mark.redis]

MINILM, LLAMA = BUILTIN_MODELS["minilm"], BUILTIN_MODELS["tiny-llama"]
LONE = "\ud800"  # a lone UTF-16 surrogate: JSON can spell it, UTF-8 cannot carry it

# (path, body as JSON text with the surrogate escaped as JSON spells it, the field the 422 names)
SURROGATES = [
    ("/v1/models/tiny-llama/requests", {"input": {"prompt": "hi" + LONE}}, "input.prompt"),
    ("/v1/models/tiny-llama/requests", {"input": {"prompt": "hi"}, "params": {"stop": ["ok", LONE]}}, "params.stop"),
    ("/v1/models/tiny-llama/requests", {"input": {"prompt": "hi"}, "params": {"stop": LONE}}, "params.stop"),
    ("/v1/models/minilm/requests", {"input": {"texts": ["fine", "x" + LONE]}}, "input.texts[1]"),
    ("/v1/models/minilm/requests", {"input": {"text": LONE}}, "input.text"),
    ("/v1/models/minilm/requests", {"input": {"text": "x"}, "callback": {"url": "https://a.example/" + LONE}},
     "callback.url"),
    ("/v1/models/minilm/requests", {"input": {"text": "x"}, "deadline": "2030-01-01T00:00:00" + LONE},
     "deadline"),
    ("/v1/models/minilm/requests", {"input": {"text": "x"}, "priority": LONE}, "priority"),
]


async def active_slots(gw, tenant: str = "default") -> int:
    return await gw.service.redis.zcard(Keys(gw.service.settings.key_prefix).tenant_active(tenant))


@pytest.mark.parametrize(("path", "body", "field"), SURROGATES)
async def test_a_lone_surrogate_is_a_422_naming_the_field_and_takes_no_slot(redis_url, prefix, path, body, field):
    settings = make_settings(redis_url, prefix, tenant_max_backlog=1)
    async with running_gateway(settings) as gw:
        raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as "\ud800"
        assert b"\\ud800" in raw
        r = await gw.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == field and "surrogate" in r.json()["error"]["message"]
        assert await active_slots(gw) == 0
        # the tenant's only slot is free: a valid request is accepted at once
        ok = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}})
        assert ok.status_code == 202, ok.text


async def test_a_surrogate_in_a_batch_fails_its_item_alone(redis_url, prefix):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        raw = json.dumps({"requests": [
            {"input": {"text": "a"}, "idempotency_key": "k-a"},
            {"input": {"text": "b" + LONE}, "idempotency_key": "k-b"},
            {"input": {"text": "c"}, "idempotency_key": "k-c" + LONE},
            {"input": {"text": "d"}, "idempotency_key": "k-d"},
        ]}).encode()
        r = await gw.client.post("/v1/models/minilm/requests:batch", content=raw,
                                 headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["status"] for x in res] == [202, 422, 422, 202]
        assert res[1]["error"]["field"] == "requests[1].input.text"
        assert res[2]["error"]["field"] == "requests[2].idempotency_key"
        svc = gw.service
        for i, key in ((0, "k-a"), (3, "k-d")):  # each valid item's key maps to its own stored request
            claim = await svc.idempotency.get("default", key)
            assert claim is not None and claim.request_id == res[i]["id"]
            assert await svc.get(res[i]["id"]) is not None
        assert await svc.idempotency.get("default", "k-b") is None


async def test_a_failure_after_admission_gives_back_the_slot_and_the_key(redis_url, prefix, monkeypatch):
    settings = make_settings(redis_url, prefix, tenant_max_backlog=1)
    async with running_gateway(settings) as gw:
        svc = gw.service

        async def broken(items):
            raise RuntimeError("boom")

        with monkeypatch.context() as m:
            m.setattr(svc, "submit_many", broken)
            with pytest.raises(RuntimeError):
                await ops.submit(svc, {"input": {"text": "x"}}, MINILM, "default", idempotency_key="k1")
            with pytest.raises(RuntimeError):
                await ops.submit_batch(svc, {"requests": [{"input": {"text": "x"}, "idempotency_key": "k2"},
                                                          {"input": {"text": "y"}}]}, MINILM, "default")
        assert await active_slots(gw) == 0
        assert await svc.idempotency.get("default", "k1") is None
        assert await svc.idempotency.get("default", "k2") is None
        # and the key, retried, creates its request now
        again = await ops.submit(svc, {"input": {"text": "x"}}, MINILM, "default", idempotency_key="k1")
        assert again.status == 202
        assert (await svc.idempotency.get("default", "k1")).request_id == again.body["id"]
        await svc.cancel(await svc.get(again.body["id"]))  # frees the tenant's one slot

        async def lost(items):  # the connection dropped mid-pipeline: the request may be stored
            raise ConnectionError("reset")

        with monkeypatch.context() as m:
            m.setattr(svc, "submit_many", lost)
            with pytest.raises(ConnectionError):
                await ops.submit(svc, {"input": {"text": "z"}}, MINILM, "default", idempotency_key="k3")
        assert await active_slots(gw) == 0  # the slot is free either way
        # the key is kept: a retry within IDEMPOTENCY_TAKEOVER_S is told to wait, a later one takes the claim
        # over under the same id, so the key never maps to two requests
        assert await svc.idempotency.get("default", "k3") is not None


async def test_the_same_key_twice_in_one_batch_is_a_replay(redis_url, prefix):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests:batch", json={"requests": [
            {"input": {"text": "a"}, "idempotency_key": "dup"},
            {"input": {"text": "a"}, "idempotency_key": "dup"},
            {"input": {"text": "other"}, "idempotency_key": "dup"},
        ]})
        res = r.json()["results"]
        assert res[0]["status"] == 202 and res[1]["status"] == 202, res
        assert res[1]["id"] == res[0]["id"] and res[1]["replayed"] is True and res[1]["request_status"] == "queued"
        assert res[2]["status"] == 409 and res[2]["error"]["code"] == "idempotency_conflict"
        assert res[2]["error"]["field"] == "requests[2].idempotency_key", res[2]
        assert r.json()["accepted"] == 2 and r.json()["replayed"] == 1 and r.json()["refused"] == 1
        assert sum((await gw.service.backlog("minilm", ("short", "long"))).values()) == 1
        # the same call again: the conflicting item is named the same way (the key now held by a stored request)
        again = (await gw.client.post("/v1/models/minilm/requests:batch", json={"requests": [
            {"input": {"text": "other"}, "idempotency_key": "dup"}]})).json()["results"][0]
        assert again["status"] == 409 and again["error"]["code"] == "idempotency_conflict", again
        assert again["error"]["field"] == "requests[0].idempotency_key", again
        assert again["error"]["message"].startswith("requests[0].idempotency_key: used with a different body"), again


async def test_field_errors_say_what_is_allowed_where(redis_url, prefix):
    """`stream` on an embedding model says only generation models stream; an unknown field of a `:batch` item
    lists the item's own `idempotency_key` among the allowed ones."""
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        for stream in (True, False):
            r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}, "stream": stream})
            assert r.status_code == 422 and r.json()["error"]["field"] == "stream"
            assert "only generation models stream" in r.json()["error"]["message"], r.text
        r = await gw.client.post("/v1/models/minilm/requests:batch", json={"requests": [
            {"input": {"text": "a"}, "idempotency_key": "k", "colour": "red"}]})
        err = r.json()["results"][0]["error"]
        assert err["field"] == "requests[0].colour" and "idempotency_key" in err["message"], err
        assert "input" in err["message"] and "timeout_s" in err["message"]
        r = await gw.client.post("/v1/models/minilm/requests:batch", json={"requests": [
            {"input": {"text": "a", "colour": "red"}}]})
        err = r.json()["results"][0]["error"]
        assert err["field"] == "requests[0].input.colour" and "idempotency_key" not in err["message"], err
        # an item that is no body at all refuses the call (nothing stored), naming the item
        for bad, got in ((None, "null"), ([], "list"), ("x", "str")):
            r = await gw.client.post("/v1/models/minilm/requests:batch", json={"requests": [
                {"input": {"text": "a"}}, bad]})
            assert r.status_code == 422 and r.json()["error"]["field"] == "requests[1]", r.text
            assert r.json()["error"]["message"] == f"requests[1]: a submit body (an object) is required, not {got}"
        assert sum((await gw.service.backlog("minilm", ("short", "long"))).values()) == 0


async def test_a_batch_call_retried_with_its_idempotency_key_creates_nothing_twice(redis_url, prefix):
    """The `Idempotency-Key` header of a `:batch` call keys each item without a key of its own: the same call sent
    again answers with the same requests; an item's own key still wins; another body under it is a 409 item."""
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        body = {"requests": [{"input": {"text": "a"}}, {"input": {"text": "b"}, "idempotency_key": "own"}]}
        url, headers = "/v1/models/minilm/requests:batch", {"Idempotency-Key": "call-1"}
        first = (await gw.client.post(url, json=body, headers=headers)).json()
        assert first["accepted"] == 2 and first["replayed"] == 0, first
        again = (await gw.client.post(url, json=body, headers=headers)).json()
        assert again["accepted"] == 2 and again["replayed"] == 2, again
        assert [r["id"] for r in again["results"]] == [r["id"] for r in first["results"]]
        # the item with its own key answers to it alone, whatever the call's key
        other = (await gw.client.post(url, json=body, headers={"Idempotency-Key": "call-2"})).json()
        assert other["results"][1]["id"] == first["results"][1]["id"] and other["replayed"] == 1
        assert other["results"][0]["id"] != first["results"][0]["id"]
        changed = {"requests": [{"input": {"text": "not a"}}]}
        conflict = (await gw.client.post(url, json=changed, headers=headers)).json()["results"][0]
        assert conflict["status"] == 409 and conflict["error"]["code"] == "idempotency_conflict", conflict
        bad = await gw.client.post(url, json=body, headers={"Idempotency-Key": ""})
        assert bad.status_code in (400, 422), bad.text  # as a single submit's header is checked
        # an item's derived key is no key a caller can send: a submit keyed `call-1#0` is a request of its own
        single = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "a"}},
                                      headers={"Idempotency-Key": "call-1#0"})
        assert single.status_code == 202 and single.json()["id"] != first["results"][0]["id"], single.text


async def test_cancel_of_a_cancelled_request_is_a_conflict(redis_url, prefix):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        rid = (await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}})).json()["id"]
        assert (await gw.client.delete(f"/v1/requests/{rid}")).status_code == 200
        again = await gw.client.delete(f"/v1/requests/{rid}")
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_finished"


# --- AWS Lambda: the direct and SQS handlers answer, never raise -------------------------------------

class Context:
    def get_remaining_time_in_millis(self) -> int:
        return 20_000


@pytest.fixture
def lambda_mod(redis_url, prefix, monkeypatch):
    env = {"BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix, "BATCHGATE_AUTH": "api_key",
           "BATCHGATE_LOG_FORMAT": "json"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    sys.modules.pop("gateway.lambda_handler", None)
    yield importlib.import_module("gateway.lambda_handler")
    sys.modules.pop("gateway.lambda_handler", None)
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def test_lambda_direct_invocation_answers_a_surrogate_with_422(lambda_mod, monkeypatch):
    bad = lambda_mod.direct_handler({"model": "tiny-llama", "input": {"prompt": LONE}}, Context())
    assert bad["statusCode"] == 422 and bad["error"]["field"] == "input.prompt"
    for wait in (10**400, float("nan"), float("inf"), -1, "abc"):
        out = lambda_mod.direct_handler({"model": "tiny-llama", "input": {"prompt": "x"}, "wait": wait}, Context())
        assert out["statusCode"] == 400 and out["error"]["code"] == "invalid_wait", (wait, out)
        # the message says what is wrong with it: an infinite wait is not refused for being negative
        says = {-1: "non-negative", "abc": "a number of seconds"}.get(wait, "finite")
        assert says in out["error"]["message"], (wait, out)

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(lambda_mod, "_dispatch", boom)
    out = lambda_mod.direct_handler({"model": "tiny-llama", "input": {"prompt": "x"}}, Context())
    assert out["statusCode"] == 500 and out["error"]["code"] == "internal"


def test_lambda_sqs_reports_only_the_failing_messages(lambda_mod, monkeypatch):
    def record(mid: str, msg: object) -> dict:
        return {"messageId": mid, "body": json.dumps(msg)}

    event = {"Records": [
        record("m1", {"model": "minilm", "input": {"text": "a"}}),
        record("m2", {"model": "minilm", "input": {"text": "b" + LONE}}),
        record("m3", {"model": "tiny-llama", "input": {"prompt": "c"}, "params": {"stop": LONE}}),
        record("m4", {"model": "tiny-llama", "input": {"prompt": "d"}}),
    ]}
    out = lambda_mod.sqs_handler(event, Context())
    assert sorted(f["itemIdentifier"] for f in out["batchItemFailures"]) == ["m2", "m3"]
    for not_sqs in (None, [], "x"):  # not an SQS event: nothing to report, and no exception for Lambda to retry
        assert lambda_mod.sqs_handler(not_sqs, Context()) == {"batchItemFailures": []}

    real = lambda_mod._dispatch

    def flaky(method, path, body, ev, query=None):
        if "tiny-llama" in path:
            raise RuntimeError("a bug in one model's call")
        return real(method, path, body, ev, query)

    monkeypatch.setattr(lambda_mod, "_dispatch", flaky)
    out = lambda_mod.sqs_handler({"Records": [record("n1", {"model": "minilm", "input": {"text": "e"}}),
                                              record("n2", {"model": "tiny-llama", "input": {"prompt": "f"}})]},
                                 Context())
    assert out["batchItemFailures"] == [{"itemIdentifier": "n2"}]


# --- the smaller ones ------------------------------------------------------------------------------

async def test_a_body_that_never_arrives_is_cut_off(redis_url, prefix):
    settings = make_settings(redis_url, prefix, body_timeout_s=0.5)
    async with running_gateway(settings) as gw:
        host, port = gw.base_url.removeprefix("http://").split(":")

        def stall() -> tuple[bytes, float]:
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"POST /v1/models/minilm/requests HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"input\"")
                t0 = time.monotonic()
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
                return data, time.monotonic() - t0

        data, took = await asyncio.to_thread(stall)
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert took < 5 and b"body_timeout" in data


@pytest.mark.parametrize("path", ["/v1/models/minilm/requests", "/v1/chat/completions"])
async def test_a_client_gone_mid_body_is_no_internal_error(redis_url, prefix, monkeypatch, path):
    """A client that closes its connection with its body half sent: nothing queued, nothing logged as an
    unhandled error (before: a ClientDisconnect traceback for every such client)."""
    from gateway import app as app_module

    unhandled: list[str] = []
    real, real_read = app_module._internal_error, app_module.read_body
    body_ended = asyncio.Event()

    async def spy(request, exc):
        unhandled.append(repr(exc))
        return await real(request, exc)

    async def reading(*args, **kwargs):
        try:
            return await real_read(*args, **kwargs)
        finally:
            body_ended.set()

    monkeypatch.setattr(app_module, "_internal_error", spy)
    monkeypatch.setattr(app_module, "read_body", reading)
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        host, port = gw.base_url.removeprefix("http://").split(":")

        def hang_up() -> None:
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Content-Length: 100\r\n\r\n{\"input\"".encode())

        await asyncio.to_thread(hang_up)
        await asyncio.wait_for(body_ended.wait(), 10)
        await gw.client.get("/healthz")  # a round trip later, its answer to what the read raised has run
        assert unhandled == []
        assert sum((await gw.service.backlog("minilm", ("short", "long"))).values()) == 0


# --- token limits at submit (the model's own tokenizer, where the gateway can load it) ----------------

LONG_PROMPT = " ".join(str(n) for n in range(1500))  # ~6,400 characters (under the character bound), >2,048 tokens


async def test_too_long_prompts_and_out_of_vocabulary_ids_are_422_at_submit(redis_url, prefix, loaded_models,
                                                                            model_cache):
    settings = make_settings(redis_url, prefix, model_cache_dir=str(model_cache))
    async with running_gateway(settings) as gw:
        assert len(LONG_PROMPT) < LLAMA.max_input_tokens * 16
        r = await gw.client.post("/v1/models/tiny-llama/requests", json={"input": {"prompt": LONG_PROMPT}})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        n = len(loaded_models["tiny-llama"].tokenizer(LONG_PROMPT)["input_ids"])  # the worker's own count
        assert err["field"] == "input.prompt" and f"is {n} tokens" in err["message"] and "2048" in err["message"]
        r = await gw.client.post("/v1/models/tiny-llama/requests", json={"input": {"input_ids": [5, 8191, 8192]}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "input.input_ids"
        assert "item 2" in r.json()["error"]["message"] and "8192" in r.json()["error"]["message"]
        words = "hello " * 600  # 602 tokens with [CLS] and [SEP]; MiniLM takes 256
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"texts": ["short", words]}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "input.texts[1]", r.text
        assert "602 tokens" in r.json()["error"]["message"] and "truncate" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": words}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "input.text"
        # what fits is accepted as before
        ok = await gw.client.post("/v1/models/tiny-llama/requests", json={"input": {"prompt": "hello " * 150}})
        assert ok.status_code == 202, ok.text
        assert sum((await gw.service.backlog("minilm", ("short", "long"))).values()) == 0


CONVERSATIONS = (
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "2 + 2?"}],
    [{"role": "user", "content": "<s> looks special </s> but is text"}],
)


async def test_a_conversation_is_counted_with_its_chat_template_at_submit(redis_url, prefix, loaded_models,
                                                                          model_cache):
    """The gateway counts `messages` as the worker does (the chat template rendered, then tokenized), so a
    conversation whose contents fit but whose rendering does not is refused at submit, not failed later."""
    from shared.token_limits import TokenLimits

    tok = loaded_models["tiny-llama"].tokenizer
    limits = TokenLimits(model_cache)
    for convo in CONVERSATIONS:
        worker = len(tok.apply_chat_template(convo, add_generation_prompt=True, return_dict=False))
        assert limits.count_chat(LLAMA, convo) == worker, convo
    many = [{"role": "user", "content": "hello there"}] * 230  # contents ~2,000 tokens; rendered ~2,500
    contents = len(tok("\n".join(m["content"] for m in many))["input_ids"])
    rendered = len(tok.apply_chat_template(many, add_generation_prompt=True, return_dict=False))
    assert contents <= LLAMA.max_input_tokens < rendered
    settings = make_settings(redis_url, prefix, model_cache_dir=str(model_cache))
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/tiny-llama/requests", json={"input": {"messages": many}})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["field"] == "input.messages" and f"is {rendered} tokens" in err["message"]
        r = await gw.client.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": many})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        fits = many[:150]
        assert len(tok.apply_chat_template(fits, add_generation_prompt=True, return_dict=False)) \
            <= LLAMA.max_input_tokens
        ok = await gw.client.post("/v1/models/tiny-llama/requests", json={"input": {"messages": fits}})
        assert ok.status_code == 202, ok.text


STRICT_TEMPLATE = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                   "{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}Today is {{ strftime_now('%Y-%m-%d') }}.")


def model_of_files(directory, model_cache, name: str, template: str, positions: int):
    """A generation model the gateway knows by its files alone: the built-in Llama's tokenizer, a chat template, a
    config of `positions` positions (no worker needed)."""
    import shutil

    from shared.config import ModelSpec
    from shared.states import Task
    from shared.token_limits import model_dir

    builtin = model_dir(LLAMA, model_cache)
    assert builtin is not None and (builtin / "tokenizer.json").is_file()
    shutil.copy(builtin / "tokenizer.json", directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8192,
                                                       "max_position_embeddings": positions}))
    return ModelSpec(name=name, task=Task.GENERATE, source=str(directory))


async def test_a_conversation_the_chat_template_refuses_is_refused_at_submit(redis_url, prefix, loaded_models,
                                                                            model_cache, tmp_path):
    """A template that refuses a conversation (`raise_exception`, as Mistral's does for roles that do not
    alternate) is answered at submit, 422 natively and 400 on the OpenAI route, naming the messages; nothing is
    queued. A template calling `strftime_now` (as transformers lets it) is counted by its rendering."""
    from shared.token_limits import TokenLimits

    strict = model_of_files(tmp_path, model_cache, "strict", STRICT_TEMPLATE, positions=2048)
    alternating = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                   {"role": "user", "content": "bye"}]
    twice = [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]
    contents = (TokenLimits(model_cache).count(strict, ["\n".join(m["content"] for m in alternating)]) or [0])[0]
    counted = TokenLimits(model_cache).count_chat(strict, alternating)
    assert contents and counted is not None and counted > contents + 10  # rendered, date and all
    settings = make_settings(redis_url, prefix, models=(strict,), model_cache_dir=str(model_cache))
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/strict/requests", json={"input": {"messages": twice}})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["field"] == "input.messages" and "roles must alternate" in err["message"], err
        r = await gw.client.post("/v1/chat/completions", json={"model": "strict", "messages": twice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "roles must alternate" in r.json()["error"]["message"]
        assert sum((await gw.service.backlog("strict", strict.lane_names)).values()) == 0
        ok = await gw.client.post("/v1/models/strict/requests", json={"input": {"messages": alternating}})
        assert ok.status_code == 202, ok.text


async def test_the_model_list_gives_the_limits_a_request_can_meet(redis_url, prefix, loaded_models, model_cache,
                                                                   tmp_path):
    """A model whose context is shorter than its model file's limits is listed with the limits submit holds it to
    (a prompt leaves room for one new token) and its context (`context_length`; OpenAI's entry: vLLM's
    `max_model_len`, the longest sequence a request can reach); a model within them is listed as its file says; an
    encoder at most its positions."""
    from shared.token_limits import TokenLimits

    short = model_of_files(tmp_path, model_cache, "short-context", STRICT_TEMPLATE, positions=128)
    settings = make_settings(redis_url, prefix, models=(short, LLAMA, MINILM), model_cache_dir=str(model_cache))
    async with running_gateway(settings) as gw:
        listed = (await gw.client.get("/v1/models")).json()
        limits = {m["name"]: m["limits"] for m in listed["models"]}
        assert (limits["short-context"]["max_input_tokens"], limits["short-context"]["max_new_tokens"],
                limits["short-context"]["context_length"]) == (127, 127, 128)
        context = TokenLimits(model_cache).context(LLAMA)
        assert context is not None and context > LLAMA.max_input_tokens + LLAMA.max_new_tokens
        assert (limits["tiny-llama"]["max_input_tokens"], limits["tiny-llama"]["max_new_tokens"],
                limits["tiny-llama"]["context_length"]) == (LLAMA.max_input_tokens, LLAMA.max_new_tokens, context)
        assert limits["minilm"]["max_input_tokens"] == min(256, MINILM.max_input_tokens)  # its max_seq_length
        assert limits["minilm"]["max_texts"] == MINILM.max_texts and "max_new_tokens" not in limits["minilm"]
        assert "max_texts" not in limits["tiny-llama"]  # each task's own limits
        entries = {m["id"]: m for m in listed["data"]}
        assert entries["short-context"]["max_model_len"] == 128  # its context, which a prompt and its tokens share
        # the longest sequence a request can reach: a prompt and its new tokens at their model file's limits, short
        # of the model's context (a vLLM client sizes a prompt as max_model_len - max_tokens)
        assert entries["tiny-llama"]["max_model_len"] == LLAMA.max_input_tokens + LLAMA.max_new_tokens < context
        assert "max_model_len" not in entries["minilm"]
        one = (await gw.client.get("/v1/models/short-context")).json()
        assert one == entries["short-context"]
        # what the list says is what submit holds: its most, accepted; one more, refused
        at_most = {"input": {"input_ids": [5] * 127}, "params": {"max_new_tokens": 1}}
        assert (await gw.client.post("/v1/models/short-context/requests", json=at_most)).status_code == 202
        over = {"input": {"input_ids": [5] * 128}}
        assert (await gw.client.post("/v1/models/short-context/requests", json=over)).status_code == 422
        new = {"input": {"input_ids": [5]}, "params": {"max_new_tokens": 128}}
        assert (await gw.client.post("/v1/models/short-context/requests", json=new)).status_code == 422


async def test_embedding_truncation_is_asked_for_and_reported(redis_url, prefix, loaded_models, model_cache):
    from tests.stack import running_worker

    settings = make_settings(redis_url, prefix, model_cache_dir=str(model_cache))
    words = "hello " * 600
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests?wait=20", json={
            "input": {"texts": [words, "short"]}, "params": {"truncate": True}})
        assert r.status_code == 200, r.text
        out = r.json()["output"]
        assert out["truncated"] == [True, False] and out["tokens"] == [256, 3]
        # truncation asked for: a text of any length (past the 16-characters-per-token bound of untruncated ones)
        huge = "hello " * 1400  # 8,400 characters
        r = await gw.client.post("/v1/models/minilm/requests?wait=20", json={
            "input": {"text": huge}, "params": {"truncate": True}})
        assert r.status_code == 200 and r.json()["output"]["tokens"] == [256], r.text
        refused = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": huge}})
        assert refused.status_code == 422 and refused.json()["error"]["field"] == "input.text", refused.text
        # a gateway that cannot count (no tokenizer here) lets it through: the worker refuses it, never cuts
        gw.service.token_limits._tokenizers["minilm"] = None
        r = await gw.client.post("/v1/models/minilm/requests?wait=20", json={"input": {"texts": ["ok", words]}})
        assert r.status_code == 200 and r.json()["status"] == "failed", r.text
        assert r.json()["error"]["code"] == "input_too_long" and "text 1 is 602 tokens" in r.json()["error"]["message"]
        plain = await gw.client.post("/v1/models/minilm/requests?wait=20", json={"input": {"text": "short"}})
        assert "truncated" not in plain.json()["output"]


def test_the_gateway_loads_no_tokenizer_at_import():
    """Token counting is lazy: a Lambda's cold start pays for no tokenizer (nor torch)."""
    import os
    import subprocess

    code = ("import sys; import gateway.lambda_handler, gateway.app; "
            "print([m for m in ('tokenizers', 'torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "BATCHGATE_LOG_FORMAT": "json"}).stdout.strip().splitlines()[-1]
    assert out == "[]"


def test_the_document_lists_the_statuses_these_paths_answer():
    from gateway import openapi
    from tests.stack import make_settings as settings_for

    doc = openapi.document(settings_for("redis://127.0.0.1:6379/0", "bgdoc"))
    for path, ops_ in doc["paths"].items():
        for method, op in ops_.items():
            if "{request_id}" in path:  # every read of a request id may find its result expired
                assert "410" in op["responses"], (method, path)
            if "requestBody" in op:  # invalid fields: 422, or 400 on the OpenAI routes (OpenAI's status for them)
                invalid = "400" if "openai" in op.get("tags", ()) else "422"
                assert {"408", "413", "415", invalid} <= set(op["responses"]), (method, path)
