import json

import pytest

from shared.errors import ValidationError
from shared.params import EmbedParams, GenerateParams, parse_embed_input, parse_generate_input


def gen(raw):
    return GenerateParams.parse(raw, limit=256, default_max_new_tokens=64)


def test_generate_defaults():
    p = gen(None)
    assert p.max_new_tokens == 64 and p.greedy and p.stop == () and not p.ignore_eos


def test_generate_full():
    p = gen({"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": "\n",
             "ignore_eos": True})
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        8, 0.7, 0.9, 5, 3, ("\n",), True)
    assert p.to_dict()["stop"] == ["\n"]


@pytest.mark.parametrize(("raw", "field"), [
    ({"max_new_tokens": 0}, "params.max_new_tokens"),
    ({"max_new_tokens": 257}, "params.max_new_tokens"),
    ({"max_new_tokens": "8"}, "params.max_new_tokens"),
    ({"max_new_tokens": True}, "params.max_new_tokens"),
    ({"max_new_tokens": 8.5}, "params.max_new_tokens"),
    ({"temperature": -1}, "params.temperature"),
    ({"temperature": float("nan")}, "params.temperature"),
    ({"top_p": 0}, "params.top_p"),
    ({"seed": -1}, "params.seed"),
    ({"stop": [""]}, "params.stop"),
    ({"stop": ["a"] * 5}, "params.stop"),
    ({"stop": 3}, "params.stop"),
    ({"ignore_eos": "yes"}, "params.ignore_eos"),
    ({"presence_penalty": 2.5}, "params.presence_penalty"),
    ({"presence_penalty": float("inf")}, "params.presence_penalty"),
    ({"frequency_penalty": -2.01}, "params.frequency_penalty"),
    ({"frequency_penalty": "1"}, "params.frequency_penalty"),
    ({"repetition_penalty": 0}, "params.repetition_penalty"),
    ({"repetition_penalty": -1.2}, "params.repetition_penalty"),
    ({"repetition_penalty": 11}, "params.repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "params.logit_bias"),
    ({"logit_bias": {"-3": 1}}, "params.logit_bias"),
    ({"logit_bias": {"3": 100.5}}, "params.logit_bias"),
    ({"logit_bias": {"3": "1"}}, "params.logit_bias"),
    ({"logit_bias": [[3, 1]]}, "params.logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "params.logit_bias"),
    ({"bogus": 1}, "params.bogus"),
    ([1, 2], "params"),
    ({"min_tokens": -1}, "params.min_tokens"),
    ({"min_tokens": 1.5}, "params.min_tokens"),
    ({"min_tokens": 9, "max_new_tokens": 8}, "params.min_tokens"),
    ({"min_tokens": 257}, "params.min_tokens"),  # past the model's limit, with a default max_new_tokens
    ({"allowed_token_ids": []}, "params.allowed_token_ids"),  # vLLM refuses an empty list too
    ({"allowed_token_ids": [1, -2]}, "params.allowed_token_ids"),
    ({"allowed_token_ids": "1"}, "params.allowed_token_ids"),
    ({"bad_words": "word"}, "params.bad_words"),
    ({"bad_words": [""]}, "params.bad_words"),
    ({"bad_words": ["x" * 257]}, "params.bad_words"),
    ({"bad_words": ["w"] * 129}, "params.bad_words"),
])
def test_generate_rejects(raw, field):
    with pytest.raises(ValidationError) as err:
        gen(raw)
    assert err.value.field == field


def test_penalties_are_on_the_wire_only_where_set():
    """A request that sets no penalty has the wire form of the release before them, which its workers read."""
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"} & set(gen({}).to_dict())
    p = gen({"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1.0})
    assert p.to_dict() == {**gen({}).to_dict(), "presence_penalty": -2, "frequency_penalty": 2.0,
                                "repetition_penalty": 1.0}  # 1.0 is said: off, overriding the model's own
    assert GenerateParams(**p.to_dict()) == p  # what the worker builds from the wire dict
    assert gen({"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}).to_dict() == gen({}).to_dict()


def test_logit_bias_keys_are_token_ids_whether_the_json_spells_them_as_strings_or_not():
    p = gen({"logit_bias": {"42": -100, "7": 2.5}})
    assert p.logit_bias == {42: -100.0, 7: 2.5}
    wire = json.loads(json.dumps(p.to_dict()))  # a JSON hop turns the keys back into strings
    assert GenerateParams(**wire).logit_bias == {42: -100.0, 7: 2.5}


@pytest.mark.parametrize(("bias", "message"), [
    ({"x": 1}, "every key must be an integer"),
    ({"-3": 1}, "every key must be at least 0"),
    ({"3": 101}, "every value must be at most 100.0"),
    ({"3": "1"}, "every value must be a number"),
])
def test_a_bad_logit_bias_is_explained_at_the_field(bias, message):
    with pytest.raises(ValidationError) as err:
        gen({"logit_bias": bias})
    assert err.value.field == "params.logit_bias" and err.value.message.startswith(message), err.value.message


def test_embed_params():
    assert EmbedParams.parse(None).normalize is True
    assert EmbedParams.parse({"normalize": False}).normalize is False
    with pytest.raises(ValidationError):
        EmbedParams.parse({"normalize": 1})


def test_generate_input():
    kw = dict(max_prompt_chars=100, max_input_tokens=4)
    assert parse_generate_input({"prompt": "hi"}, **kw) == {"prompt": "hi"}
    assert parse_generate_input({"input_ids": [1, 2]}, **kw) == {"input_ids": [1, 2]}
    for bad in ({}, {"prompt": ""}, {"prompt": 3}, {"prompt": "x" * 101}, {"prompt": "a", "input_ids": [1]},
                {"input_ids": []}, {"input_ids": [1] * 5}, {"input_ids": [-1]}, {"input_ids": [True]},
                {"input_ids": "12"}, "text", None, {"other": 1}):
        with pytest.raises(ValidationError):
            parse_generate_input(bad, **kw)
    # past the model's prompt, however it is measured, is the context error (OpenAI's code)
    for long in ({"prompt": "x" * 101}, {"input_ids": [1] * 5},
                 {"messages": [{"role": "user", "content": "x" * 60}, {"role": "user", "content": "y" * 60}]}):
        with pytest.raises(ValidationError) as err:
            parse_generate_input(long, **kw)
        assert err.value.code == "context_length_exceeded", long
    with pytest.raises(ValidationError) as err:
        parse_embed_input({"text": "x" * 11}, max_texts=2, max_text_chars=10)
    assert err.value.code == "context_length_exceeded" and "truncate_prompt_tokens" in err.value.message


def test_embed_input():
    kw = dict(max_texts=2, max_text_chars=10)
    assert parse_embed_input({"text": "a"}, **kw) == {"texts": ["a"]}
    assert parse_embed_input({"texts": ["a", "b"]}, **kw) == {"texts": ["a", "b"]}
    for bad in ({}, {"texts": []}, {"texts": ["a", "b", "c"]}, {"texts": [1]}, {"texts": [""]},
                {"texts": "a"}, {"text": "x" * 11}, {"text": "a", "texts": ["a"]}, [], None):
        with pytest.raises(ValidationError):
            parse_embed_input(bad, **kw)


def test_min_tokens_is_at_most_the_new_tokens_and_a_default_grows_to_it():
    assert gen({"min_tokens": 8, "max_new_tokens": 8}).min_tokens == 8
    grown = gen({"min_tokens": 100})  # the model's default (64) grows to it
    assert (grown.max_new_tokens, grown.min_tokens) == (100, 100)
    assert gen({"min_tokens": 10}).max_new_tokens == 64
    assert "min_tokens" not in gen({"min_tokens": 0}).to_dict()  # off: the wire of the release before it
    assert gen({"min_tokens": 10}).to_dict()["min_tokens"] == 10
    assert GenerateParams(**gen({"min_tokens": 10}).to_dict()).min_tokens == 10
    with pytest.raises(ValidationError) as err:
        gen({"min_tokens": 9, "max_new_tokens": 8})
    assert err.value.message == "must be at most the new tokens asked for (8), got 9"
    with pytest.raises(ValidationError) as err:
        gen({"min_tokens": 300})
    assert err.value.message == "must be at most this model's limit of 256 new tokens, got 300"


def test_allowed_token_ids_and_bad_words_are_on_the_wire_only_where_set():
    assert not {"allowed_token_ids", "bad_words"} & set(gen({"bad_words": []}).to_dict())
    p = gen({"allowed_token_ids": [5, 3], "bad_words": ["no", " way"]})
    wire = json.loads(json.dumps(p.to_dict()))
    assert wire["allowed_token_ids"] == [5, 3] and wire["bad_words"] == ["no", " way"]
    back = GenerateParams(**wire)  # what the worker builds from the wire dict
    assert back == p and back.allowed_token_ids == (5, 3) and back.bad_words == ("no", " way")
    assert p.outside_vocabulary(5) == ("allowed_token_ids", 5) and p.outside_vocabulary(6) is None
    assert gen({"bad_words": ["yes"], "response_format": {"type": "json_object"}}).bad_words == ("yes",)
    assert gen({"allowed_token_ids": [1], "response_format": {"type": "json_object"}}).allowed_token_ids == (1,)
