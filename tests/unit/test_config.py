import pytest

from shared.config import DEFAULT_MODELS, ModelSpec, Settings, redis_url_from
from shared.errors import ConfigError
from shared.lanes import LaneSpec
from shared.states import Task


def test_defaults_serve_the_built_ins():
    s = Settings.from_environ({})
    assert tuple(m.name for m in s.models) == DEFAULT_MODELS
    assert s.redis_url == "redis://127.0.0.1:6379/0"


def test_redis_url_from_either_variable():
    assert Settings.from_environ({"REDIS_URL": "redis://a:1/0"}).redis_url == "redis://a:1/0"
    assert Settings.from_environ({"REDIS_URL": "redis://a:1/0",
                                  "BATCHGATE_REDIS_URL": "redis://b:2/0"}).redis_url == "redis://b:2/0"
    assert redis_url_from({}) is None
    assert redis_url_from({"BATCHGATE_REDIS_URL": ""}) == ""  # set but empty names one, which Settings refuses
    assert redis_url_from({"REDIS_URL": "redis://a:1/0", "BATCHGATE_REDIS_URL": "redis://b:2/0"}) == "redis://b:2/0"


def test_the_dispatcher_and_lambda_settings_come_from_the_same_environ():
    d = Settings.from_environ({"BATCHGATE_KEY_PREFIX": "prod"})
    assert (d.webhook_secret, d.dispatcher_metrics_port) == ("", 9465)
    assert (d.lambda_tenant, d.lambda_margin_s) == ("default", 0.5)
    assert (d.metric_namespace, d.deployment, d.cloudwatch_endpoint) == ("batchgate", "prod", "")
    s = Settings.from_environ({"BATCHGATE_WEBHOOK_SECRET": "whsec_c2VjcmV0", "BATCHGATE_DISPATCHER_METRICS_PORT": "0",
                               "BATCHGATE_LAMBDA_TENANT": "acme", "BATCHGATE_LAMBDA_MARGIN_S": "1.5",
                               "BATCHGATE_METRIC_NAMESPACE": "ns", "BATCHGATE_DEPLOYMENT": "blue",
                               "BATCHGATE_CLOUDWATCH_ENDPOINT": "http://127.0.0.1:5000"})
    assert (s.webhook_secret, s.dispatcher_metrics_port) == ("whsec_c2VjcmV0", 0)
    assert (s.lambda_tenant, s.lambda_margin_s) == ("acme", 1.5)
    assert (s.metric_namespace, s.deployment, s.cloudwatch_endpoint) == ("ns", "blue", "http://127.0.0.1:5000")
    assert "whsec_c2VjcmV0" not in repr(s)
    with pytest.raises(ConfigError):
        Settings.from_environ({"BATCHGATE_DISPATCHER_METRICS_PORT": "ninety"})


def test_env_selects_and_overrides_models():
    s = Settings.from_environ({"BATCHGATE_MODELS": "tiny-llama",
                               "BATCHGATE_MODEL__TINY_LLAMA__MAX_BATCH_SIZE": "8",
                               "BATCHGATE_MODEL__TINY_LLAMA__DTYPE": "bfloat16"})
    (m,) = s.models
    assert (m.name, m.max_batch_size, m.dtype) == ("tiny-llama", 8, "bfloat16")


def test_env_defines_a_new_model():
    s = Settings.from_environ({"BATCHGATE_MODEL__MY_LM__SOURCE": "/models/my-lm",
                               "BATCHGATE_MODEL__MY_LM__TASK": "generate",
                               "BATCHGATE_MODEL__MY_LM__LANES": '[{"name": "all"}]'})
    m = s.model("my-lm")
    assert m is not None and m.task is Task.GENERATE and m.lane_names == ("all",)


@pytest.mark.parametrize("env", [
    {"BATCHGATE_MODEL__NEW__SOURCE": "/x"},  # no task
    {"BATCHGATE_MODEL__TINY_LLAMA__BOGUS": "1"},
    {"BATCHGATE_MODEL__TINY_LLAMA__MAX_BATCH_SIZE": "many"},
    {"BATCHGATE_MODEL__TINY_LLAMA__TASK": "classify"},
    {"BATCHGATE_MODEL__BROKEN": "1"},
    {"BATCHGATE_MODELS": "nope"},
    {"BATCHGATE_PORT": "eighty"},
    {"BATCHGATE_KEY_PREFIX": "bad prefix"},
    {"BATCHGATE_LOG_FORMAT": "xml"},
])
def test_bad_config_is_a_config_error(env):
    with pytest.raises(ConfigError):
        Settings.from_environ(env)


def test_yaml_file(tmp_path):
    f = tmp_path / "models.yaml"
    f.write_text("""
models:
  - name: minilm
    max_batch_size: 16
  - name: mygen
    task: generate
    source: /models/mygen
    device: cuda:1
    lanes:
      - {name: short, max_tokens: 64, window_ms: 2}
      - {name: long}
""")
    s = Settings.from_environ({"BATCHGATE_CONFIG": str(f)})
    assert [m.name for m in s.models] == ["minilm", "mygen"]
    assert s.model("minilm").max_batch_size == 16 and s.model("minilm").task is Task.EMBED
    mygen = s.model("mygen")
    assert mygen.device == "cuda:1"
    assert mygen.lanes == (LaneSpec("short", 64, 2.0), LaneSpec("long", None, 10.0))


def test_toml_file_with_env_override(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text('[[models]]\nname = "tiny-llama"\nmax_running = 16\n')
    s = Settings.from_environ({"BATCHGATE_CONFIG": str(f), "BATCHGATE_MODEL__TINY_LLAMA__MAX_RUNNING": "4"})
    assert s.model("tiny-llama").max_running == 4


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError):
        Settings.from_environ({"BATCHGATE_CONFIG": str(tmp_path / "missing.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [name: x: y")
    with pytest.raises(ConfigError):
        Settings.from_environ({"BATCHGATE_CONFIG": str(bad)})


def test_lane_bounds_must_increase():
    spec = ModelSpec(name="m", task=Task.EMBED, source="/x", lanes=(LaneSpec("a", 100), LaneSpec("b", 50),
                                                                      LaneSpec("c", None)))
    with pytest.raises(ConfigError):
        spec.validate()
    with pytest.raises(ConfigError):
        ModelSpec(name="Bad Name", task=Task.EMBED, source="/x").validate()


def test_lane_share_from_a_file_and_its_bounds(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("models:\n  - name: m\n    task: generate\n    source: /x\n    lanes:\n"
                   "      - {name: short, max_tokens: 64}\n      - {name: long, max_share: 0.75}\n")
    spec = Settings.from_environ({"BATCHGATE_CONFIG": str(cfg)}).models[0]
    assert [lane.max_share for lane in spec.lanes] == [1.0, 0.75]
    assert spec.to_public()["lanes"][1]["max_share"] == 0.75
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="max_share"):
            ModelSpec(name="m", task=Task.EMBED, source="/x",
                      lanes=(LaneSpec("a", 10), LaneSpec("b", None, max_share=bad))).validate()


def test_long_rows_off_by_default_from_a_file_and_its_bounds(tmp_path):
    assert ModelSpec(name="m", task=Task.GENERATE, source="/x").long_rows == 0  # no bound unless set
    cfg = tmp_path / "m.yaml"
    cfg.write_text("models:\n  - {name: a, task: generate, source: /x, long_rows: 5}\n")
    (a,) = Settings.from_environ({"BATCHGATE_CONFIG": str(cfg)}).models
    assert a.long_rows == 5
    with pytest.raises(ConfigError, match="long_rows"):
        ModelSpec(name="m", task=Task.GENERATE, source="/x", long_rows=-1).validate()


def test_lane_engines_from_a_file_and_their_order(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("models:\n  - name: m\n    task: generate\n    source: /x\n    lanes:\n"
                   "      - {name: short, max_tokens: 64, engine: fast}\n      - {name: long}\n")
    spec = Settings.from_environ({"BATCHGATE_CONFIG": str(cfg)}).models[0]
    assert [lane.engine for lane in spec.lanes] == ["fast", "main"]
    assert spec.to_public()["lanes"][0]["engine"] == "fast"
    split = (LaneSpec("a", 10, engine="x"), LaneSpec("b", 20), LaneSpec("c", None, engine="x"))
    with pytest.raises(ConfigError, match="adjacent"):
        ModelSpec(name="m", task=Task.GENERATE, source="/x", lanes=split).validate()
    with pytest.raises(ConfigError, match="engine"):
        ModelSpec(name="m", task=Task.GENERATE, source="/x",
                  lanes=(LaneSpec("a", None, engine="Not Simple"),)).validate()
    with pytest.raises(ConfigError, match="TORCH_THREADS"):
        Settings.from_environ({"BATCHGATE_TORCH_THREADS": "-1"})
    with pytest.raises(ConfigError, match="CPU_ENGINES"):
        Settings.from_environ({"BATCHGATE_CPU_ENGINES": "both"})
    assert Settings.from_environ({}).cpu_engines == "shared"
    assert Settings.from_environ({"BATCHGATE_CPU_ENGINES": "Parallel"}).cpu_engines == "parallel"


def test_models_inline_in_the_environment():
    text = "models:\n  - name: m\n    task: embed\n    source: /x\n"
    (spec,) = Settings.from_environ({"BATCHGATE_CONFIG_YAML": text}).models
    assert (spec.name, spec.task, spec.source) == ("m", Task.EMBED, "/x")
    with pytest.raises(ConfigError, match="not both"):
        Settings.from_environ({"BATCHGATE_CONFIG_YAML": text, "BATCHGATE_CONFIG": "/etc/models.yaml"})
    with pytest.raises(ConfigError, match="BATCHGATE_CONFIG_YAML"):
        Settings.from_environ({"BATCHGATE_CONFIG_YAML": "models: [a: b: c"})


def test_the_gateway_finds_the_builtin_models_where_the_worker_creates_them(tmp_path):
    """shared.token_limits may not import gpu_worker; its copy of the built-in directory name stays in step."""
    from gpu_worker import models
    from shared import token_limits
    from shared.config import BUILTIN_MODELS

    for name in models.BUILTIN_LLAMAS:
        expected = tmp_path / f"{name}-{models.BUILTIN_VERSION}"
        assert token_limits.model_dir(BUILTIN_MODELS[name], tmp_path) == expected
        assert BUILTIN_MODELS[name].vocab_size == models.TOKENIZER_VOCAB
    assert token_limits.model_dir(BUILTIN_MODELS["minilm"], tmp_path) == models.minilm_path()


@pytest.mark.parametrize("name, value, says", [
    ("BATCHGATE_MAX_WAIT_S", "abc", "BATCHGATE_MAX_WAIT_S='abc' is not a number"),
    ("BATCHGATE_PORT", "abc", "BATCHGATE_PORT='abc' is not an integer"),
    ("BATCHGATE_RESULT_TTL_S", "1.5", "BATCHGATE_RESULT_TTL_S='1.5' is not an integer"),
    ("BATCHGATE_CALLBACK_CONNECT_TIMEOUT_S", "", "BATCHGATE_CALLBACK_CONNECT_TIMEOUT_S='' is not a number"),
    ("BATCHGATE_LOG_LEVEL", "loud", "BATCHGATE_LOG_LEVEL must be one of debug, info, warning, error, critical"),
    ("BATCHGATE_LOG_FORMAT", "xml", "BATCHGATE_LOG_FORMAT must be json, console or auto"),
    ("BATCHGATE_REDIS_URL", "http://x", "BATCHGATE_REDIS_URL='http://x' is not a Redis URL"),
    ("REDIS_URL", "garbage", "REDIS_URL='garbage' is not a Redis URL"),
    ("BATCHGATE_REDIS_URL", "redis://h:port/0", "BATCHGATE_REDIS_URL='redis://h:port/0' is not a Redis URL"),
])
def test_a_bad_value_names_its_variable_and_what_it_should_be(name, value, says):
    with pytest.raises(ConfigError) as exc:
        Settings.from_environ({name: value})
    assert str(exc.value).startswith(says), exc.value


def test_every_redis_url_form_batchgate_documents_is_accepted():
    for url in ("redis://127.0.0.1:6379/0", "rediss://:pw@h:6380/1", "unix:///tmp/redis.sock",
                "redis+cluster://h:7000", "rediss+cluster://h:7000", "REDIS://h/0"):
        assert Settings.from_environ({"BATCHGATE_REDIS_URL": url}).redis_url == url


def test_an_unknown_batchgate_variable_is_warned_of_by_name(caplog):
    from shared import config

    env = {"BATCHGATE_MAXWAIT_S": "5", "BATCHGATE_MODEL__TINY_LLAMA__MAX_RUNNING": "4",
           **{name: "" for name in config.OTHER_ENV}, "BATCHGATE_MAX_WAIT_S": "5", "OTHER_THING": "x"}
    assert config.unknown_env(env) == ["BATCHGATE_MAXWAIT_S"]
    config._warned_env.discard("BATCHGATE_MAXWAIT_S")
    with caplog.at_level("WARNING", logger="batchgate.config"):
        Settings.from_environ({"BATCHGATE_MAXWAIT_S": "5"})
    (record,) = [r for r in caplog.records if r.name == "batchgate.config"]
    assert "BATCHGATE_MAXWAIT_S" in record.getMessage() and "BATCHGATE_MAX_WAIT_S" in record.getMessage()


def test_every_batchgate_variable_the_repository_names_is_known():
    """A guard that keeps `SETTINGS_ENV`/`OTHER_ENV` in step: each `BATCHGATE_<NAME>` (or `ENV_PREFIX + "<NAME>"`)
    written anywhere in the repository (but this file, which writes typos on purpose) is a variable batchgate
    reads, so none is ever warned of as a typo."""
    import os
    import re
    from pathlib import Path

    from shared import config

    root = Path(__file__).resolve().parents[2]
    not_variables = {"BATCHGATE_ENV"}  # a heredoc delimiter (terraform/templates/worker_user_data.sh.tftpl)
    prefixes = ("BATCHGATE_MODEL__",)  # BATCHGATE_MODEL__<NAME>__<FIELD>
    found: dict[str, str] = {}
    this = Path(__file__).resolve()
    paths = []
    for folder, dirs, files in os.walk(root):  # pruned as it goes: never into .venv, .git and the like
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d.endswith(".egg-info")
                                           or d in ("node_modules", "__pycache__"))]
        paths += [Path(folder, f) for f in files]
    for path in paths:
        if path == this or path.suffix in (".pyc", ".lock", ".tfstate"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # literals, and the names shared/config.py reads as ENV_PREFIX + "NAME", integer("NAME", ...), number(...)
        for m in re.finditer(r'BATCHGATE_[A-Z0-9_]*[A-Z0-9]_?_?|(?:ENV_PREFIX \+ |integer\(|number\()"([A-Z0-9_]+)"',
                             text):
            name = config.ENV_PREFIX + m.group(1) if m.group(1) else m.group(0)
            found.setdefault(name, str(path.relative_to(root)))
    unknown = {}
    for name, where in found.items():
        if name in config.KNOWN_ENV or name in not_variables or name.startswith(prefixes):
            continue
        if name.endswith("_") and any(k.startswith(name) for k in config.KNOWN_ENV):
            continue  # a family written as BATCHGATE_CALLBACK_*
        unknown[name] = where
    assert not unknown, f"BATCHGATE_ variables not in shared/config.py SETTINGS_ENV or OTHER_ENV: {unknown}"
    assert config.ENV_PREFIX + "MAX_WAIT_S" in found and config.ENV_PREFIX + "TENANT_BURST" in found


@pytest.mark.parametrize("name, value, says", [
    ("BATCHGATE_MAX_WAIT_S", "-1", "BATCHGATE_MAX_WAIT_S must be >= 0 (got -1)"),
    ("BATCHGATE_MAX_WAIT_S", "nan", "BATCHGATE_MAX_WAIT_S must be a finite number >= 0 (got nan)"),
    ("BATCHGATE_RESULT_TTL_S", "0", "BATCHGATE_RESULT_TTL_S must be >= 1 (got 0)"),
    ("BATCHGATE_MAX_BODY_BYTES", "100", "BATCHGATE_MAX_BODY_BYTES must be >= 1024 (got 100)"),
    ("BATCHGATE_RECLAIM_IDLE_S", "0", "BATCHGATE_RECLAIM_IDLE_S must be > 0 (got 0)"),
    ("BATCHGATE_MAX_DELIVERIES", "0", "BATCHGATE_MAX_DELIVERIES must be >= 1 (got 0)"),
    ("BATCHGATE_DRAIN_BUDGET_S", "-0.5", "BATCHGATE_DRAIN_BUDGET_S must be >= 0 (got -0.5)"),
    ("BATCHGATE_BODY_TIMEOUT_S", "0", "BATCHGATE_BODY_TIMEOUT_S must be > 0 (got 0)"),
    ("BATCHGATE_HEADER_TIMEOUT_S", "-2", "BATCHGATE_HEADER_TIMEOUT_S must be > 0 (got -2)"),
    ("BATCHGATE_KEEP_ALIVE_S", "0", "BATCHGATE_KEEP_ALIVE_S must be > 0 (got 0)"),
    ("BATCHGATE_SHUTDOWN_GRACE_S", "-1", "BATCHGATE_SHUTDOWN_GRACE_S must be >= 0 (got -1)"),
    ("BATCHGATE_REDIS_WAIT_REPLICAS", "-1", "BATCHGATE_REDIS_WAIT_REPLICAS must be >= 0 (got -1)"),
    ("BATCHGATE_REDIS_WAIT_MS", "0", "BATCHGATE_REDIS_WAIT_MS must be >= 1 (got 0)"),
    ("BATCHGATE_MAX_FILE_BYTES", "0", "BATCHGATE_MAX_FILE_BYTES must be >= 1 (got 0)"),
    ("BATCHGATE_MAX_FILE_LINES", "0", "BATCHGATE_MAX_FILE_LINES must be >= 1 (got 0)"),
    ("BATCHGATE_TORCH_THREADS", "-1", "BATCHGATE_TORCH_THREADS must be >= 0 (got -1)"),
    ("BATCHGATE_KEY_PREFIX", "a b", "BATCHGATE_KEY_PREFIX must be 1-32 letters"),
])
def test_a_value_out_of_range_names_its_variable_and_the_value_it_got(name, value, says):
    """The README promises a configuration error naming the variable: each bound is its own message."""
    with pytest.raises(ConfigError) as exc:
        Settings.from_environ({name: value})
    assert str(exc.value).startswith(says), exc.value
    assert len(str(exc.value).splitlines()) == 1


def test_a_redis_urls_password_is_never_shown():
    from shared.config import shown_url
    from shared.errors import ConfigError

    assert shown_url("redis://:S3cret@127.0.0.1:6432/0") == "redis://:***@127.0.0.1:6432/0"
    assert shown_url("rediss+cluster://user:S3cret@h:7000") == "rediss+cluster://user:***@h:7000"
    assert shown_url("redis://h:1/0?password=S3cret&db=1") == "redis://h:1/0?password=***&db=1"
    assert shown_url("redis://h:6379?password=S3cret") == "redis://h:6379?password=***"  # no path
    assert shown_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    try:
        Settings.from_environ({"BATCHGATE_REDIS_URL": "redis://:S3cret@h:notaport/0"})
    except ConfigError as exc:
        assert "S3cret" not in str(exc) and ":***@h" in str(exc)
    else:
        raise AssertionError("a bad port is refused")


@pytest.mark.parametrize(("name", "value"), [("BATCHGATE_AUTH", "bogus"), ("BATCHGATE_CPU_ENGINES", "many")])
def test_a_choice_out_of_its_set_names_the_value_given(name, value):
    with pytest.raises(ConfigError, match=f"{name} must be .*got '{value}'"):
        Settings.from_environ({name: value})
