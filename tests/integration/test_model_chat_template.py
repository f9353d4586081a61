"""A model file's `chat_template` (vLLM's --chat-template): a base model without a template of its own, or one whose
template a deployment replaces, renders conversations with the given one. Inline or from a file; the gateway counts
with it as the worker renders with it; a file that cannot be read or a template that does not compile is refused at
load, naming the model."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.job import Job
from gpu_worker.models import build_bpe_tokenizer, load
from shared import openai_shapes as oa
from shared.config import ModelSpec, load_models
from shared.errors import ConfigError, ValidationError
from shared.params import MAX_TEMPLATE_CHARS
from shared.states import Task
from shared.submit import build_request
from shared.token_limits import TokenLimits

TEMPLATE = ("{% for m in messages %}### {{ m.role | upper }}:\n{{ m.content }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}### ASSISTANT:\n{% endif %}")
OWN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
CONVO = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of Peru?"}]


def model_dir(tmp_path, own_template: str | None):
    """A one-layer Llama of the built-in tokenizer, with `own_template` as its tokenizer's (None: none, a base
    model's)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=build_bpe_tokenizer(), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>")
    if own_template is not None:
        tok.chat_template = own_template
    tok.save_pretrained(tmp_path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
                     ).save_pretrained(tmp_path)
    return tmp_path


def spec_of(directory, chat_template: str = "") -> ModelSpec:
    return ModelSpec(name="base", task=Task.GENERATE, source=str(directory), device="cpu", dtype="float32",
                     max_input_tokens=200, max_new_tokens=16, chat_template=chat_template).validate()


def prepared(spec: ModelSpec) -> tuple[list[int], int | None]:
    """The worker's prompt for CONVO under `spec` (loaded as a worker loads it), and the gateway's count of it."""
    loaded = load(spec, "")
    runner = GenerateRunner(loaded, "w", max_rows=2, max_seq_len=256)
    limits = TokenLimits()
    req = build_request({"input": {"messages": CONVO}, "params": {"max_new_tokens": 4}}, spec, "t", time.time(),
                        limits=limits)
    job = runner.prepare(req, time.time())
    assert isinstance(job, Job), job
    return list(job.inputs[0]), limits.count_chat(spec, CONVO)


@pytest.mark.parametrize("own", [None, OWN])
@pytest.mark.parametrize("given", ["inline", "file"])
def test_the_model_files_template_renders_and_counts_the_conversation(tmp_path, own, given):
    """A base model (no template) or a model with its own: the model file's template is the one rendered, by the
    worker and by the gateway's count."""
    directory = model_dir(tmp_path / "model", own)
    value = TEMPLATE
    if given == "file":
        (tmp_path / "chat.jinja").write_text(TEMPLATE, encoding="utf-8")
        value = str(tmp_path / "chat.jinja")
    ids, counted = prepared(spec_of(directory, value))
    tok = PreTrainedTokenizerFast.from_pretrained(directory)
    expected = tok.apply_chat_template(CONVO, chat_template=TEMPLATE, add_generation_prompt=True, return_dict=False)
    assert ids == expected and counted == len(expected)
    assert "### ASSISTANT:" in tok.decode(ids)
    if own is not None:  # the tokenizer's own renders otherwise: the equality above can fail
        assert tok.apply_chat_template(CONVO, add_generation_prompt=True, return_dict=False) != expected


def test_without_one_a_base_model_answers_no_chat_template(tmp_path):
    loaded = load(spec_of(model_dir(tmp_path, None)), "")
    runner = GenerateRunner(loaded, "w", max_rows=2, max_seq_len=256)
    req = build_request({"input": {"messages": CONVO}}, loaded.spec, "t", time.time())
    outcome = runner.prepare(req, time.time())
    assert not isinstance(outcome, Job)
    assert outcome.result.error.code == "no_chat_template" and "chat_template" in outcome.result.error.message


def test_the_gateway_refuses_a_conversation_for_a_model_without_a_template_at_submit(tmp_path):
    """Known from the model's directory: a conversation is a 422 `no_chat_template` at submit (it was accepted, then
    failed by the worker; an OpenAI stream answered 200 and then an error chunk); a prompt is served; the model
    file's template, or the request's own where trusted, lifts it."""
    directory = model_dir(tmp_path, None)
    spec, limits = spec_of(directory), TokenLimits()
    with pytest.raises(ValidationError) as err:
        build_request({"input": {"messages": CONVO}}, spec, "t", time.time(), limits=limits)
    assert (err.value.field, err.value.code) == ("input.messages", "no_chat_template")
    assert "chat_template" in err.value.message
    assert build_request({"input": {"prompt": "hi"}}, spec, "t", time.time(), limits=limits).input["prompt"] == "hi"
    assert build_request({"input": {"messages": CONVO}}, spec_of(directory, TEMPLATE), "t", time.time(),
                         limits=TokenLimits()).input["messages"]
    trusting = dataclasses.replace(spec, trust_request_chat_template=True)
    assert build_request({"input": {"messages": CONVO, "chat_template": TEMPLATE}}, trusting, "t", time.time(),
                         limits=TokenLimits()).input["messages"]


def test_a_file_that_cannot_be_read_is_refused_naming_the_model(tmp_path):
    directory = model_dir(tmp_path, None)
    spec = spec_of(directory, str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match=r"model base: chat_template '.*missing\.jinja' is not a template"):
        load(spec, "")
    assert TokenLimits().count_chat(spec, CONVO) is not None  # the gateway counts the contents: the worker refuses


def test_a_template_that_does_not_compile_is_refused_at_load(tmp_path):
    spec = spec_of(model_dir(tmp_path, None), "{% for m in messages %}{{ m.content }}")  # no endfor
    with pytest.raises(ConfigError, match=r"model base: chat_template does not compile: .*line 1"):
        load(spec, "")


def test_transformers_tags_compile(tmp_path):
    """`{% generation %}` (transformers' assistant mask tag) and loop controls are a template's to use."""
    template = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    loaded = load(spec_of(model_dir(tmp_path, None), template), "")
    assert loaded.tokenizer.chat_template == template


def test_from_the_model_file_and_the_environment(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - name: base\n    task: generate\n    source: {tmp_path}\n    chat_template: |\n"
                    + "".join(f"      {line}\n" for line in TEMPLATE.split("\n")), encoding="utf-8")
    (spec,) = load_models({"BATCHGATE_CONFIG": str(path)})
    assert spec.chat_template_text() == TEMPLATE + "\n"
    (spec,) = load_models({"BATCHGATE_CONFIG": str(path), "BATCHGATE_MODEL__BASE__CHAT_TEMPLATE": "/x/chat.jinja"})
    assert spec.chat_template == "/x/chat.jinja"
    with pytest.raises(ConfigError, match="chat_template is for generation models"):
        ModelSpec(name="e", task=Task.EMBED, source="builtin:minilm", chat_template=TEMPLATE).validate()


REQUEST_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")


def submit(spec: ModelSpec, limits: TokenLimits | None = None, **inp) -> object:
    return build_request({"input": {"messages": CONVO, **inp}, "params": {"max_new_tokens": 4}}, spec, "t",
                         time.time(), limits=limits)


@pytest.mark.parametrize("file_template", ["", TEMPLATE])
def test_a_trusting_model_renders_a_requests_own_template(tmp_path, file_template):
    """vLLM's request `chat_template`, where the model's file trusts its callers with it: the request's template
    renders the conversation, over the tokenizer's own and the model file's."""
    directory = model_dir(tmp_path, OWN)
    spec = dataclasses.replace(spec_of(directory, file_template), trust_request_chat_template=True)
    runner = GenerateRunner(load(spec, ""), "w", max_rows=2, max_seq_len=256)
    limits = TokenLimits()
    req = submit(spec, limits, chat_template=REQUEST_TEMPLATE)
    assert req.input["chat_template"] == REQUEST_TEMPLATE
    job = runner.prepare(req, time.time())
    tok = PreTrainedTokenizerFast.from_pretrained(directory)
    expected = tok.apply_chat_template(CONVO, chat_template=REQUEST_TEMPLATE, add_generation_prompt=True,
                                       return_dict=False)
    assert isinstance(job, Job) and list(job.inputs[0]) == expected
    # the gateway does not run a caller's template (its loops are the worker's to take): it counts the contents,
    # a lower bound, and the worker's count above is the exact one
    joined = limits.count(spec, ["\n".join(m["content"] for m in CONVO)])
    assert joined is not None and limits.count_chat(spec, CONVO, chat_template=REQUEST_TEMPLATE) == joined[0]
    assert joined[0] <= len(expected)
    assert "[assistant]" in tok.decode(expected)
    plain = runner.prepare(submit(spec, limits), time.time())  # without one: the model's, which differs
    assert isinstance(plain, Job) and list(plain.inputs[0]) != expected


def test_a_requests_template_is_refused_unless_the_model_trusts_it(tmp_path):
    spec = spec_of(model_dir(tmp_path, OWN))
    with pytest.raises(ValidationError) as err:
        submit(spec, chat_template=REQUEST_TEMPLATE)
    assert err.value.field == "input.chat_template" and "trust_request_chat_template" in err.value.message
    # an entry another producer wrote past that check: the worker refuses it as well
    runner = GenerateRunner(load(spec, ""), "w", max_rows=2, max_seq_len=256)
    trusting = dataclasses.replace(spec, trust_request_chat_template=True)
    outcome = runner.prepare(submit(trusting, chat_template=REQUEST_TEMPLATE), time.time())
    assert not isinstance(outcome, Job) and outcome.result.error.code == "invalid_input"
    assert "does not take a request's chat template" in outcome.result.error.message


@pytest.mark.parametrize(("inp", "says"), [
    ({"chat_template": "{% for m in messages %}"}, "does not compile"),
    ({"chat_template": "{{ 1" + " + 1" * 2000 + " }}"}, "does not compile: RecursionError"),  # nested too deep
    ({"chat_template": ""}, "non-empty"),
    ({"chat_template": "x" * (MAX_TEMPLATE_CHARS + 1)}, f"at most {MAX_TEMPLATE_CHARS}"),
    ({"messages": None, "prompt": "hi", "chat_template": REQUEST_TEMPLATE}, "only with `messages`"),
])
def test_a_requests_template_that_cannot_be_rendered_is_refused_at_submit(tmp_path, inp, says):
    spec = ModelSpec(name="base", task=Task.GENERATE, source=str(tmp_path), trust_request_chat_template=True)
    body = {"messages": CONVO, **inp}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ValidationError) as err:
        build_request({"input": body}, spec.validate(), "t", time.time())
    assert err.value.field == "input.chat_template" and says in err.value.message, err.value.message


def test_the_trust_from_the_model_file_and_the_environment(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - name: base\n    task: generate\n    source: {tmp_path}\n"
                    "    trust_request_chat_template: true\n", encoding="utf-8")
    (spec,) = load_models({"BATCHGATE_CONFIG": str(path)})
    assert spec.trust_request_chat_template is True
    for value, trusted in (("off", False), ("true", True), ("0", False)):
        env = {"BATCHGATE_CONFIG": str(path), "BATCHGATE_MODEL__BASE__TRUST_REQUEST_CHAT_TEMPLATE": value}
        assert load_models(env)[0].trust_request_chat_template is trusted
    with pytest.raises(ConfigError, match="TRUST_REQUEST_CHAT_TEMPLATE: trust_request_chat_template must be true "
                                          "or false, got 'maybe'"):
        load_models({"BATCHGATE_CONFIG": str(path), "BATCHGATE_MODEL__BASE__TRUST_REQUEST_CHAT_TEMPLATE": "maybe"})
    assert ModelSpec(name="b", task=Task.GENERATE, source="x").trust_request_chat_template is False  # the default


def test_the_openai_route_passes_it_through():
    tr = oa.translate_chat({"model": "m", "messages": CONVO, "chat_template": REQUEST_TEMPLATE})
    assert tr.body["input"]["chat_template"] == REQUEST_TEMPLATE
    assert tr.aliases["input.chat_template"] == "chat_template"
