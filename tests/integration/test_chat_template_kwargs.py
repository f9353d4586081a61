"""`chat_template_kwargs` (vLLM's): variables a chat template is rendered with besides the conversation, e.g.
Qwen3's `enable_thinking`. The gateway counts the conversation with them as the worker renders it, the worker
renders it with them, the OpenAI route passes them through; names the rendering sets itself are refused."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.job import Job
from gpu_worker.models import LoadedModel, build_bpe_tokenizer
from shared import openai_shapes as oa
from shared.config import ModelSpec
from shared.errors import ValidationError
from shared.messages import InferenceRequest
from shared.states import Priority, Task
from shared.submit import build_request
from shared.token_limits import TokenLimits

# Qwen3's switch, reduced: thinking unless the caller turns it off
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>"
                     "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                     "{% endif %}{% endif %}{{ greeting | default('') }}")
CONVO = [{"role": "user", "content": "What is two plus two?"}]


def templated_dir(directory, template: str):
    """A model directory of the built-in tokenizer with `template` as its chat template, and a config (the gateway
    counts with these files)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=build_bpe_tokenizer(), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = template
    tok.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(tok),
                                                       "max_position_embeddings": 256}))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return templated_dir(tmp_path_factory.mktemp("thinking"), THINKING_TEMPLATE)


def spec_of(directory, name: str = "thinking") -> ModelSpec:
    return ModelSpec(name=name, task=Task.GENERATE, source=str(directory), device="cpu", dtype="float32",
                     max_input_tokens=200, max_new_tokens=16).validate()


def runner_of(spec: ModelSpec, tok: PreTrainedTokenizerFast) -> GenerateRunner:
    """A worker's runner for the template's model: a one-layer Llama of its vocabulary, seeded."""
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    loaded = LoadedModel(spec=spec, path=None, model=LlamaForCausalLM(cfg).eval(), tokenizer=tok,
                         device=torch.device("cpu"), dtype=torch.float32)
    return GenerateRunner(loaded, "w", max_rows=2, max_seq_len=256)


def submit(kwargs: dict | None, spec: ModelSpec, limits: TokenLimits) -> InferenceRequest:
    inp = {"messages": CONVO, **({"chat_template_kwargs": kwargs} if kwargs is not None else {})}
    return build_request({"input": inp, "params": {"max_new_tokens": 4}}, spec, "t", time.time(), limits=limits)


def test_the_gateway_counts_and_the_worker_renders_with_the_requests_variables(model_dir):
    spec = spec_of(model_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    limits = TokenLimits()
    runner = runner_of(spec, tok)
    for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False},
                   {"enable_thinking": False, "greeting": "Sure! Here goes a longer greeting."}):
        expected = tok.apply_chat_template(CONVO, add_generation_prompt=True, return_dict=False, **(kwargs or {}))
        assert limits.count_chat(spec, CONVO, None, kwargs) == len(expected), kwargs
        req = submit(kwargs, spec, limits)
        assert req.input.get("chat_template_kwargs") == kwargs
        job = runner.prepare(req, time.time())
        assert isinstance(job, Job) and list(job.inputs[0]) == expected, kwargs
    off = tok.apply_chat_template(CONVO, add_generation_prompt=True, return_dict=False, enable_thinking=False)
    on = tok.apply_chat_template(CONVO, add_generation_prompt=True, return_dict=False)
    assert len(off) > len(on)  # the variable changes the prompt: the checks above can fail


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"add_generation_prompt": False}, "set by the rendering itself"),
    ({"messages": []}, "set by the rendering itself"),
    ({"bos_token": "x"}, "set by the rendering itself"),
    ({"raise_exception": 1}, "set by the rendering itself"),
    ({"self": 1}, "set by the rendering itself"),
    ({"conversations": 1}, "set by the rendering itself"),
    ({"sanitize_control_tokens": True}, "set by the rendering itself"),
    ({"messages\n": 1}, "is not a template variable name"),
    ({"_private": 1}, "is not a template variable name"),
    ({"has space": 1}, "is not a template variable name"),
])
def test_a_name_the_rendering_sets_itself_is_refused(model_dir, kwargs, says):
    with pytest.raises(ValidationError) as err:
        submit(kwargs, spec_of(model_dir), TokenLimits())
    assert err.value.field == "input.chat_template_kwargs" and says in err.value.message


def test_only_with_messages(model_dir):
    body = {"input": {"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}}
    with pytest.raises(ValidationError) as err:
        build_request(body, spec_of(model_dir), "t", time.time())
    assert err.value.field == "input.chat_template_kwargs"


def test_the_openai_route_passes_them_through():
    tr = oa.translate_chat({"model": "m", "messages": CONVO, "chat_template_kwargs": {"enable_thinking": False}})
    assert tr.body["input"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert tr.aliases["input.chat_template_kwargs"] == "chat_template_kwargs"
    assert "chat_template_kwargs" not in oa.translate_chat({"model": "m", "messages": CONVO}).body["input"]


def test_the_worker_checks_the_names_again(model_dir):
    """A stream entry another producer wrote, with a name the rendering sets: `prepare` refuses it, which the model
    loop answers as the request's `invalid_input` (`ModelLoop._add`), the worker going on."""
    spec = spec_of(model_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    runner = runner_of(spec, tok)
    now = int(time.time() * 1000)
    req = InferenceRequest(id="r", tenant="t", model="thinking", task=Task.GENERATE,
                           input={"messages": CONVO, "chat_template_kwargs": {"tokenize": False}},
                           params={"max_new_tokens": 4}, lane="short", priority=Priority.INTERACTIVE,
                           created_ms=now, deadline_ms=now + 60_000, est_tokens=20)
    with pytest.raises(ValidationError):
        runner.prepare(req, time.time())


def test_every_argument_of_transformers_rendering_is_reserved():
    """A request's variable named as an argument of `apply_chat_template` or of the jinja rendering under it would
    change the tokens (or fail the worker) instead of reaching the template: each is refused. Fails when a
    transformers release adds one."""
    import inspect

    from transformers.utils.chat_template_utils import render_jinja_template

    from shared.params import RESERVED_TEMPLATE_NAMES

    arguments = set(inspect.signature(PreTrainedTokenizerFast.apply_chat_template).parameters) | set(
        inspect.signature(render_jinja_template).parameters)
    assert arguments <= RESERVED_TEMPLATE_NAMES, arguments - RESERVED_TEMPLATE_NAMES


def test_null_is_none(model_dir):
    req = build_request({"input": {"messages": CONVO, "chat_template_kwargs": None}}, spec_of(model_dir), "t",
                        time.time())
    assert "chat_template_kwargs" not in req.input
