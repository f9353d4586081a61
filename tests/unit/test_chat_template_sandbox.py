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
    return found[0]["default"]


def theirs(source: str) -> jinja2.Template:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(source)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers_renders(tmp_path, name, monkeypatch):
    import transformers.utils.chat_template_utils as theirs_module

    import shared.token_limits as ours_module

    class Frozen(datetime.datetime):  # one clock for both renders (they might straddle midnight)
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 11, 27, 12, 0, 0)

    monkeypatch.setattr(theirs_module, "datetime", Frozen)
    monkeypatch.setattr(ours_module, "datetime", Frozen)
    source = TEMPLATES[name]
    kw = {"messages": CONVO, "add_generation_prompt": True, "bos_token": "<s>"}
    expected = theirs(source).render(**kw)
    assert ours(tmp_path, source).render(**kw) == expected
    if name == "strftime_now":
        assert "Today is 27 November 2026." in expected


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
    templates, special = found
    assert special == {"bos_token": "<s>"}
    text = templates["default"].render(messages=CONVO[:1], add_generation_prompt=False, **special)
    assert text.startswith("<s>Today is ")


def test_named_templates_are_read_and_picked_as_transformers_picks_them(tmp_path):
    """`chat_template.jinja` and `additional_chat_templates/*.jinja` (what `save_pretrained` writes), before
    `tokenizer_config.json`'s; with tools the `tool_use` template where there is one, else the default."""
    from transformers import PreTrainedTokenizerFast

    from gpu_worker.models import build_bpe_tokenizer
    from shared.token_limits import pick_template

    tok = PreTrainedTokenizerFast(tokenizer_object=build_bpe_tokenizer(), bos_token="<s>", eos_token="</s>")
    tok.chat_template = {"default": "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}plain",
                         "tool_use": "tools: {{ tools | length }}"}
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    found = load_chat_template(tmp_path)
    assert found is not None and set(found[0]) == {"default", "tool_use"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for given in (None, tools):
        worker = tok.apply_chat_template(CONVO, tools=given, add_generation_prompt=True, tokenize=False)
        here = pick_template(found[0], given).render(messages=CONVO, tools=given, documents=None,
                                                     add_generation_prompt=True, **found[1])
        assert here == worker, given
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "from the config"}]}))
    assert load_chat_template(tmp_path)[0]["default"].render() == "plain"  # the files come first
    for path in (tmp_path / "chat_template.jinja", tmp_path / "additional_chat_templates" / "tool_use.jinja"):
        path.unlink()
    assert load_chat_template(tmp_path)[0]["default"].render() == "from the config"
    assert pick_template({"tool_use": "x"}, None) is None  # no default: transformers refuses; the gateway counts


CONTINUED = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is  "}]
TURNS = {
    # an end of turn after each message: continuing the last one leaves it out
    "eot": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    # contents trimmed (Llama 3's): the message's own trailing spaces go too
    "trimmed": "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}</s>{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(TURNS))
def test_a_continued_last_message_is_cut_where_transformers_cuts_it(tmp_path, name):
    from transformers.utils.chat_template_utils import render_jinja_template

    from shared.token_limits import cut_at_continue, tagged

    source = TURNS[name]
    (expected,), _ = render_jinja_template([CONTINUED], chat_template=source, continue_final_message=True,
                                           add_generation_prompt=False)
    got = cut_at_continue(ours(tmp_path, source).render(messages=tagged(CONTINUED), add_generation_prompt=False),
                          CONTINUED[-1]["content"])
    assert got == expected and not got.endswith(("<|end|>\n", "</s>")), got
    assert expected.endswith("The colour is  " if name == "eot" else "The colour is")


def test_a_template_that_drops_the_continued_message_refuses_it_here_too(tmp_path):
    from transformers.utils.chat_template_utils import render_jinja_template

    from shared.token_limits import cut_at_continue, tagged

    source = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="does not appear"):
        render_jinja_template([CONTINUED], chat_template=source, continue_final_message=True)
    rendered = ours(tmp_path, source).render(messages=tagged(CONTINUED))
    with pytest.raises(TemplateRefusal, match="continue_final_message"):
        cut_at_continue(rendered, CONTINUED[-1]["content"])
