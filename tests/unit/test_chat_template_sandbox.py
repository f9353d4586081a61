"""The gateway renders a model's chat template (to count its tokens at submit) as the worker's transformers does:
the same globals, filters and tags, so a template that renders there renders here to the same text, and one that
refuses a conversation there refuses it here."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
import pytest

from shared.token_limits import TemplateRefusal, load_chat_template

CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2 + 2?"}]

TEMPLATES = {
    # a dated system preamble (Llama 3.x, Mistral Small, Granite): `strftime_now` from transformers
    "strftime_now": "{{ bos_token }}Today is {{ strftime_now('%d %B %Y') }}.\n"
                    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    # state across the loop (Qwen's, DeepSeek's)
    "namespace": "{% set ns = namespace(n=0, last='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                 "{% set ns.last = m.role %}{% endfor %}{{ ns.n }} turns, last {{ ns.last }}",
    "dict": "{% set d = dict(a=1, b='x') %}{{ d | tojson }} {{ dict.fromkeys(['k'], 0) | tojson }}",
    # assistant turns marked for training masks (SmolLM3, OLMo): rendered as their body
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}"
                  "{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}{% endif %}\n{% endfor %}",
    "tojson": "{{ messages | tojson }}{{ {'é': '<b>'} | tojson(indent=2) }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}"
                    "{% endfor %}",
}


def ours(tmp_path: Path, source: str) -> jinja2.Template:
    found = load_chat_template(tmp_path, source)
    assert found is not None
    return found[0]


def theirs(source: str) -> jinja2.Template:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(source)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers_renders(tmp_path, name):
    source = TEMPLATES[name]
    kw = {"messages": CONVO, "add_generation_prompt": True, "bos_token": "<s>"}
    expected = theirs(source).render(**kw)
    assert ours(tmp_path, source).render(**kw) == expected
    if name == "strftime_now":
        assert datetime.date.today().strftime("%d %B %Y") in expected


def test_a_template_that_refuses_a_conversation_refuses_it_here_too(tmp_path):
    source = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{{ m.content }}{% endfor %}")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        theirs(source).render(messages=bad)
    with pytest.raises(TemplateRefusal, match="must alternate"):
        ours(tmp_path, source).render(messages=bad)
    assert ours(tmp_path, source).render(messages=bad[:1]) == "a"


def test_a_namespace_takes_no_underscore_names_here_either(tmp_path):
    source = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        theirs(source).render()
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours(tmp_path, source).render()


def test_the_template_is_read_from_tokenizer_config_as_transformers_reads_it(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATES["strftime_now"], "bos_token": {"content": "<s>"}}))
    found = load_chat_template(tmp_path)
    assert found is not None
    template, special = found
    assert special == {"bos_token": "<s>"}
    assert template.render(messages=CONVO[:1], add_generation_prompt=False, **special).startswith("<s>Today is ")
