"""The Batch API's rules (`shared.batches`): input lines, windows, output lines, the batch object."""

from __future__ import annotations

import json

import pytest

from shared.batches import (
    BatchError,
    BatchMeta,
    Progress,
    batch_object,
    check_endpoint,
    check_metadata,
    new_batch_id,
    parse_line,
    refused_line,
    refused_line_id,
    result_line,
    submit_body,
    window_seconds,
)

CHAT = "/v1/chat/completions"


def lined(*args, **kwargs):
    """(succeeded, the line) of a finished item that is written (not fed again)."""
    written = result_line(*args, **kwargs)
    assert written is not None
    return written.ok, written.line


def line(custom_id="a", url=CHAT, body=None, **extra):
    body = body if body is not None else {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 4}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def test_a_chat_line_becomes_the_native_submit_body_at_batch_priority():
    item = parse_line(line(), 3, CHAT)
    assert (item.line, item.custom_id, item.model, item.kind) == (3, "a", "tiny-llama", "chat")
    assert item.body["input"] == {"messages": [{"role": "user", "content": "hi"}]}
    assert item.body["params"]["max_new_tokens"] == 4
    body = submit_body(item, 1234.5)
    assert body["priority"] == "batch" and body["deadline"] == 1234.5 and "timeout_s" not in body


@pytest.mark.parametrize("url", [CHAT, "/v1/completions", "/v1/responses", "/v1/models/tiny-llama/requests"])
@pytest.mark.parametrize("own", [{"priority": "interactive"}, {"priority": "nope"}, {"priority": 7},
                                 {"timeout_s": 5}, {"timeout_s": -1}, {"timeout_s": "x"}])
def test_a_lines_own_priority_and_timeout_are_replaced_whatever_they_hold(url, own):
    """The batch's priority and window replace a line's own: an invalid one is no more the line's fault than a valid
    one (an invalid priority failed the whole batch's validation, a valid one was replaced)."""
    body = ({"input": {"prompt": "x"}} if url.startswith("/v1/models/")
            else {"model": "tiny-llama", "input": "x"} if url == "/v1/responses"
            else {"model": "tiny-llama", "prompt": "x"} if url == "/v1/completions"
            else {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]})
    item = parse_line(line(url=url, body={**body, **own}), 0, url)
    sent = submit_body(item, 1234.5)
    assert sent["priority"] == "batch" and sent["deadline"] == 1234.5 and "timeout_s" not in sent


def test_completion_embedding_and_native_lines():
    comp = parse_line(line(url="/v1/completions", body={"model": "m", "prompt": "x"}), 0, "/v1/completions")
    assert comp.kind == "completion" and comp.body["input"] == {"prompt": "x"}
    emb = parse_line(line(url="/v1/embeddings", body={"model": "e", "input": ["a", "b"]}), 0, "/v1/embeddings")
    assert emb.kind == "embedding" and emb.body["input"] == {"texts": ["a", "b"]}
    native = "/v1/models/tiny-llama/requests"
    nat = parse_line(line(url=native, body={"input": {"prompt": "x"}, "timeout_s": 5}), 0, native)
    assert nat.kind == "native" and nat.model == "tiny-llama" and nat.body == {"input": {"prompt": "x"}}


@pytest.mark.parametrize("url, body, native_field, param", [
    ("/v1/completions", {"model": "m", "prompt": "x"}, "input.prompt", "body.prompt"),
    ("/v1/completions", {"model": "m", "prompt": [1, 2]}, "input.input_ids[1]", "body.prompt[1]"),
    ("/v1/completions", {"model": "m", "prompt": "x"}, "params.max_new_tokens", "body.max_tokens"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9},
     "params.max_new_tokens", "body.max_completion_tokens"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "input.messages[0].content",
     "body.messages[0].content"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "params.temperature", "body.temperature"),
    ("/v1/embeddings", {"model": "e", "input": ["a", "b"]}, "input.texts[1]", "body.input[1]"),
    ("/v1/models/m/requests", {"input": {"prompt": "x"}}, "input.prompt", "body.input.prompt"),
    ("/v1/models/m/requests", {"input": {"prompt": "x"}}, "params.max_new_tokens", "body.params.max_new_tokens"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "", "body"),
])
def test_a_field_the_models_checks_refuse_is_named_as_the_lines_endpoint_names_it(url, body, native_field, param):
    """The checks run on the native body; an error in a line of an OpenAI endpoint names OpenAI's parameter, as
    the same route answers a single request."""
    item = parse_line(line(url=url, body=body), 0, url)
    assert item.param(native_field, "too long") == (param, "too long")


@pytest.mark.parametrize("raw, code", [
    ("not json", "invalid_json_line"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"temperature": NaN}}',
     "invalid_json_line"),  # NaN is not JSON (Python's json reads it)
    ("[1]", "invalid_json_line"),
    (line(custom_id=""), "invalid_custom_id"),
    (line(custom_id=5), "invalid_custom_id"),
    (line(url="/v1/completions"), "mismatched_url"),
    (line(method="GET"), "invalid_method"),
    (line(body=[]), "invalid_body"),
    (line(extra_field=1), "invalid_request"),
    (line(body={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}), "invalid_request"),
    (line(body={"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}), "unsupported_parameter"),
])
def test_bad_lines_are_refused_with_their_line(raw, code):
    with pytest.raises(BatchError) as err:
        parse_line(raw, 41, CHAT)
    assert err.value.code == code and err.value.entry()["line"] == 42


def test_windows_endpoints_metadata():
    assert window_seconds("24h") == 86_400 and window_seconds("90m") == 5400 and window_seconds("2d") == 172_800
    for bad in ("24", "0h", "8d", "1h30m", 24, None, "30s", "24h\n", "\uff11h", "\u0662\u0664h", " 24h"):
        with pytest.raises(BatchError):
            window_seconds(bad)
    assert check_endpoint("/v1/embeddings") and check_endpoint("/v1/models/m/requests")
    assert check_endpoint("/v1/responses")
    with pytest.raises(BatchError):
        check_endpoint("/v1/moderations")
    assert check_metadata({"k": "v"}) == {"k": "v"} and check_metadata(None) is None
    with pytest.raises(BatchError):
        check_metadata({"k": 1})
    assert new_batch_id(1000).startswith("batch_")


@pytest.mark.parametrize(("check", "value", "param", "code"), [
    (window_seconds, None, "completion_window", "missing_required_parameter"),
    (window_seconds, "24", "completion_window", "invalid_request"),
    (window_seconds, "8d", "completion_window", "invalid_request"),
    (check_endpoint, None, "endpoint", "missing_required_parameter"),
    (check_endpoint, "/v1/moderations", "endpoint", "invalid_endpoint"),
    (check_metadata, {"k": 1}, "metadata", "invalid_request"),
])
def test_a_refused_batch_field_is_named_once(check, value, param, code):
    """The API prefixes a field's error with its name: the message does not name it again."""
    with pytest.raises(BatchError) as info:
        check(value)
    assert info.value.param == param and info.value.code == code
    assert not info.value.message.startswith(param), info.value.message


def test_output_and_error_lines_follow_openais_format():
    ref = parse_line(line(), 0, CHAT).ref("req_abc")
    view = {"id": "req_abc", "status": "succeeded", "finish_reason": "length",
            "output": {"text": "yo", "token_ids": [5, 6], "prompt_tokens": 3, "completion_tokens": 2}}
    ok, out = lined(ref, view, 100)
    assert ok and out["custom_id"] == "a" and out["error"] is None and out["id"] == "batch_req_abc"
    assert out["response"]["status_code"] == 200
    assert out["response"]["body"]["choices"][0]["message"]["content"] == "yo"
    assert out["response"]["body"]["usage"]["total_tokens"] == 5
    bad, err = lined(ref, {"id": "req_abc", "status": "failed",
                                 "error": {"code": "input_too_long", "message": "too long"}}, 100)
    # a line that got an HTTP answer: its error in the response's body, in OpenAI's shape; `error` null
    assert not bad and err["error"] is None and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"] == {"message": "too long", "type": "invalid_request_error", "param": None,
                                               "code": "input_too_long"}
    never = refused_line("a", "batch_expired", "window ended", line_id=refused_line_id("batch_xyz", 7))
    assert never["response"] is None and never["error"] == {"code": "batch_expired", "message": "window ended"}
    assert never["id"] == "batch_req_xyz_7"
    refused = refused_line("a", "deadline_infeasible", "too late", 429, line_id="batch_req_1")
    assert refused["error"] is None and refused["response"]["status_code"] == 429
    assert refused["response"]["body"]["error"]["type"] == "rate_limit_error"
    assert refused["response"]["body"]["error"]["code"] == "deadline_infeasible"
    # cancelled with the batch before it ran: a line that never ran, as one never sent is
    for kind_line, url in ((line(), CHAT), (line(url="/v1/models/m/requests", body={"input": {"prompt": "x"}}),
                                            "/v1/models/m/requests")):
        item_ref = parse_line(kind_line, 0, url).ref("req_q")
        bad, queued = lined(item_ref, {"id": "req_q", "status": "cancelled", "started_at": None,
                                             "error": {"code": "cancelled", "message": "cancelled by the caller"}}, 1)
        assert not bad and queued["response"] is None and queued["error"]["code"] == "batch_cancelled", queued
        # stopped, or expired unstarted, because the batch's window ended: as OpenAI answers what a window left
        for status in ("cancelled", "expired"):
            view = {"id": "req_q", "status": status, "started_at": None, "error": {"code": status, "message": "x"}}
            bad, left = lined(item_ref, view, 1, "expired")
            assert not bad and left["response"] is None and left["error"]["code"] == "batch_expired", left
        bad, queued = lined(item_ref, {"id": "req_q", "status": "cancelled", "started_at": None}, 1, "cancelled")
        assert queued["error"]["code"] == "batch_cancelled"
    # cancelled while it ran: it got an answer, its error in the response
    bad, ran = lined(ref, {"id": "req_abc", "status": "cancelled", "started_at": 5.0,
                                 "error": {"code": "cancelled", "message": "cancelled while running"}}, 100)
    assert not bad and ran["error"] is None and ran["response"]["body"]["error"]["code"] == "cancelled"


def test_the_batch_object_has_openais_fields():
    meta = BatchMeta(id="batch_x", tenant="t", endpoint=CHAT, input_file_id="file-1", completion_window="24h",
                     created_at=10, expires_at=86_410, metadata={"k": "v"})
    obj = batch_object(meta, Progress(status="in_progress", total=3, completed=1, times={"in_progress_at": 11},
                                      model="tiny-llama", input_tokens=30, output_tokens=12))
    assert obj["object"] == "batch" and obj["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert obj["in_progress_at"] == 11 and obj["errors"] is None and obj["metadata"] == {"k": "v"}
    from openai.types import Batch  # the official client's own type reads it

    batch = Batch.model_validate(obj)
    assert batch.status == "in_progress" and batch.model == "tiny-llama"
    assert batch.usage is not None and (batch.usage.input_tokens, batch.usage.output_tokens) == (30, 12)
    assert batch.usage.total_tokens == 42
    assert Batch.model_validate(batch_object(meta, Progress())).model is None  # not validated yet, or several
    # cancelled while validated: no total yet while its lines are answered `batch_cancelled` (failed rose past 0)
    cancelling = batch_object(meta, Progress(status="cancelling", total=0, completed=0, failed=19_892))
    assert cancelling["request_counts"] == {"total": 19_892, "completed": 0, "failed": 19_892}


WINDOW_END = 10_000.0


def outcome(view, *, deadline=WINDOW_END, now=5_000.0, ending=None, url=CHAT, body=None):
    ref = parse_line(line(url=url, body=body), 0, url).ref("req_q", deadline=deadline, offset=0)
    return result_line(ref, {"id": "req_q", **view}, 1, ending, expires_at=WINDOW_END, now=now)


UNSTARTED = {"status": "expired", "started_at": None, "error": {"code": "deadline_exceeded", "message": "not computed"}}


def test_a_request_that_expired_before_it_ran_is_fed_again_while_the_window_is_open():
    """Its deadline was the model's max_timeout_s (no worker, or none free, for that long): the batch's window still
    allows it, so the line is fed again (None), never answered 504 while the window is open."""
    assert outcome(UNSTARTED, deadline=3_600.0) is None
    # fed with the window's end as its deadline, or the window is over: the window left it undone
    for kwargs in ({"deadline": WINDOW_END}, {"deadline": 3_600.0, "now": WINDOW_END},
                   {"deadline": 3_600.0, "ending": "expired"}):
        written = outcome(UNSTARTED, **kwargs)
        assert written is not None and written.expired and not written.ok, kwargs
        assert written.line["response"] is None and written.line["error"]["code"] == "batch_expired"
    # a ref of a runner of before has no deadline: the window's end decides
    assert outcome(UNSTARTED, deadline=0.0) is None and outcome(UNSTARTED, deadline=0.0, now=WINDOW_END).expired


def test_the_windows_end_leaves_a_request_that_ran_without_output_expired_and_one_with_output_answered():
    ran_empty = {"status": "expired", "started_at": 4_000.0, "error": {"code": "deadline_exceeded", "message": "x"},
                 "output": {"text": "", "token_ids": [], "prompt_tokens": 3, "completion_tokens": 0}}
    assert outcome(ran_empty).expired  # cut by the window with nothing to show
    own_timeout = outcome(ran_empty, deadline=3_600.0)  # cut by its own max_timeout_s: the 504 it would get alone
    assert own_timeout is not None and not own_timeout.expired and own_timeout.line["response"]["status_code"] == 504
    cut = {**ran_empty, "finish_reason": "deadline",
           "output": {"text": "yo", "token_ids": [5, 6], "prompt_tokens": 3, "completion_tokens": 2}}
    answered = outcome(cut, ending="expired")
    assert answered is not None and answered.ok and answered.tokens == (3, 2)
    assert answered.line["response"]["body"]["choices"][0]["finish_reason"] == "length"


def test_the_batchs_cancel_answers_what_it_cancelled_batch_cancelled_and_what_finished_as_it_ended():
    queued = {"status": "cancelled", "started_at": None, "error": {"code": "cancelled", "message": "x"}}
    written = outcome(queued, ending="cancelled")
    assert written is not None and written.line["error"]["code"] == "batch_cancelled" and not written.expired
    # one that started as it was cancelled ran: written as it ended (its answer, the cancel's 409), never "before
    # this request ran"
    cancelled_running = {**queued, "started_at": 4_000.0}
    ran = outcome(cancelled_running, ending="cancelled")
    assert ran is not None and ran.line["error"] is None and ran.line["response"]["status_code"] == 409
    done = outcome({"status": "succeeded", "started_at": 4_000.0, "finish_reason": "length",
                    "output": {"text": "yo", "token_ids": [5, 6], "prompt_tokens": 3, "completion_tokens": 2}},
                   ending="cancelled")
    assert done is not None and done.ok and done.line["response"]["status_code"] == 200


@pytest.mark.parametrize(("view", "status"), [
    ({"status": "cancelled", "started_at": 4_000.0, "error": {"code": "cancelled", "message": "x"}}, 409),
    ({"status": "failed", "started_at": 4_000.0, "error": {"code": "input_too_long", "message": "x"}}, 400),
    ({"status": "failed", "started_at": 4_000.0, "error": {"code": "model_error", "message": "x"}}, 500),
    ({"status": "expired", "started_at": 4_000.0, "error": {"code": "deadline_exceeded", "message": "x"}}, 504),
])
def test_a_native_lines_error_has_the_status_the_interactive_route_gives(view, status):
    native = "/v1/models/tiny-llama/requests"
    written = outcome(view, deadline=3_600.0, url=native, body={"input": {"prompt": "x"}})
    assert written is not None and not written.ok and written.line["response"]["status_code"] == status
    # in the native terms: the record's own code and message
    assert written.line["response"]["body"]["error"]["code"] == view["error"]["code"]
    assert written.line["response"]["body"]["error"]["message"] == "x"
    ok = outcome({"status": "succeeded", "started_at": 4_000.0, "output": {"text": "y", "prompt_tokens": 1,
                                                                          "completion_tokens": 1}},
                 url=native, body={"input": {"prompt": "x"}})
    assert ok is not None and ok.ok and ok.line["response"]["body"]["status"] == "succeeded" and ok.tokens == (1, 1)


async def test_a_batch_task_that_loses_a_cancellation_is_cancelled_again_until_it_ends():
    """`cancel_until_done`: the runner's work on a batch must end before its lease is given back. A task that
    swallows its first cancellation (as Python 3.11's `wait_for` inside redis-py can) runs on; it is cancelled
    again."""
    import asyncio

    from gateway.batch_runner import cancel_until_done

    rounds: list[str] = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            rounds.append("swallowed")  # lost, as in the bug
        while True:
            rounds.append("still running")
            await asyncio.sleep(0.01)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await cancel_until_done(task, every_s=0.02)
    assert task.cancelled() and rounds[0] == "swallowed" and "still running" in rounds


async def test_a_hold_whose_lease_renewal_swallows_the_cancellation_still_ends_and_stops_its_batch(monkeypatch):
    """At shutdown the runner cancels each batch's hold once and waits for it before giving the lease back. A
    renewal that swallows the cancellation (Python 3.11's `wait_for` inside redis-py) must not leave the hold
    renewing the lease and waiting for the whole batch: it ends, and its batch's work ends before it."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from fakeredis import aioredis as fake

    from gateway import batch_runner
    from shared.config import Settings
    from shared.keys import Keys

    monkeypatch.setattr(batch_runner, "LEASE_S", 0.06)
    renewing = asyncio.Event()

    class Store:
        async def renew(self, batch_id, name, ms):  # the hold's renewal of its own lease
            renewing.set()
            with contextlib.suppress(asyncio.CancelledError):  # lost, as in the bug
                await asyncio.Event().wait()  # a renewal that answers only when cancelled
            return True

    work_ended = asyncio.Event()

    async def run_batch(batch_id):
        try:
            await asyncio.Event().wait()  # the batch's work: runs until it is stopped
        finally:
            work_ended.set()

    runner = batch_runner.BatchRunner(Settings(), queue=SimpleNamespace(redis=fake.FakeRedis(), keys=Keys("unit")))
    runner.store, runner.run_batch = Store(), run_batch
    hold = asyncio.create_task(runner._hold("batch_x"))
    await renewing.wait()
    hold.cancel()
    done, _ = await asyncio.wait([hold], timeout=2.0)
    assert done and work_ended.is_set()


def test_a_lines_log_probabilities_and_echo_reach_its_output_line_through_the_kept_ref():
    """What the answer shows beyond the output (logprobs, echo, max_tokens 0) is kept with the item in flight (as
    the batch's record stores it, msgpack), not only in the body sent to the worker."""
    import msgspec

    from shared.batches import ItemRef

    comp = "/v1/completions"
    item = parse_line(line(url=comp, body={"model": "m", "prompt": "hi", "echo": True, "logprobs": 1,
                                           "max_tokens": 0}), 0, comp)
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(item.ref("req_abc")), type=ItemRef)
    entry = {"token_id": 5, "token": "hi", "logprob": -2.0, "top_logprobs": []}
    view = {"id": "req_abc", "status": "succeeded", "finish_reason": "eos",
            "output": {"text": "yo", "token_ids": [6], "prompt_tokens": 2, "completion_tokens": 1,
                       "logprobs": [{**entry, "token_id": 6, "token": "yo"}], "prompt_text": "hi",
                       "prompt_logprobs": [{**entry, "logprob": None}, entry]}}
    ok, out = lined(ref, view, 100)
    (choice,) = out["response"]["body"]["choices"]
    assert ok and choice["text"] == "hi" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0]
    assert out["response"]["body"]["usage"]["completion_tokens"] == 0
    chat = parse_line(line(body={"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}),
                      0, CHAT)
    _, out = lined(chat.ref("req_c"), view, 100)
    assert out["response"]["body"]["choices"][0]["logprobs"]["content"][0]["token"] == "yo"
    old = ItemRef(0, "a", "req_o", "chat", "m")  # kept by a gateway of before: no answer fields
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=ItemRef).answer is None
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([0, "a", "req_o", "chat", "m", "float"]),
                                  type=ItemRef).answer is None


def test_a_responses_line_is_answered_as_a_response_through_the_kept_ref():
    """A /v1/responses line is served as a chat completion and its output line's body is a `response`, the fields it
    echoes (instructions, max_output_tokens) kept with the item in flight; its checks name the Responses API's
    parameters."""
    import msgspec

    from shared.batches import ItemRef

    url = "/v1/responses"
    item = parse_line(line(url=url, body={"model": "m", "input": "hi", "instructions": "be brief",
                                          "max_output_tokens": 4}), 0, url)
    assert item.kind == "response" and item.body["input"]["messages"][0] == {"role": "system", "content": "be brief"}
    assert item.body["params"]["max_new_tokens"] == 4 and item.param("params.max_new_tokens", "x")[0] == (
        "body.max_output_tokens")
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(item.ref("req_r")), type=ItemRef)
    view = {"id": "req_r", "status": "succeeded", "finish_reason": "eos",
            "output": {"text": "Hello", "token_ids": [1, 2], "prompt_tokens": 3, "completion_tokens": 2}}
    ok, out = lined(ref, view, 100)
    body = out["response"]["body"]
    assert ok and body["object"] == "response" and body["id"] == "resp_req_r" and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "Hello" and body["instructions"] == "be brief"
    assert body["usage"]["output_tokens"] == 2 and body["max_output_tokens"] == 4
    with pytest.raises(BatchError) as err:
        parse_line(line(url=url, body={"model": "m", "input": "hi", "previous_response_id": "resp_x"}), 7, url)
    assert err.value.param == "body.previous_response_id"


def test_a_lines_tool_calls_reach_its_output_line_through_the_kept_ref():
    """A chat line with a forced function answers `tool_calls`, as the route does; a ref kept before the tool
    fields existed reads back without them."""
    import msgspec

    from shared.batches import Answer, ItemRef

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    item = parse_line(line(body=body), 0, CHAT)
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(item.ref("req_t")), type=ItemRef)
    view = {"id": "req_t", "status": "succeeded", "finish_reason": "stop",
            "output": {"text": '{"a": 1}', "token_ids": [6], "prompt_tokens": 2, "completion_tokens": 1}}
    ok, out = lined(ref, view, 100)
    (choice,) = out["response"]["body"]["choices"]
    assert ok and choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    older = msgspec.msgpack.encode([1, False, None, False])  # an Answer of before: logprobs 1, nothing else
    assert msgspec.msgpack.decode(older, type=Answer) == Answer(logprobs=1)


def test_a_line_with_the_deprecated_functions_answers_function_call():
    import msgspec

    from shared.batches import ItemRef

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": {"name": "f"}}
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(parse_line(line(body=body), 0, CHAT).ref("req_f")),
                                 type=ItemRef)
    view = {"id": "req_f", "status": "succeeded", "finish_reason": "stop",
            "output": {"text": '{"a": 1}', "token_ids": [6], "prompt_tokens": 2, "completion_tokens": 1}}
    ok, out = lined(ref, view, 100)
    (choice,) = out["response"]["body"]["choices"]
    assert ok and choice["message"]["function_call"] == {"name": "f", "arguments": '{"a": 1}'}
    assert "tool_calls" not in choice["message"]


def test_a_native_line_naming_a_callback_of_its_own_is_refused():
    """A batch's items answer in its output file and its `callback_url` tells of its end: a native line's own
    `callback` would have been dropped without a word."""
    native = "/v1/models/tiny-llama/requests"
    body = {"input": {"prompt": "x"}, "callback": {"url": "http://127.0.0.1:9/hook"}}
    with pytest.raises(BatchError) as err:
        parse_line(line(url=native, body=body), 3, native)
    assert err.value.code == "invalid_request" and err.value.entry()["param"] == "body.callback"
    assert err.value.entry()["line"] == 4


def test_an_items_key_is_none_a_caller_can_send() -> None:
    """A caller's own request under a batch line's key took the line's place (409 in the error file, or its output
    in the batch's); a line's key holds a character no Idempotency-Key can, and each line and attempt its own."""
    from shared.batches import item_key
    from shared.idempotency_keys import valid_idempotency_key

    keys = {item_key("batch_abc", line, attempt) for line in range(3) for attempt in range(3)}
    assert len(keys) == 9 and not any(valid_idempotency_key(k) for k in keys)
