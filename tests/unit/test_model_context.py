"""A generation model's context: the longest sequence it computes exactly as `generate` does, read from its
config, and a request held within it at submit (pure)."""

from __future__ import annotations

import pytest

from shared.errors import ValidationError
from shared.model_context import context_message, exact_context
from shared.params import GenerateParams
from shared.submit import within_context


@pytest.mark.parametrize("config, context", [
    ({"max_position_embeddings": 2048}, 2048),
    ({"n_positions": 1024, "model_type": "gpt2"}, 1024),  # GPT-2's config.json names it so
    ({}, None),  # ALiBi models declare none
    ({"max_position_embeddings": None}, None),
    ({"max_position_embeddings": True}, None),
    # dynamic NTK rescales past the context itself: the context is the limit
    ({"max_position_embeddings": 32, "rope_parameters": {"rope_type": "dynamic", "factor": 8.0}}, 32),
    # longrope switches every row of a forward to its long factors once one passes the original context
    ({"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "longrope",
                                                             "original_max_position_embeddings": 4096}}, 4096),
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "longrope"}}, 4096),
    ({"max_position_embeddings": 8192, "rope_parameters": {
        "full_attention": {"rope_type": "longrope", "original_max_position_embeddings": 2048},
        "sliding_attention": {"rope_type": "default"}}}, 2048),
    # frequencies fixed whatever the sequence: the context
    ({"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 2048}}, 8192),
    ({"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "linear", "factor": 4.0}}, 8192),
    # a multimodal model's text part
    ({"text_config": {"max_position_embeddings": 4096}, "vision_config": {"max_position_embeddings": 10}}, 4096),
])
def test_the_context_comes_from_the_config(config, context):
    assert exact_context(config) == context


P = GenerateParams(max_new_tokens=64)


@pytest.mark.parametrize("params, given, prompt, context, expected", [
    (P, True, 100, 164, 64),  # fits exactly
    (P, True, 100, None, 64),  # no context known: the worker checks
    (P, True, None, 100, 64),  # the prompt not countable here: the worker checks
    (P, False, 100, 130, 30),  # a default shrinks to what fits, as vLLM and OpenAI do
    (P, False, 129, 130, 1),
])
def test_a_request_within_the_context_keeps_or_shrinks_its_new_tokens(params, given, prompt, context, expected):
    assert within_context(params, given, prompt, "input.prompt", context).max_new_tokens == expected


@pytest.mark.parametrize("given, prompt, field", [
    (True, 100, "params.max_new_tokens"),  # the caller asked for more than fits: refused, not cut
    (True, 130, "input.prompt"),  # the prompt alone fills the context
    (False, 130, "input.prompt"),
    (False, 131, "input.prompt"),
])
def test_a_request_past_the_context_is_refused_naming_what_to_change(given, prompt, field):
    with pytest.raises(ValidationError) as err:
        within_context(P, given, prompt, "input.prompt", 130)
    assert err.value.field == field and "context of 130 tokens" in err.value.message


def test_the_message_says_what_fits():
    assert "at most 30 new tokens fit" in context_message(130, 100, 64)
    assert "the prompt alone fills it" in context_message(130, 130, 1)


def test_a_default_shrinks_down_to_min_tokens_and_no_further():
    """A default `max_new_tokens` shrinks to what fits, but not below the request's min_tokens: that is refused
    naming min_tokens, the field that asks for more than fits."""
    wants = GenerateParams(max_new_tokens=64, min_tokens=20)
    assert within_context(wants, False, 100, "input.prompt", 130).max_new_tokens == 30
    assert within_context(wants, False, 110, "input.prompt", 130).max_new_tokens == 20
    with pytest.raises(ValidationError) as err:
        within_context(wants, False, 111, "input.prompt", 130)
    assert err.value.field == "params.min_tokens" and err.value.code == "context_length_exceeded"
    assert "min_tokens (20)" in err.value.message and "at most 19 new tokens fit" in err.value.message
    with pytest.raises(ValidationError) as err:
        within_context(wants, True, 111, "input.prompt", 130)  # given: max_new_tokens is what to change
    assert err.value.field == "params.max_new_tokens"
