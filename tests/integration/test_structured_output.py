"""Structured output on the engine (`params.response_format`): greedy rows equal `generate` with the grammar's mask
as a logits processor, whatever their batch-mates (constrained or not, joining late); what comes out follows its
format by checks that do not use llguidance (jsonschema, `re`); a streamed request run again continues its format
after what was sent; formats a model cannot follow fail alone with `invalid_input`."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import llguidance.hf
import pytest
import torch
from llguidance import LLMatcher
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from gpu_worker.constraints import Grammars
from gpu_worker.job import Job
from gpu_worker.outcomes import Outcome
from shared.messages import InferenceRequest, RequestResult
from shared.structured_output import from_wire, grammar_of
from tests import tiny_runner
from tests.tiny_runner import TOKENIZER, run_alone, runner_for
from tests.torch_device import on_device

NEW = 40
EOS = TOKENIZER.eos_token_id
PROMPTS = {"a": [5, 9, 5, 9, 5, 9, 17], "b": [30, 31, 32], "c": [40, 41, 40, 41, 40, 41, 40, 41, 40, 41, 7],
           "free": [60, 61, 62, 63]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "dark blue"]
FORMATS = {
    "json_schema": {"type": "json_schema", "schema": SCHEMA},
    "json_object": {"type": "json_object"},
    "regex": {"type": "regex", "pattern": REGEX},
    "choice": {"type": "choice", "choices": CHOICES},
    "grammar": {"type": "grammar", "grammar": 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'},
}


def follows(fmt: dict[str, Any], text: str) -> bool:
    """Whether `text` is a whole output of `fmt`, judged without llguidance."""
    kind = fmt["type"]
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        jsonschema.validate(value, fmt.get("schema", {"type": "object"}))
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)", text) is not None


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_runner.tiny_llama(seed=11, eos=EOS)


def request(rid: str, params: dict[str, Any], streamed: list[int] | None = None) -> InferenceRequest:
    return tiny_runner.request(rid, PROMPTS[rid], params, NEW, streamed)


def served(model: LlamaForCausalLM, params: dict[str, dict[str, Any]]) -> dict[str, RequestResult]:
    """Rows a, b and free together, c joining after three steps: each row's result."""
    return tiny_runner.served(model, PROMPTS, params, NEW)


LLG = llguidance.hf.from_tokenizer(TOKENIZER, n_vocab=len(TOKENIZER), eos_token=[EOS])


class Follower:
    """A matcher that catches up with a sequence's generated tokens (the reference's own use of llguidance)."""

    def __init__(self, fmt: dict[str, Any], prompt_len: int) -> None:
        self.matcher = LLMatcher(LLG, grammar_of(from_wire(fmt)), log_level=0)
        self.prompt_len, self.fed = prompt_len, 0

    def catch_up(self, input_ids: torch.Tensor) -> LLMatcher:
        new = input_ids[0, self.prompt_len:].tolist()
        assert self.matcher.consume_tokens(new[self.fed:]), self.matcher.get_error()
        self.fed = len(new)
        return self.matcher


class GrammarMask(LogitsProcessor):
    def __init__(self, fmt: dict[str, Any], prompt_len: int) -> None:
        self.follower = Follower(fmt, prompt_len)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        allowed = torch.tensor(list(self.follower.catch_up(input_ids).compute_logit_bias()), dtype=torch.uint8) > 0
        return scores.masked_fill(~allowed[: scores.shape[-1]].to(scores.device), float("-inf"))


class GrammarDone(StoppingCriteria):
    def __init__(self, fmt: dict[str, Any], prompt_len: int) -> None:
        self.follower = Follower(fmt, prompt_len)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kw: Any) -> torch.BoolTensor:
        return torch.tensor([self.follower.catch_up(input_ids).is_stopped()])


@on_device
def generated(model: LlamaForCausalLM, fmt: dict[str, Any], rid: str) -> list[int]:
    """`generate` on one prompt alone, greedy, the grammar's mask a logits processor, ending at EOS or where the
    grammar takes no more."""
    ids = PROMPTS[rid]
    seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=EOS,
                         logits_processor=LogitsProcessorList([GrammarMask(fmt, len(ids))]),
                         stopping_criteria=StoppingCriteriaList([GrammarDone(fmt, len(ids))]))
    return seq[0, len(ids):].tolist()


def text_of(result: Any) -> str:
    return TOKENIZER.decode(result.output["token_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_greedy_constrained_tokens_equal_generate_with_the_grammars_mask(model, kind):
    fmt = FORMATS[kind]
    other = FORMATS["regex" if kind != "regex" else "choice"]
    results = served(model, {"a": {"response_format": fmt}, "b": {"response_format": other}, "free": {},
                             "c": {"response_format": fmt}})
    for rid, f in (("a", fmt), ("b", other), ("c", fmt)):
        assert results[rid].output["token_ids"] == generated(model, f, rid), rid
        if f["type"] != "json_object":  # bounded formats: complete within NEW tokens (any object's keys may run on)
            assert results[rid].finish_reason in ("stop", "eos"), rid
        if results[rid].finish_reason != "length":
            assert follows(f, text_of(results[rid])), (rid, text_of(results[rid]))
    free = results["free"]
    assert free.finish_reason == "length" and free.output["token_ids"] == served(model, {
        "a": {}, "b": {}, "free": {}, "c": {}})["free"].output["token_ids"]  # batch-mates' grammars leave it alone


def test_any_json_object_ends_as_soon_as_it_is_complete(model):
    """A model that favours a closing brace writes the shortest object; it ends the moment it closes (finish_reason
    stop, no EOS token after it) and parses."""
    params = {"response_format": FORMATS["json_object"], "logit_bias": {str(TOKENIZER.convert_tokens_to_ids("}")): 30}}
    results = served(model, dict.fromkeys(PROMPTS, params))
    for result in results.values():
        assert result.finish_reason == "stop" and len(result.output["token_ids"]) == 2
        assert json.loads(text_of(result)) == {}


def test_sampled_outputs_follow_their_format_every_time(model):
    completed = 0
    for seed in range(6):
        params = {r: {"response_format": FORMATS[kind], "temperature": 1.5, "seed": seed}
                  for r, kind in zip(("a", "b", "free", "c"), ("json_schema", "regex", "choice", "grammar"),
                                     strict=True)}
        results = served(model, params)
        for rid, p in params.items():
            result = results[rid]
            if result.finish_reason == "length":  # a format can run past the tokens asked for: cut, as OpenAI does
                assert len(result.output["token_ids"]) == NEW
                continue
            assert follows(p["response_format"], text_of(result)), (seed, rid, text_of(result))
            completed += 1
    assert completed >= 18  # of 24: the bounded formats end within NEW tokens


@pytest.mark.parametrize("sent", [1, 5])
def test_a_streamed_request_run_again_continues_its_format_after_what_was_sent(model, sent):
    fmt = {"response_format": FORMATS["json_schema"]}
    whole = served(model, {"a": {}, "b": {}, "free": {}, "c": fmt})["c"].output["token_ids"]
    assert len(whole) > sent
    assert run_alone(runner_for(model), request("c", fmt, streamed=whole[:sent])).output["token_ids"] == whole


def test_ignore_eos_still_ends_where_the_format_is_complete(model):
    result = served(model, {r: {"response_format": FORMATS["choice"], "ignore_eos": True} for r in PROMPTS})
    for rid in ("a", "b", "c"):
        assert result[rid].finish_reason == "stop" and text_of(result[rid]) in CHOICES


def test_a_tokenizer_llguidance_cannot_read_fails_the_request_alone(model):
    runner = runner_for(model)
    runner.grammars = Grammars(object(), 100, [2])  # a slow (Python) tokenizer stands in
    out = runner.prepare(request("a", {"response_format": FORMATS["json_object"]}), time.time())
    assert isinstance(out, Outcome) and out.result.error is not None
    assert out.result.error.code == "invalid_input" and "fast" in out.result.error.message
    assert isinstance(runner.prepare(request("b", {}), time.time()), Job)  # the rest are served


def test_a_fast_tokenizer_llguidance_refuses_at_warm_up_leaves_the_model_served_without_formats(model):
    """llguidance refusing a fast tokenizer (a WordPiece decoder, an EOS past the vocabulary: here the latter)
    ended the worker at start in a traceback; now the model is served, and a format is refused with the reason."""
    runner = runner_for(model)
    runner.grammars = Grammars(TOKENIZER, len(TOKENIZER), [len(TOKENIZER) + 7])
    runner.grammars.warm()
    assert runner.grammars.unusable and "out of range" in runner.grammars.unusable
    out = runner.prepare(request("a", {"response_format": FORMATS["json_object"]}), time.time())
    assert isinstance(out, Outcome) and out.result.error is not None and out.result.error.code == "invalid_input"
    assert out.result.error.message.startswith("response_format: this model's tokenizer cannot drive structured "
                                               "output: "), out.result.error.message
    assert isinstance(runner.prepare(request("b", {}), time.time()), Job)  # the rest are served


def test_a_grammar_llguidance_gives_up_on_fails_its_request_not_as_an_answer(model):
    """A pattern past llguidance's lexer limits passes the gateway's check (no tokenizer there) and fails at its
    first mask: the request fails with llguidance's reason, its batch-mates are unharmed."""
    params = {"a": {"response_format": {"type": "regex", "pattern": "a{1000}{1000}"}}, "b": {}, "free": {}, "c": {}}
    results = served(model, params)
    failed = results["a"]
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "invalid_input"
    assert "too many expressions" in failed.error.message
    plain = served(model, {r: {} for r in PROMPTS})
    assert all(results[r].output["token_ids"] == plain[r].output["token_ids"] for r in ("b", "free", "c"))


def test_ids_beyond_the_tokenizer_are_never_allowed(model):
    """A model whose embedding is padded past its tokenizer's vocabulary: those logits are masked too."""
    compiled = Grammars(TOKENIZER, len(TOKENIZER) + 64, [EOS]).compile(from_wire(FORMATS["json_object"]))
    assert not isinstance(compiled, str)
    row = torch.zeros(len(TOKENIZER) + 64)
    Grammars.start(compiled, ()).mask(row)
    assert torch.isinf(row[len(TOKENIZER):]).all() and (row == 0).sum() == 1  # "{" alone opens an object


def test_a_format_the_gateway_could_not_check_fails_with_invalid_input(model):
    """A gateway without llguidance (the Lambda package) leaves the check to the worker."""
    runner = runner_for(model)
    out = runner.prepare(request("a", {"response_format": {"type": "regex", "pattern": "[a-"}}), time.time())
    assert isinstance(out, Outcome) and out.result.error is not None
    assert out.result.error.code == "invalid_input" and "response_format" in out.result.error.message
