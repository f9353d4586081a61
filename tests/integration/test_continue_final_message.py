"""vLLM's `add_generation_prompt` and `continue_final_message`: a conversation rendered without the assistant's
opening, or ending inside its last message for the model to go on with (an answer begun for it). The gateway
counts it as the worker renders it, which is as transformers' `apply_chat_template` renders it; the OpenAI route
passes both through; what cannot be rendered so is refused at submit."""

from __future__ import annotations

import time

import pytest
from transformers import PreTrainedTokenizerFast

from gpu_worker.job import Job
from shared import openai_shapes as oa
from shared.errors import ValidationError
from shared.submit import build_request
from shared.token_limits import TokenLimits
from tests.integration.test_chat_template_kwargs import model_dir, runner_of, spec_of  # noqa: F401 (a fixture)

BEGUN = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is"}]


def submit(spec, inp: dict) -> object:
    return build_request({"input": inp, "params": {"max_new_tokens": 4}}, spec, "t", time.time(),
                         limits=TokenLimits())


def test_the_gateway_counts_and_the_worker_renders_as_transformers_does(model_dir):  # noqa: F811
    spec = spec_of(model_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    runner = runner_of(spec, tok)
    limits = TokenLimits()
    cases = [({}, dict(add_generation_prompt=True)),
             ({"add_generation_prompt": False}, dict(add_generation_prompt=False)),
             ({"add_generation_prompt": False, "continue_final_message": True},
              dict(add_generation_prompt=False, continue_final_message=True))]
    rendered = []
    for options, theirs in cases:
        expected = tok.apply_chat_template(BEGUN, return_dict=False, **theirs)
        rendered.append(tok.decode(expected))
        assert limits.count_chat(spec, BEGUN, **options) == len(expected), options
        req = submit(spec, {"messages": BEGUN, **options})
        assert {k: v for k, v in req.input.items() if k != "messages"} == options  # on the wire where not default
        job = runner.prepare(req, time.time())
        assert isinstance(job, Job) and list(job.inputs[0]) == expected, options
    assert len(set(rendered)) == 3 and rendered[2].rstrip().endswith("It is")  # three renderings: the checks bite
    assert "<|assistant|>It is" in rendered[2] and not rendered[2].endswith("<|assistant|>")


@pytest.mark.parametrize(("inp", "field"), [
    ({"messages": BEGUN, "continue_final_message": True}, "input.continue_final_message"),  # with the opening
    ({"prompt": "hi", "add_generation_prompt": False}, "input.add_generation_prompt"),
    ({"prompt": "hi", "continue_final_message": True}, "input.continue_final_message"),
    ({"messages": BEGUN, "continue_final_message": "yes"}, "input.continue_final_message"),
])
def test_what_cannot_be_rendered_so_is_refused_naming_its_field(model_dir, inp, field):  # noqa: F811
    with pytest.raises(ValidationError) as err:
        submit(spec_of(model_dir), inp)
    assert err.value.field == field


def test_the_openai_route_passes_them_through():
    tr = oa.translate_chat({"model": "m", "messages": BEGUN, "add_generation_prompt": False,
                            "continue_final_message": True})
    assert (tr.body["input"]["add_generation_prompt"], tr.body["input"]["continue_final_message"]) == (False, True)
    assert tr.aliases["input.continue_final_message"] == "continue_final_message"
    plain = oa.translate_chat({"model": "m", "messages": BEGUN}).body["input"]
    assert "add_generation_prompt" not in plain and "continue_final_message" not in plain
