"""`documents` (transformers' and vLLM's): what a retrieval-augmented chat template shows the model besides the
conversation (Command R's, Granite's). The gateway counts the conversation with them as the worker renders it, the
worker renders them, the OpenAI route passes them through; they come with `messages` alone, as strings."""

from __future__ import annotations

import time

import pytest
from transformers import PreTrainedTokenizerFast

from gpu_worker.job import Job
from shared import openai_shapes as oa
from shared.config import ModelSpec
from shared.errors import ValidationError
from shared.params import MAX_DOCUMENTS
from shared.submit import build_request
from shared.token_limits import TokenLimits
from tests.integration.test_chat_template_kwargs import runner_of, templated_dir
from tests.integration.test_chat_template_kwargs import spec_of as template_spec

# a RAG template as Granite's and Command R's write theirs, reduced: the documents in a system turn of their own
RAG_TEMPLATE = ("{% if documents %}<|documents|>{% for d in documents %}[{{ loop.index }}] {{ d.title | default('') }}"
                ": {{ d.text }}\n{% endfor %}{% endif %}"
                "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONVO = [{"role": "user", "content": "When was the bridge opened?"}]
DOCS = [{"title": "Bridge", "text": "The bridge was opened in 1932 after six years of work."},
        {"title": "Harbour", "text": "The harbour is the deepest natural one in the region."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return templated_dir(tmp_path_factory.mktemp("rag"), RAG_TEMPLATE)


def spec_of(directory) -> ModelSpec:
    return template_spec(directory, "rag")


def submit(directory, **inp) -> object:
    return build_request({"input": {"messages": CONVO, **inp}, "params": {"max_new_tokens": 4}}, spec_of(directory),
                         "t", time.time(), limits=TokenLimits())


def test_the_gateway_counts_and_the_worker_renders_the_documents(model_dir):
    spec = spec_of(model_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    limits = TokenLimits()
    runner = runner_of(spec, tok)
    for docs in (None, DOCS[:1], DOCS):
        expected = tok.apply_chat_template(CONVO, documents=docs, add_generation_prompt=True, return_dict=False)
        assert limits.count_chat(spec, CONVO, documents=docs) == len(expected), docs
        req = submit(model_dir, **({"documents": docs} if docs is not None else {}))
        assert req.input.get("documents") == docs
        job = runner.prepare(req, time.time())
        assert isinstance(job, Job) and list(job.inputs[0]) == expected, docs
    shown = tok.apply_chat_template(CONVO, documents=DOCS, add_generation_prompt=True, tokenize=False)
    assert "opened in 1932" in shown  # the template reads them: the equalities above can fail
    plain = tok.apply_chat_template(CONVO, add_generation_prompt=True, return_dict=False)
    assert len(tok.apply_chat_template(CONVO, documents=DOCS, add_generation_prompt=True, return_dict=False)) > len(
        plain)


def test_the_documents_count_in_the_requests_size(model_dir):
    """Lanes and admission read a request's size: the prompt as the gateway counted it, documents included, and
    where it cannot count, an estimate that takes the documents in too."""
    spec = spec_of(model_dir)
    counted = TokenLimits().count_chat(spec, CONVO, documents=DOCS)
    with_docs = submit(model_dir, documents=DOCS)
    assert counted is not None and with_docs.est_tokens == counted + 4
    assert with_docs.est_tokens > submit(model_dir).est_tokens
    unlimited = [build_request({"input": {"messages": CONVO, **docs}, "params": {"max_new_tokens": 4}}, spec, "t",
                               time.time()).est_tokens for docs in ({}, {"documents": DOCS})]
    assert unlimited[1] > unlimited[0] + 20  # two documents of ~60 characters each


def test_the_documents_count_against_the_prompt_limit(model_dir):
    """The rendered documents are part of the prompt: too many tokens with them is the context error, at submit."""
    long = [{"title": f"d{i}", "text": "word " * 40} for i in range(8)]
    submit(model_dir)  # fits without them
    with pytest.raises(ValidationError) as err:
        submit(model_dir, documents=long)
    assert err.value.field == "input.messages" and "this model takes at most 200" in err.value.message


@pytest.mark.parametrize(("inp", "field", "says"), [
    ({"prompt": "hi", "documents": DOCS}, "input.documents", "only with `messages`"),
    ({"input_ids": [1, 2], "documents": DOCS}, "input.documents", "only with `messages`"),
    ({"messages": CONVO, "documents": [{"title": "t", "text": 3}]}, "input.documents", "str"),
    ({"messages": CONVO, "documents": ["just text"]}, "input.documents", "object"),
    ({"messages": CONVO, "documents": [{}] * (MAX_DOCUMENTS + 1)}, "input.documents", f"at most {MAX_DOCUMENTS} items"),
    ({"messages": CONVO, "documents": [{"text": "\ud800"}]}, "input.documents", "surrogate"),
])
def test_documents_that_cannot_be_rendered_are_refused(model_dir, inp, field, says):
    with pytest.raises(ValidationError) as err:
        build_request({"input": inp}, spec_of(model_dir), "t", time.time())
    assert err.value.field.startswith(field) and says in err.value.message, (err.value.field, err.value.message)


def test_null_and_empty_are_none(model_dir):
    for docs in (None, []):
        assert "documents" not in submit(model_dir, documents=docs).input


def test_the_openai_route_passes_them_through():
    tr = oa.translate_chat({"model": "m", "messages": CONVO, "documents": DOCS})
    assert tr.body["input"]["documents"] == DOCS
    assert tr.aliases["input.documents"] == "documents"
    assert "documents" not in oa.translate_chat({"model": "m", "messages": CONVO}).body["input"]
    with pytest.raises(oa.OpenAIError) as err:
        oa.translate_chat({"model": "m", "messages": CONVO, "documents": [{"text": 1}]})
    assert err.value.status == 400 and err.value.param is not None and err.value.param.startswith("documents")

