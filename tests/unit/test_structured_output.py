"""Structured output's request side: the native `params.response_format`, its checks at submit, and the OpenAI and
vLLM spellings that map onto it (the engine side: tests/integration/test_structured_output.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llguidance import LLMatcher

from shared import openai_shapes as oa
from shared import structured_output as so
from shared.config import BUILTIN_MODELS
from shared.errors import ValidationError
from shared.params import GenerateParams
from shared.submit import build_request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
FORMATS = [
    {"type": "json_object"},
    {"type": "json_schema", "schema": SCHEMA},
    {"type": "regex", "pattern": "[0-9]{3}-[a-z]{2}"},
    {"type": "choice", "choices": ["yes", "no", 'say "maybe"']},
    {"type": "grammar", "grammar": 'start: "a" ("," "a")*'},  # Lark
    {"type": "grammar", "grammar": 'root ::= "x" | "y" "z"'},  # GBNF
]


def parse(params: dict[str, Any]) -> GenerateParams:
    return GenerateParams.parse(params, limit=100, default_max_new_tokens=10)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f["type"] + ("-gbnf" if "::=" in str(f) else ""))
def test_each_format_is_checked_and_crosses_the_wire_whole(fmt):
    params = parse({"response_format": fmt})
    wire = json.loads(json.dumps(params.to_dict()))  # what the gateway queues and the worker reads
    assert wire["response_format"] == fmt
    assert GenerateParams(**wire) == params
    assert isinstance(so.checked(params.response_format), str)


def test_no_format_is_left_off_the_wire():
    assert "response_format" not in parse({}).to_dict()
    assert parse({}).response_format is None


@pytest.mark.parametrize(("fmt", "field", "words"), [
    ({"type": "regex", "pattern": "[a-"}, "params.response_format", "unclosed character class"),
    ({"type": "json_schema", "schema": {"type": "objectx"}}, "params.response_format", "objectx"),
    ({"type": "json_schema", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "params.response_format",
     "cannot be compiled"),
    ({"type": "grammar", "grammar": "start: foo"}, "params.response_format", "foo"),
    ({"type": "grammar", "grammar": "root ::= missing"}, "params.response_format", "missing"),
    ({"type": "json_schema"}, "params.response_format.schema", "required"),
    ({"type": "choice", "choices": []}, "params.response_format.choices", "empty"),
    ({"type": "choice", "choices": ["a", ""]}, "params.response_format.choices[1]", ""),
    ({"type": "regex", "pattern": ""}, "params.response_format.pattern", ""),
    ({"type": "text"}, "params.response_format.type", "text"),
    ({"type": "json_object", "schema": {}}, "params.response_format.schema", ""),
    ({"pattern": "a"}, "params.response_format.type", ""),
    ("json", "params.response_format", "object"),
    ({"type": "regex", "pattern": "a" * (so.MAX_GRAMMAR_CHARS + 1)}, "params.response_format.pattern", ""),
    ({"type": "json_schema", "schema": {"enum": ["a" * 1000] * 70}}, "params.response_format", "65536"),
])
def test_a_format_that_cannot_constrain_is_refused_at_submit_naming_its_field(fmt, field, words):
    with pytest.raises(ValidationError) as err:
        parse({"response_format": fmt})
    assert err.value.field == field
    assert words in err.value.message
    assert "\n" not in err.value.message  # llguidance's multi-line errors come out as one line


def test_a_native_submit_is_refused_before_it_is_queued():
    body = {"input": {"prompt": "x"}, "params": {"response_format": {"type": "regex", "pattern": "(a"}}}
    with pytest.raises(ValidationError) as err:
        build_request(body, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)
    assert err.value.field == "params.response_format" and "cannot be compiled" in err.value.message
    body["params"]["response_format"]["pattern"] = "(a)"
    req = build_request(body, BUILTIN_MODELS["tiny-llama"], "t", 1_000.0)
    assert req.params["response_format"] == {"type": "regex", "pattern": "(a)"}


def test_without_llguidance_the_gateway_leaves_the_check_to_the_worker(monkeypatch):
    """The Lambda package has no llguidance (no wheel for the Lambda's glibc): a format passes its type checks and
    the worker compiles it."""
    import builtins

    real = builtins.__import__

    def no_llguidance(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    assert so.checked(so.Regex("(a")) is None
    with pytest.raises(ValidationError):  # the size bound holds without it
        so.checked(so.Regex("a" * (so.MAX_GRAMMAR_CHARS + 1)))


def test_json_comes_out_in_one_style_without_free_whitespace():
    """The JSON grammar takes `json.dumps`' separators and nothing else between tokens (free whitespace is where a
    model can loop forever); a schema's own x-guidance options override the style."""
    styled = so.grammar_of(so.JsonObject())
    tok = bytes_tokenizer()
    for text, ok in [('{"a": 1, "b": [2, 3]}', True), ('{"a":1}', False), ('{ "a": 1}', False),
                     ('{"a": 1}\n', False)]:
        assert accepts(tok, styled, text) is ok, text
    own = {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"}
    flexible = so.grammar_of(so.JsonSchema({"type": "object", "x-guidance": own}))
    assert accepts(tok, flexible, '{ "a" :1 }') and accepts(tok, flexible, '{"a":1,"b":2}')


def bytes_tokenizer() -> Any:
    """llguidance's own byte tokenizer: one token per byte (no model needed)."""
    from llguidance import LLTokenizer

    return LLTokenizer("byte")


def accepts(tok: Any, grammar: str, text: str) -> bool:
    m = LLMatcher(tok, grammar, log_level=0)
    ids = tok.tokenize_str(text)
    return m.consume_tokens(ids) and m.is_accepting()


# --------------------------------------------------------------------------------------- OpenAI and vLLM


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], **kw}


def native(tr: oa.Translated) -> Any:
    return tr.body["params"].get("response_format")


@pytest.mark.parametrize(("given", "expected"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     {"type": "json_schema", "schema": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, {"type": "json_object"}),
    ({"guided_json": SCHEMA}, {"type": "json_schema", "schema": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"type": "json_schema", "schema": SCHEMA}),
    ({"guided_regex": "[a-z]+"}, {"type": "regex", "pattern": "[a-z]+"}),
    ({"guided_choice": ["a", "b"]}, {"type": "choice", "choices": ["a", "b"]}),
    ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"},
     {"type": "grammar", "grammar": 'root ::= "a"'}),
    ({"structured_outputs": {"json": SCHEMA}}, {"type": "json_schema", "schema": SCHEMA}),
    ({"structured_outputs": {"regex": "a+", "json_object": False}}, {"type": "regex", "pattern": "a+"}),
    ({"structured_outputs": {"json_object": True}}, {"type": "json_object"}),
    ({"structured_outputs": {"choice": ["x"]}}, {"type": "choice", "choices": ["x"]}),
])
def test_openai_and_vllm_formats_map_onto_the_native_one(given, expected):
    assert native(oa.translate_chat(chat(**given))) == expected
    completion = oa.translate_completion({"model": "tiny-llama", "prompt": "x", **given})  # vLLM takes them here too
    assert native(completion) == expected
    if expected is not None:
        parse(completion.body["params"])  # and the native checks pass them


def refused(**given: Any) -> oa.OpenAIError:
    with pytest.raises(oa.OpenAIError) as err:
        oa.translate_chat(chat(**given))
    assert err.value.status == 400
    return err.value


def test_formats_openai_does_not_take_are_refused_naming_the_parameter():
    assert refused(response_format={"type": "json_schema"}).param == "response_format.json_schema"
    assert refused(response_format={"type": "xml"}).param == "response_format.type"
    assert refused(guided_json="{not json").param == "guided_json"
    assert refused(guided_json=[1]).param == "guided_json"
    assert refused(guided_choice=["a", 1]).param == "guided_choice[1]"
    assert refused(guided_regex=5).param == "guided_regex"
    assert refused(structured_outputs={}).param == "structured_outputs"
    assert refused(structured_outputs={"regex": "a", "choice": ["b"]}).param == "structured_outputs"
    assert refused(structured_outputs={"structural_tag": "x"}).param == "structured_outputs.structural_tag"
    assert refused(guided_whitespace_pattern=" ").param == "guided_whitespace_pattern"
    err = refused(response_format={"type": "json_object"}, guided_regex="a")
    assert err.param == "guided_regex" and "response_format" in err.message


@pytest.mark.parametrize(("given", "param"), [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "response_format"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
])
def test_a_format_the_native_checks_refuse_is_named_as_the_caller_spelled_it(given, param):
    tr = oa.translate_chat(chat(**given))
    with pytest.raises(ValidationError) as err:
        parse(tr.body["params"])
    field = err.value.field
    name, message = oa.in_openai_terms(field, f"{field}: {err.value.message}", tr.aliases)
    assert name == param and message.startswith(param + ":") and "cannot be compiled" in message
