"""The schema types are the one source of the submit body's validation, the worker's typed params and the
OpenAPI document's schemas (pure: no Redis)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gateway.openapi import document
from shared.config import BUILTIN_MODELS, Settings
from shared.errors import ValidationError
from shared.params import GenerateParams
from shared.states import Priority
from shared.submit import build_request

LLAMA, MINILM = BUILTIN_MODELS["tiny-llama"], BUILTIN_MODELS["minilm"]


def refused(body, spec=LLAMA) -> tuple[str, str]:
    with pytest.raises(ValidationError) as err:
        build_request(body, spec, "t", time.time())
    return err.value.field, err.value.message


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"input": {"prompt": "x"}, "params": {"max_new_tokens": True}}, "params.max_new_tokens", "integer"),
    ({"input": {"prompt": "x"}, "params": {"max_new_tokens": 10_000}}, "params.max_new_tokens", "256"),
    ({"input": {"prompt": "x"}, "params": {"temperature": float("nan")}}, "params.temperature", "at least"),
    ({"input": {"prompt": "x"}, "params": {"stop": ["ok", ""]}}, "params.stop", "item 1"),
    ({"input": {"prompt": "x"}, "params": {"bogus": 1}}, "params.bogus", "unknown field"),
    ({"input": {"prompt": "x"}, "timeout_s": float("inf")}, "timeout_s", "at most"),
    ({"input": {"prompt": "x"}, "timeout_s": 10**400}, "timeout_s", "out of range"),
    ({"input": {"prompt": "x"}, "priority": "urgent"}, "priority", "interactive"),
    ({"input": {"prompt": "x"}, "callback": {"url": "https://example.com/h", "events": ["done"]}},
     "callback.events[0]", "started"),
    ({"input": {"prompt": "x"}, "extra": 1}, "extra", "allowed: callback, deadline"),
    ({"input": {"prompt": "x", "input_ids": [1]}}, "input", "exactly one"),
    ({"params": {}}, "input", "required"),
])
def test_a_bad_body_names_its_field_in_plain_words(body, field, words):
    got_field, message = refused(body)
    assert got_field == field and words in message, message


@pytest.mark.parametrize("deadline", ["1970-01-01T00:16:50Z", "1970-01-01t00:16:50z", "1970-01-01 00:16:50+00:00",
                                      "1970-01-01T01:16:50.000000000+01:00", 1010])
def test_an_rfc_3339_deadline_in_any_of_its_spellings(deadline):
    """RFC 3339 takes a lowercase "t" and "z" and fractions past the microsecond (the part Python keeps)."""
    assert build_request({"input": {"prompt": "x"}, "deadline": deadline}, LLAMA, "t", 1000.0).deadline_ms == 1_010_000


@pytest.mark.parametrize(("deadline", "words"), [("1970-01-01T00:16:50", "time zone"), ("soon", "ISO 8601"),
                                                 ("1970-01-01T00:16:00Z", "past")])
def test_a_deadline_that_is_no_time_or_no_time_ahead_is_refused(deadline, words):
    field, message = refused({"input": {"prompt": "x"}, "deadline": deadline})
    assert field == "deadline" and words in message, message


def test_embed_paths_keep_their_index():
    assert refused({"input": {"texts": ["a", 3]}}, MINILM)[0] == "input.texts[1]"


def test_a_good_body_becomes_the_wire_request():
    req = build_request({"input": {"prompt": "hi"}, "params": {"stop": "\n", "top_k": None}, "priority": "batch",
                         "timeout_s": 5}, LLAMA, "t", 1000.0)
    assert req.params == {"max_new_tokens": LLAMA.default_max_new_tokens, "temperature": 0.0, "top_p": 1.0,
                          "top_k": 0, "seed": None, "stop": ["\n"], "ignore_eos": False}
    assert req.priority is Priority.BATCH and req.deadline_ms == 1_005_000 and req.input == {"prompt": "hi"}
    typed = GenerateParams(**req.params)  # what the worker does with the wire dict
    assert typed.stop == ("\n",) and typed.greedy and typed.max_new_tokens == LLAMA.default_max_new_tokens


def test_openapi_schemas_come_from_the_types():
    doc = json.loads(json.dumps(document(Settings.from_environ({}))))
    schemas = doc["components"]["schemas"]
    params = schemas["GenerateParams"]
    assert params["additionalProperties"] is False
    assert set(params["properties"]) == set(GenerateParams.__struct_fields__)
    assert params["properties"]["max_new_tokens"]["minimum"] == 1
    body = doc["paths"]["/v1/models/{model}/requests"]["post"]["requestBody"]["content"]["application/json"]
    assert {r["$ref"].rsplit("/", 1)[1] for r in body["schema"]["anyOf"]} == {"GenerateSubmit", "EmbedSubmit"}
    for ref in (r for item in json.dumps(doc).split('"$ref": "')[1:] for r in [item.split('"', 1)[0]]):
        assert ref.rsplit("/", 1)[1] in schemas, ref  # every reference resolves


@pytest.mark.spawns
def test_sdk_direct_mode_imports_no_server_code():
    code = ("import sys, shared.sdk.direct; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'gateway', 'gpu_worker', 'starlette', 'uvicorn', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
