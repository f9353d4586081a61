"""The echo model (`kind: echo`): configured from the model file, answered by `EchoRunner` behind the runner
port, and served by a real `Worker` (intake, scheduler, publisher) on the in-memory queue. No torch, no Redis."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from gpu_worker.announce import MemoryAnnouncer
from gpu_worker.echo_runner import EchoRunner, decode_tokens, encode_text
from gpu_worker.job import Job
from gpu_worker.memory_queue import MemoryQueue
from gpu_worker.outcomes import Outcome
from gpu_worker.worker import Worker
from shared.config import ModelSpec, Settings
from shared.errors import ConfigError, ValidationError
from shared.keys import Keys
from shared.messages import InferenceRequest
from shared.states import FinishReason, Priority, Status, Task
from shared.submit import build_request
from shared.token_limits import TokenLimits

SPEC = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=64,
                 max_new_tokens=64).validate()
LANE = Keys("unit").lane_stream("echo", "short")


def request(rid: str = "r1", *, prompt: str | None = "abc", input_ids: list[int] | None = None,
            max_new_tokens: int = 5, stop: tuple[str, ...] = (), stream: bool = False) -> InferenceRequest:
    now_ms = int(time.time() * 1000)
    inp = {"input_ids": input_ids} if input_ids is not None else {"prompt": prompt}
    params: dict[str, object] = {"max_new_tokens": max_new_tokens}
    if stop:
        params["stop"] = list(stop)
    return InferenceRequest(id=rid, tenant="t", model="echo", task=Task.GENERATE, input=inp, params=params,
                            lane="short", priority=Priority.INTERACTIVE, created_ms=now_ms,
                            deadline_ms=now_ms + 60_000, est_tokens=8, stream=stream)


def job(runner: EchoRunner, req: InferenceRequest) -> Job:
    item = runner.prepare(req, time.time())
    assert isinstance(item, Job), item
    return item


def run_to_end(runner: EchoRunner, jobs: list[Job]) -> dict[str, Outcome]:
    done = {o.request.id: o for o in runner.start(jobs, time.time())}
    while runner.busy:
        done.update({o.request.id: o for o in runner.step()})
    return done


def test_the_model_file_declares_an_echo_model_without_a_source():
    s = Settings.from_environ({"BATCHGATE_CONFIG_YAML": "models:\n  - {name: e, task: generate, kind: echo, "
                                                        "step_ms: 2}\n"})
    (spec,) = s.models
    assert (spec.echo, spec.step_ms, spec.source) == (True, 2.0, "")
    assert spec.to_public()["kind"] == "echo"
    with pytest.raises(ConfigError):  # a model with weights still needs its source
        Settings.from_environ({"BATCHGATE_CONFIG_YAML": "models:\n  - {name: e, task: generate}\n"})


@pytest.mark.parametrize("fields", [{"task": Task.EMBED}, {"kind": "mirror"}, {"step_ms": -1.0}])
def test_what_an_echo_model_cannot_be(fields):
    with pytest.raises(ConfigError):
        dataclasses.replace(SPEC, **fields).validate()


def test_it_echoes_the_prompt_cycling_one_token_a_step():
    runner = EchoRunner(SPEC, "w", max_rows=4)
    j = job(runner, request(prompt="abc", max_new_tokens=5))
    assert j.inputs == (tuple(b"abc"),) and j.tokens == 8
    assert runner.start([j], time.time()) == [] and runner.remaining_tokens() == {"r1": 4}  # the first token
    steps = 0
    while runner.busy:
        out = runner.step()
        steps += 1
    assert steps == 4 and runner.free_rows == 4
    result = out[0].result
    assert result.status is Status.SUCCEEDED and result.finish_reason is FinishReason.LENGTH
    assert result.output == {"text": "abcab", "token_ids": list(b"abcab"), "prompt_tokens": 3, "completion_tokens": 5}
    assert runner.stats.decode_tokens == 4 and runner.model_calls == {"r1": 1}


def test_input_ids_text_stop_strings_and_multibyte_text():
    runner = EchoRunner(dataclasses.replace(SPEC, vocab_size=300), "w", max_rows=4)
    done = run_to_end(runner, [job(runner, request("ids", input_ids=[104, 105, 299], max_new_tokens=4)),
                               job(runner, request("stop", prompt="one two", max_new_tokens=20, stop=("tw",))),
                               job(runner, request("utf8", prompt="é", max_new_tokens=3))])
    assert done["ids"].result.output["token_ids"] == [104, 105, 299, 104]
    assert done["ids"].result.output["text"] == "hih"  # ids over 255 spell nothing
    stop = done["stop"].result
    assert stop.finish_reason is FinishReason.STOP and stop.output["text"] == "one "
    # the tokens the cut left out ("tw", which completed the stop string) were generated all the same
    assert (stop.output["completion_tokens"], stop.output["generated_tokens"]) == (4, 6)
    assert "generated_tokens" not in done["ids"].result.output  # no cut: the same count
    assert done["utf8"].result.output["text"] == "é\ufffd"  # the third byte starts a character cut short
    assert encode_text("é") == [195, 169] and decode_tokens([195, 169]) == "é"


def test_refusals_cancel_hold_back_and_a_step_sleep():
    slept: list[float] = []
    runner = EchoRunner(dataclasses.replace(SPEC, step_ms=3.0), "w", max_rows=4, sleep=slept.append)
    long = runner.prepare(request(prompt="x" * 65), time.time())
    assert isinstance(long, Outcome) and long.result.error is not None
    assert long.result.error.code == "input_too_long"
    empty = runner.prepare(request(prompt=""), time.time())
    assert isinstance(empty, Outcome) and empty.result.status is Status.FAILED
    a, b = job(runner, request("a", max_new_tokens=10)), job(runner, request("b", max_new_tokens=10))
    runner.start([a, b], time.time())
    runner.hold_back(frozenset({"b"}))
    runner.step()
    assert runner.remaining_tokens() == {"a": 8, "b": 9} and slept == [0.003, 0.003]
    (gone,) = runner.remove({"a"}, FinishReason.CANCELLED)
    assert gone.result.status is Status.CANCELLED and gone.result.output["completion_tokens"] == 2
    assert runner.running_ids() == ["b"]


def test_a_format_is_refused_by_a_model_that_only_echoes():
    req = request()
    req = dataclasses.replace(req, params={**req.params, "response_format": {"type": "json_object"}})
    out = EchoRunner(SPEC, "w", max_rows=4).prepare(req, time.time())
    assert isinstance(out, Outcome) and out.result.error is not None
    assert out.result.error.code == "invalid_input" and "response_format" in out.result.error.message
    # known at submit already: refused there (a batch's validation too), not accepted to fail on the worker
    with pytest.raises(ValidationError) as err:
        build_request({"input": {"prompt": "abc"}, "params": {"response_format": {"type": "json_object"}}}, SPEC, "t",
                      time.time())
    assert err.value.field == "params.response_format" and "echoes its prompt" in err.value.message


def test_a_prompt_is_truncated_as_a_model_truncates_it():
    req = request(input_ids=list(range(1, 71)))  # over the model's 64
    out = EchoRunner(SPEC, "w", max_rows=4).prepare(req, time.time())
    assert isinstance(out, Outcome) and out.result.error is not None and out.result.error.code == "input_too_long"
    for keep, kept in ((3, (68, 69, 70)), (-1, tuple(range(7, 71)))):
        req = dataclasses.replace(req, params={**req.params, "truncate_prompt_tokens": keep})
        job = EchoRunner(SPEC, "w", max_rows=4).prepare(req, time.time())
        assert not isinstance(job, Outcome) and job.inputs[0] == kept


def test_a_cost_curve_sleeps_per_row_stepped_and_per_prompt_token_prefilled():
    slept: list[float] = []
    spec = dataclasses.replace(SPEC, step_ms=10.0, step_ms_per_row=2.0, prefill_ms_per_token=0.5).validate()
    runner = EchoRunner(spec, "w", max_rows=4, sleep=slept.append)
    a, b = job(runner, request("a", prompt="x" * 20, max_new_tokens=9)), job(runner, request("b", prompt="yy"))
    runner.start([a, b], time.time())  # one forward prefills both prompts: 22 tokens
    runner.step()  # two rows
    runner.hold_back(frozenset({"b"}))
    runner.step()  # a held-back row is not advanced, and costs nothing
    assert slept == pytest.approx([0.010 + 0.0005 * 22, 0.010 + 0.002 * 2, 0.010 + 0.002])
    with pytest.raises(ConfigError):
        dataclasses.replace(SPEC, prefill_ms_per_token=-1.0).validate()
    spec = Settings.from_environ({"BATCHGATE_CONFIG_YAML": "models:\n  - {name: e, task: generate, kind: echo, "
                                                          "step_ms: 14, step_ms_per_row: 0.5, "
                                                          "prefill_ms_per_token: 0.35}\n"}).models[0]
    assert (spec.step_ms, spec.step_ms_per_row, spec.prefill_ms_per_token) == (14.0, 0.5, 0.35)


def test_streamed_deltas_add_up_to_the_result_and_a_rerun_continues_after_them():
    runner = EchoRunner(SPEC, "w", max_rows=4)
    j = job(runner, request(prompt="hello", max_new_tokens=7, stream=True))
    runner.start([j], time.time())
    texts = [d.delta.text for d in runner.take_deltas()]
    runner.step()
    runner.step()
    texts += [d.delta.text for d in runner.take_deltas()]
    assert "".join(texts) == "hel"
    # the worker died; another runs it again after the three tokens its caller was sent
    again = InferenceRequest(**{**{f.name: getattr(j.req, f.name) for f in dataclasses.fields(j.req)},
                                "streamed": tuple(b"hel")})
    other = EchoRunner(SPEC, "w2", max_rows=4)
    done = run_to_end(other, [job(other, again)])
    assert done["r1"].result.output["text"] == "hellohe"


@pytest.mark.spawns
def test_the_echo_runner_and_its_worker_import_no_torch():
    code = ("import sys, gpu_worker.echo_runner, gpu_worker.assembly, gpu_worker.worker; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@contextlib.asynccontextmanager
async def echo_worker(spec: ModelSpec = SPEC) -> AsyncIterator[tuple[Worker, MemoryQueue]]:
    """A real `Worker` serving `spec` on the in-memory queue, ready; stopped on the way out."""
    settings = Settings(key_prefix="unit", models=(spec,), worker_name="w1", intake_block_ms=20).validate()
    q = MemoryQueue()
    worker = Worker(settings, queue=q, announcer=MemoryAnnouncer())
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        yield worker, q
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.usefixtures("heap_calls")  # the start-up heap freeze is recorded, not run (conftest)
async def test_a_worker_serves_an_echo_model_through_its_usual_path():
    """Intake, the scheduler's lanes, mark-running and the publisher, on the in-memory queue."""
    async with echo_worker() as (worker, q):
        for i in range(5):
            await q.enqueue(LANE, request(f"r{i}", prompt=f"p{i}", max_new_tokens=4))
        end = time.monotonic() + 5
        while not all((rec := q.records.get(f"r{i}")) and rec.state is Status.SUCCEEDED for i in range(5)):
            assert time.monotonic() < end, "not served in time"
            await asyncio.sleep(0.005)
        assert q.records["r3"].result is not None and q.records["r3"].result.output["text"] == "p3p3"
        assert worker.engines["echo"].model_calls() == {f"r{i}": 1 for i in range(5)}


def test_the_gateway_counts_echo_tokens_as_bytes():
    limits = TokenLimits("")
    assert limits.count(SPEC, ["héllo"]) == [6] and limits.vocab_size(SPEC) is None


def test_a_logit_bias_beyond_the_vocabulary_is_refused_as_a_model_refuses_it():
    runner = EchoRunner(dataclasses.replace(SPEC, vocab_size=300), "w", max_rows=4)
    req = dataclasses.replace(request("b"), params={"max_new_tokens": 3, "logit_bias": {"300": -100}})
    out = runner.prepare(req, time.time())
    assert isinstance(out, Outcome) and out.result.error is not None and out.result.error.code == "invalid_input"
    assert isinstance(runner.prepare(dataclasses.replace(req, params={"logit_bias": {"299": 5}}), time.time()), Job)


def test_the_gateway_refuses_a_logit_bias_beyond_the_vocabulary_at_submit():
    spec = dataclasses.replace(SPEC, vocab_size=300)
    body = {"input": {"prompt": "abc"}, "params": {"logit_bias": {"12": 1, "300": -100}}}
    with pytest.raises(ValidationError) as err:
        build_request(body, spec, "t", time.time(), limits=TokenLimits(""))
    assert err.value.field == "params.logit_bias" and err.value.message.startswith("300 is not a token")
    body["params"] = {"logit_bias": {"299": -100}}
    assert build_request(body, spec, "t", time.time(), limits=TokenLimits("")).params["logit_bias"] == {299: -100.0}


def test_log_probabilities_of_the_echo_model_are_certain():
    """The echo model has one possible token at each step: log probability 0, itself the only alternative; its
    prompt's too (the first token's none), and the prompt echoed with `echo`."""
    runner = EchoRunner(SPEC, "w", max_rows=4)
    req = request(prompt="abc", max_new_tokens=3)
    req = dataclasses.replace(req, params={**req.params, "logprobs": 2, "prompt_logprobs": 1})
    (out,) = run_to_end(runner, [job(runner, req)]).values()
    output = out.result.output
    assert [(e["token_id"], e["logprob"], e["top_logprobs"]) for e in output["logprobs"]] == [
        (t, 0.0, [{"token_id": t, "token": chr(t), "logprob": 0.0}]) for t in b"abc"]
    assert output["prompt_token_ids"] == list(b"abc") and output["prompt_text"] == "abc"
    assert [e["logprob"] for e in output["prompt_logprobs"]] == [None, 0.0, 0.0]
    plain = dataclasses.replace(req, id="p", params={"max_new_tokens": 2, "echo": True})
    (out,) = run_to_end(runner, [job(runner, plain)]).values()
    assert out.result.output["prompt_text"] == "abc" and "prompt_logprobs" not in out.result.output
    assert "logprobs" not in out.result.output


def test_an_echo_tokens_log_probability_names_its_own_byte_where_it_is_part_of_a_character():
    """A byte of a multi-byte character is its `token` U+FFFD and its `bytes` the byte itself (they were U+FFFD's
    own three bytes: joined, an OpenAI client's `bytes` spelled replacement characters instead of the text)."""
    runner = EchoRunner(SPEC, "w", max_rows=4)
    text = "a\u00e9\U0001F600"
    req = request(prompt=text, max_new_tokens=len(text.encode()))
    req = dataclasses.replace(req, params={**req.params, "logprobs": 1, "prompt_logprobs": 0})
    (out,) = run_to_end(runner, [job(runner, req)]).values()
    output = out.result.output
    entries = output["logprobs"]
    assert [e["token"] for e in entries] == ["a"] + ["\ufffd"] * 6
    assert b"".join(bytes(e.get("bytes") or e["token"].encode()) for e in entries).decode() == output["text"] == text
    assert all(t.get("bytes") == e.get("bytes") for e in entries for t in e["top_logprobs"])
    assert [e.get("bytes") for e in output["prompt_logprobs"]] == [None, *[[b] for b in text.encode()[1:]]]


def test_stop_token_ids_end_a_row_before_stop_strings_id_kept_text_not():
    """As a model's runner: a stop token is checked before the stop strings; its id stays in the output, its text
    does not (as a stream sends it); an id past the vocabulary is refused."""
    runner = EchoRunner(SPEC, "w", max_rows=4)
    req = request(prompt="abcdef", max_new_tokens=10, stop=("bc",))
    both = dataclasses.replace(req, params={**req.params, "stop_token_ids": [ord("c")]})
    out = run_to_end(runner, [job(runner, both)])["r1"].result
    assert out.finish_reason == FinishReason.STOP
    assert (out.output["token_ids"], out.output["text"]) == ([97, 98, 99], "ab")
    strings = run_to_end(runner, [job(runner, req)])["r1"].result  # the stop string alone: cut before it
    assert (strings.output["token_ids"], strings.output["text"]) == ([97], "a")
    for params, ids, text in (({"stop_token_ids": [ord("c")]}, [97, 98, 99], "abc"), ({}, [97, 98, 99], "abc")):
        kept = dataclasses.replace(req, params={**req.params, **params, "include_stop_str_in_output": True})
        out = run_to_end(runner, [job(runner, kept)])["r1"].result  # vLLM's include_stop_str_in_output
        assert (out.output["token_ids"], out.output["text"], out.finish_reason) == (ids, text, FinishReason.STOP)
    plain = request(prompt="abcdef", max_new_tokens=10)
    never = dataclasses.replace(plain, params={**plain.params, "stop_token_ids": [ord("z")]})
    assert run_to_end(runner, [job(runner, never)])["r1"].result.finish_reason == FinishReason.LENGTH
    vocab = dataclasses.replace(SPEC, vocab_size=256)
    past = dataclasses.replace(plain, params={**plain.params, "stop_token_ids": [300]})
    refused = EchoRunner(vocab, "w", max_rows=4).prepare(past, time.time())
    assert isinstance(refused, Outcome) and refused.result.error is not None
    assert refused.result.error.code == "invalid_input" and "stop_token_ids" in refused.result.error.message


def test_min_tokens_hold_a_row_open_past_its_stop_tokens_and_strings_as_a_models_rows():
    runner = EchoRunner(SPEC, "w", max_rows=4)

    def run(**params) -> tuple[list[int], str, FinishReason]:
        req = request(prompt="abcdef", max_new_tokens=12)
        req = dataclasses.replace(req, params={**req.params, **params})
        out = run_to_end(runner, [job(runner, req)])["r1"].result
        return out.output["token_ids"], out.output["text"], out.finish_reason

    assert run(stop_token_ids=[ord("b")], min_tokens=3) == ([*b"abcdefab"], "abcdefa", FinishReason.STOP)
    assert run(stop=["bc"], min_tokens=2) == ([97], "a", FinishReason.STOP)  # the 3rd token completes it: past them
    assert run(stop=["bc"], min_tokens=3) == ([*b"abcdefa"], "abcdefa", FinishReason.STOP)  # within: the next cuts
    assert run(stop=["bc"], min_tokens=12) == ([*b"abcdefabcdef"], "abcdefabcdef", FinishReason.LENGTH)
    req = request(prompt="a\n\n\nb\n\n", max_new_tokens=12, stop=("\n\n",), stream=True)
    req = dataclasses.replace(req, params={**req.params, "min_tokens": 3})  # one "\n\n" overlapping one within
    j = job(runner, req)
    done = {o.request.id: o for o in runner.start([j], time.time())}
    sent = "".join(d.delta.text for d in runner.take_deltas())
    while runner.busy:
        done.update({o.request.id: o for o in runner.step()})
        sent += "".join(d.delta.text for d in runner.take_deltas())
    result = done["r1"].result
    assert (result.output["text"], result.finish_reason) == ("a\n", FinishReason.STOP)
    assert sent == "a"  # nothing the result leaves out was sent (the gateway sends the held "\n" from the result)


def test_a_stream_with_min_tokens_sends_what_the_result_holds_and_a_rerun_counts_what_it_was_sent():
    runner = EchoRunner(SPEC, "w", max_rows=4)
    req = request(prompt="abcdef", max_new_tokens=12, stop=("bc",), stream=True)
    req = dataclasses.replace(req, params={**req.params, "min_tokens": 4})
    j = job(runner, req)
    done = {o.request.id: o for o in runner.start([j], time.time())}
    texts = [d.delta.text for d in runner.take_deltas()]
    while runner.busy:
        done.update({o.request.id: o for o in runner.step()})
        texts += [d.delta.text for d in runner.take_deltas()]
    assert "".join(texts) == done["r1"].result.output["text"] == "abcdefa"
    again = dataclasses.replace(req, streamed=tuple(b"ab"))  # sent two tokens, then its worker died
    other = EchoRunner(SPEC, "w2", max_rows=4)
    assert run_to_end(other, [job(other, again)])["r1"].result.output["text"] == "abcdefa"
    by_token = dataclasses.replace(req, params={"max_new_tokens": 12, "stop_token_ids": [ord("b")], "min_tokens": 8},
                                   streamed=tuple(b"ab"))  # min_tokens counts the two tokens it was sent
    out = run_to_end(other, [job(other, by_token)])["r1"].result
    assert (out.output["token_ids"], out.finish_reason) == ([*b"abcdefab"], FinishReason.STOP)


@pytest.mark.usefixtures("heap_calls")
async def test_a_fresh_worker_computes_nothing_of_a_request_its_first_step_cannot_finish_in_time():
    """Before a worker has measured a step, the echo model's configured costs stand in for the measurement (a real
    model's, its warm-up's): a request whose deadline its compute cannot meet expires unstarted, and the load the
    worker publishes for admission has its costs from the first moment (zeros promised any deadline)."""
    spec = dataclasses.replace(SPEC, step_ms=30.0, prefill_ms_per_token=0.5).validate()
    async with echo_worker(spec) as (worker, q):
        (loop,) = worker.engines["echo"].loops
        req = request("tight", max_new_tokens=60)
        req = dataclasses.replace(req, deadline_ms=req.created_ms + 300)  # 60 steps of 30 ms: 1.8 s
        await q.enqueue(LANE, req)
        end = time.monotonic() + 5
        while not ((rec := q.records.get("tight")) and rec.state is Status.EXPIRED):
            assert time.monotonic() < end, "not expired in time"
            await asyncio.sleep(0.005)
        assert worker.engines["echo"].model_calls() == {}, "computed though it could not finish"
        snap = loop.snapshot
        assert snap.decode_ms_per_step == pytest.approx(30.0) and snap.prefill_ms_per_token == pytest.approx(0.5)
