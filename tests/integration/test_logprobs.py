"""Log probabilities (`params.logprobs`): every output token's log probability under the model's own logits and
its likeliest alternatives, as one forward of the whole sequence without a cache gives them. Rows batched with
others, a late joiner, sampled and penalized rows (the raw logits, not the processed ones), a prompt prefilled in
chunks fused into decode steps, a stop string's cut, stream deltas and a streamed request run again."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from gpu_worker.engine import GenerationEngine
from gpu_worker.outcomes import Delta, Outcome
from gpu_worker.sequences import GenSpec, SamplingParams
from shared.states import FinishReason
from tests import tiny_runner
from tests.integration.test_penalties import PROMPTS, request
from tests.tiny_runner import TOKENIZER, runner_for
from tests.torch_device import on_device

TOL = 2e-4


@pytest.fixture(scope="module")
def model():
    return tiny_runner.tiny_llama(seed=5)  # test_penalties' model


@on_device
def expected(model, prompt: list[int], output: list[int], k: int) -> list[tuple[float, list[int], list[float]]]:
    """Each output token's (log probability, top-k ids, their log probabilities) from one uncached forward."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        scores = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    out = []
    for j, tok in enumerate(output):
        row = scores[len(prompt) - 1 + j]
        values, top = row.topk(k) if k else (row[:0], row[:0].long())
        out.append((row[tok].item(), top.tolist(), values.tolist()))
    return out


def check(model, prompt: list[int], output: dict[str, Any], k: int) -> None:
    entries = output["logprobs"]
    assert len(entries) == len(output["token_ids"])
    for entry, tok, (lp, top_ids, top_values) in zip(entries, output["token_ids"],
                                                    expected(model, prompt, output["token_ids"], k), strict=True):
        assert entry["token_id"] == tok and entry["token"] == TOKENIZER.decode([tok], skip_special_tokens=True)
        assert entry["logprob"] == pytest.approx(lp, abs=TOL)
        assert [t["token_id"] for t in entry["top_logprobs"]] == top_ids
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top_values, abs=TOL)
        assert all(t["token"] == TOKENIZER.decode([t["token_id"]], skip_special_tokens=True)
                   for t in entry["top_logprobs"])


def served(model, params: dict[str, Any], *, stream: bool = False) -> tuple[dict[str, Any], list[Delta]]:
    """Rows a and b together, c joining after three steps: each request's output, and the deltas streamed."""
    runner = runner_for(model)
    streamed = [] if stream else None
    deltas: list[Delta] = []
    done = runner.start([runner.prepare(request(r, params, streamed), time.time()) for r in ("a", "b")],
                        time.time())
    for i in range(200):
        if i == 3:
            done += runner.start([runner.prepare(request("c", params, streamed), time.time())], time.time())
        if not runner.busy and i > 3:
            break
        done += runner.step()
        deltas += runner.take_deltas()
    return {o.result.id: o.result.output for o in done if isinstance(o, Outcome)}, deltas


@pytest.mark.parametrize("params", [
    {"logprobs": 5},
    {"logprobs": 0},
    {"logprobs": 3, "temperature": 0.9, "seed": 3},
    {"logprobs": 2, "frequency_penalty": 1.5, "logit_bias": {"5851": -100}},
], ids=["greedy-top5", "chosen-only", "sampled", "penalized"])
def test_each_tokens_log_probability_is_the_models_own(model, params):
    outputs, _ = served(model, params)
    assert set(outputs) == set(PROMPTS)
    for rid, output in outputs.items():
        check(model, PROMPTS[rid], output, params["logprobs"])
        if params["logprobs"] == 0:
            assert all(e["top_logprobs"] == [] for e in output["logprobs"])


def test_without_the_param_no_log_probabilities_are_kept_or_returned(model):
    outputs, _ = served(model, {})
    assert all("logprobs" not in output for output in outputs.values())


def test_a_stop_strings_cut_cuts_the_log_probabilities_with_the_tokens(model):
    whole, _ = served(model, {"logprobs": 1})
    text = whole["a"]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut, _ = served(model, {"logprobs": 1, "stop": [stop]})
    assert cut["a"]["text"] == text[:text.index(stop)] and len(cut["a"]["token_ids"]) < len(whole["a"]["token_ids"])
    assert cut["a"]["logprobs"] == whole["a"]["logprobs"][:len(cut["a"]["token_ids"])]


def test_stream_deltas_carry_their_tokens_entries(model):
    outputs, deltas = served(model, {"logprobs": 2}, stream=True)
    for rid, output in outputs.items():
        mine = [d.delta for d in deltas if d.request.id == rid]
        assert mine and all(d.logprobs is not None and len(d.logprobs) == len(d.token_ids) for d in mine)
        sent = [e for d in mine for e in d.logprobs]
        assert sent == output["logprobs"][:len(sent)]


@pytest.mark.parametrize("prompt_k", [None, 0, 4])
def test_a_streamed_request_run_again_has_whole_logprobs_what_its_caller_was_sent_scored_with_its_prompt(model,
                                                                                                       prompt_k):
    """The tokens its caller was sent join the prompt; the prefill scores them with the alternatives the output
    asks for, and the prompt's own entries (if asked) keep theirs."""
    params = {"logprobs": 2} | ({} if prompt_k is None else {"prompt_logprobs": prompt_k})
    whole, _ = served(model, params)
    sent = whole["c"]["token_ids"][:4]
    runner = runner_for(model)
    done = runner.start([runner.prepare(request("c", params, streamed=sent), time.time())], time.time())
    while runner.busy:
        done += runner.step()
    (out,) = [o for o in done if isinstance(o, Outcome)]
    entries = out.result.output["logprobs"]
    assert out.result.output["token_ids"] == whole["c"]["token_ids"]
    assert len(entries) == len(whole["c"]["token_ids"])
    got, want = out.result.output.get("prompt_logprobs"), whole["c"].get("prompt_logprobs")
    assert (got is None) == (want is None) == (prompt_k is None)
    for a, b in zip(got or (), want or (), strict=True):
        assert a["token_id"] == b["token_id"] and len(a["top_logprobs"]) == len(b["top_logprobs"])
        assert a["logprob"] == pytest.approx(b["logprob"], abs=TOL)
    for a, b in zip(entries, whole["c"]["logprobs"], strict=True):
        assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=TOL)
        assert [t["token_id"] for t in a["top_logprobs"]] == [t["token_id"] for t in b["top_logprobs"]]


def test_a_prompt_prefilled_in_chunks_fused_into_decode_steps(model):
    """The first token of a chunked prompt comes from its last chunk's forward, fused with the running rows'."""
    engine = GenerationEngine(model, max_rows=4, max_seq_len=200, fused=True)
    running = [GenSpec(id=f"s{i}", prompt_ids=tuple(PROMPTS[r]), max_new_tokens=20,
                       sampling=SamplingParams(logprobs=3)) for i, r in enumerate(("a", "b"))]
    long = GenSpec(id="long", prompt_ids=tuple((7 * i) % 400 + 3 for i in range(90)), max_new_tokens=8,
                   sampling=SamplingParams(logprobs=3))
    results = {r.id: r for r in engine.prefill(running)}
    engine.prefill_in_chunks(long)
    while engine.running:
        results.update({r.id: r for r in engine.step(chunk_tokens=16)})
    for spec in [*running, long]:
        got = results[spec.id]
        assert got.logprobs is not None and len(got.logprobs) == len(got.token_ids)
        for (lp, top), (want, top_ids, top_values) in zip(got.logprobs, expected(model, list(spec.prompt_ids),
                                                                               got.token_ids, 3), strict=True):
            assert lp == pytest.approx(want, abs=TOL) and [t for t, _ in top] == top_ids
            assert [v for _, v in top] == pytest.approx(top_values, abs=TOL)


# --- the prompt's own (`prompt_logprobs`, OpenAI's completions `echo` with `logprobs`) --------------------------

def check_prompt(model, prompt: list[int], got: list[Any], k: int) -> None:
    """`got` (engine tuples or output dicts): none for the first token, then each token given the ones before."""
    assert len(got) == len(prompt) and (got[0] is None or (got[0]["logprob"], got[0]["top_logprobs"]) == (None, []))
    want = expected(model, prompt[:1], prompt[1:], k)
    for entry, (lp, top_ids, top_values) in zip(got[1:], want, strict=True):
        if isinstance(entry, dict):
            entry = (entry["logprob"], [(t["token_id"], t["logprob"]) for t in entry["top_logprobs"]])
        assert entry[0] == pytest.approx(lp, abs=TOL) and [t for t, _ in entry[1]] == top_ids
        assert [v for _, v in entry[1]] == pytest.approx(top_values, abs=TOL)


def test_prompt_log_probabilities_from_a_batched_prefill(model):
    outputs, _ = served(model, {"prompt_logprobs": 2, "max_new_tokens": 3})
    for rid, output in outputs.items():
        assert output["prompt_token_ids"] == PROMPTS[rid]
        assert output["prompt_text"] == TOKENIZER.decode(PROMPTS[rid], skip_special_tokens=True)
        check_prompt(model, PROMPTS[rid], output["prompt_logprobs"], 2)
        assert "logprobs" not in output  # the output's own were not asked for
    plain, _ = served(model, {"max_new_tokens": 3})
    assert all("prompt_logprobs" not in o and "prompt_token_ids" not in o for o in plain.values())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "chunks-of-their-own"])
def test_prompt_log_probabilities_of_a_prompt_prefilled_in_chunks(model, fused):
    """Each chunk's last position scores the next chunk's first token; rows without the param keep the last
    position's logits alone."""
    engine = GenerationEngine(model, max_rows=4, max_seq_len=200, fused=fused)
    running = [GenSpec(id=f"s{i}", prompt_ids=tuple(PROMPTS[r]), max_new_tokens=30,
                       sampling=SamplingParams(prompt_logprobs=1 if i else None)) for i, r in enumerate(("a", "b"))]
    long = GenSpec(id="long", prompt_ids=tuple((7 * i) % 400 + 3 for i in range(90)), max_new_tokens=4,
                   sampling=SamplingParams(prompt_logprobs=3, logprobs=1))
    results = {r.id: r for r in engine.prefill(running)}
    engine.prefill_in_chunks(long)
    while engine.running:
        results.update({r.id: r for r in engine.step(chunk_tokens=16)})
    assert results["s0"].prompt_logprobs is None
    check_prompt(model, PROMPTS["b"], results["s1"].prompt_logprobs, 1)
    check_prompt(model, list(long.prompt_ids), results["long"].prompt_logprobs, 3)
    assert len(results["long"].logprobs) == 4 and not engine.prompt_logprobs.kept  # nothing left behind


def test_a_chunked_prompt_cancelled_midway_leaves_nothing_kept(model):
    engine = GenerationEngine(model, max_rows=4, max_seq_len=200)
    engine.prefill_in_chunks(GenSpec(id="long", prompt_ids=tuple(range(3, 93)), max_new_tokens=4,
                                     sampling=SamplingParams(prompt_logprobs=0)))
    engine.step(chunk_tokens=16)
    assert engine.prompt_logprobs.kept
    engine.remove({"long"}, FinishReason.CANCELLED)
    assert not engine.prompt_logprobs.kept


def test_echo_returns_the_prompt_without_scoring_it(model):
    outputs, _ = served(model, {"echo": True, "max_new_tokens": 2})
    for rid, output in outputs.items():
        assert output["prompt_token_ids"] == PROMPTS[rid] and "prompt_logprobs" not in output
        assert output["prompt_text"] == TOKENIZER.decode(PROMPTS[rid], skip_special_tokens=True)


def test_a_prompt_too_long_to_score_fails_alone_and_says_why(model, monkeypatch):
    from gpu_worker import token_logprobs

    monkeypatch.setattr(token_logprobs, "PROMPT_LOGITS_MAX", len(PROMPTS["a"]) * len(TOKENIZER) - 1)
    runner = runner_for(model)
    out = runner.prepare(request("a", {"prompt_logprobs": 0}), time.time())
    assert isinstance(out, Outcome) and out.result.error is not None and out.result.error.code == "invalid_input"
    assert "prompt_logprobs" in out.result.error.message and "logits" in out.result.error.message
    assert not isinstance(runner.prepare(request("b", {"prompt_logprobs": 0}), time.time()), Outcome)  # shorter


def test_scoring_in_slices_of_positions_gives_the_same_entries(model, monkeypatch):
    from gpu_worker import sampling

    whole, _ = served(model, {"prompt_logprobs": 3, "logprobs": 2, "max_new_tokens": 4})
    monkeypatch.setattr(sampling, "SCORED_ROWS", 3)
    sliced, _ = served(model, {"prompt_logprobs": 3, "logprobs": 2, "max_new_tokens": 4})
    for rid in PROMPTS:
        for key in ("prompt_logprobs", "logprobs"):
            for a, b in zip(sliced[rid][key], whole[rid][key], strict=True):
                assert a["token_id"] == b["token_id"] and (a["logprob"] is None) == (b["logprob"] is None)
                assert a["logprob"] is None or a["logprob"] == pytest.approx(b["logprob"], abs=TOL)
                assert [t["token_id"] for t in a["top_logprobs"]] == [t["token_id"] for t in b["top_logprobs"]]
