"""Configuration a user gets wrong is refused at start with one line naming the setting (the variable or the
model-file field) and what it accepts, never accepted silently and never a traceback (shared/config_checks.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shared.config import ModelSpec, Settings
from shared.config_checks import SETTINGS_RULES, Rule, env_model_name
from shared.errors import ConfigError
from shared.lanes import LaneSpec
from shared.states import Task


def refusal(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as exc:
        Settings.from_environ(env)
    message = str(exc.value)
    assert len(message.splitlines()) == 1, message
    return message


def model_file(tmp_path, text: str) -> dict[str, str]:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return {"BATCHGATE_CONFIG": str(path)}


# --- every numeric setting has a range --------------------------------------------------------------------------

def test_every_numeric_setting_has_a_rule():
    numeric = {f.name for f in dataclasses.fields(Settings) if f.type in ("int", "float")}
    assert numeric == {attr for _, attr, _ in SETTINGS_RULES}


@pytest.mark.parametrize("name, value, says", [
    ("BATCHGATE_TENANT_RATE_PER_S", "-1", "BATCHGATE_TENANT_RATE_PER_S must be >= 0 (got -1); 0: no rate limit"),
    ("BATCHGATE_TENANT_RATE_PER_S", "inf", "BATCHGATE_TENANT_RATE_PER_S must be a finite number >= 0 (got inf)"),
    ("BATCHGATE_TENANT_BURST", "-1", "BATCHGATE_TENANT_BURST must be >= 0 (got -1)"),
    ("BATCHGATE_TENANT_MAX_BACKLOG", "-3", "BATCHGATE_TENANT_MAX_BACKLOG must be >= 0 (got -3); 0: no quota"),
    ("BATCHGATE_MAX_BATCH_ITEMS", "0", "BATCHGATE_MAX_BATCH_ITEMS must be >= 1 (got 0)"),
    ("BATCHGATE_EXPIRY_GRACE_S", "-5", "BATCHGATE_EXPIRY_GRACE_S must be >= 0 (got -5)"),
    ("BATCHGATE_CALLBACK_MAX_ATTEMPTS", "0", "BATCHGATE_CALLBACK_MAX_ATTEMPTS must be >= 1 (got 0)"),
    ("BATCHGATE_CALLBACK_BASE_S", "0", "BATCHGATE_CALLBACK_BASE_S must be > 0 (got 0)"),
    ("BATCHGATE_CALLBACK_CAP_S", "-1", "BATCHGATE_CALLBACK_CAP_S must be > 0 (got -1)"),
    ("BATCHGATE_CALLBACK_CONNECT_TIMEOUT_S", "0", "BATCHGATE_CALLBACK_CONNECT_TIMEOUT_S must be > 0 (got 0)"),
    ("BATCHGATE_CALLBACK_TIMEOUT_S", "-2", "BATCHGATE_CALLBACK_TIMEOUT_S must be > 0 (got -2)"),
    ("BATCHGATE_CALLBACK_LEASE_S", "0", "BATCHGATE_CALLBACK_LEASE_S must be > 0 (got 0)"),
    ("BATCHGATE_CALLBACK_LEASE_S", "5", "BATCHGATE_CALLBACK_LEASE_S must be > BATCHGATE_CALLBACK_TIMEOUT_S (got 5"),
    ("BATCHGATE_INTAKE_BLOCK_MS", "0", "BATCHGATE_INTAKE_BLOCK_MS must be >= 1 (got 0)"),
    ("BATCHGATE_LAMBDA_MARGIN_S", "-0.5", "BATCHGATE_LAMBDA_MARGIN_S must be >= 0 (got -0.5)"),
    ("BATCHGATE_PORT", "83737", "BATCHGATE_PORT must be between 0 and 65535 (got 83737)"),
    ("BATCHGATE_PORT", "-1", "BATCHGATE_PORT must be between 0 and 65535 (got -1)"),
    ("BATCHGATE_WORKER_METRICS_PORT", "65536", "BATCHGATE_WORKER_METRICS_PORT must be between 0 and 65535 (got 65536)"),
    ("BATCHGATE_DISPATCHER_METRICS_PORT", "-9", "BATCHGATE_DISPATCHER_METRICS_PORT must be between 0 and 65535"),
    ("BATCHGATE_SHUTDOWN_GRACE_S", "inf", "BATCHGATE_SHUTDOWN_GRACE_S must be a finite number >= 0 (got inf)"),
    ("BATCHGATE_DRAIN_BUDGET_S", "-5", "BATCHGATE_DRAIN_BUDGET_S must be >= 0 (got -5)"),
])
def test_a_setting_out_of_range_names_its_variable_and_range(name, value, says):
    assert refusal({name: value}).startswith(says)


@pytest.mark.parametrize("secret", ["short", "whsec_x", "whsec_"])
def test_a_webhook_secret_standard_webhooks_cannot_read_is_refused_at_start(secret):
    """Else every delivery it signs fails, seen only when a webhook falls due; the secret is not echoed."""
    says = refusal({"BATCHGATE_WEBHOOK_SECRET": secret})
    assert says.startswith("BATCHGATE_WEBHOOK_SECRET must be base64") and "got" not in says
    assert secret == "whsec_" or f"{secret}" not in says.replace("`whsec_`", "")


@pytest.mark.parametrize("secret", ["mysecret", "whsec_" + "b" * 32, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
def test_a_webhook_secret_that_decodes_is_accepted(secret):
    assert Settings.from_environ({"BATCHGATE_WEBHOOK_SECRET": secret}).validate().webhook_secret == secret


@pytest.mark.parametrize("env", [
    {"BATCHGATE_TENANT_RATE_PER_S": "0", "BATCHGATE_TENANT_BURST": "0", "BATCHGATE_TENANT_MAX_BACKLOG": "0"},
    {"BATCHGATE_EXPIRY_GRACE_S": "0", "BATCHGATE_LAMBDA_MARGIN_S": "0", "BATCHGATE_DRAIN_BUDGET_S": "0"},
    {"BATCHGATE_PORT": "0", "BATCHGATE_WORKER_METRICS_PORT": "0", "BATCHGATE_DISPATCHER_METRICS_PORT": "65535"},
    {"BATCHGATE_CALLBACK_TIMEOUT_S": "2", "BATCHGATE_CALLBACK_LEASE_S": "2.5", "BATCHGATE_INTAKE_BLOCK_MS": "1"},
])
def test_the_edges_of_each_range_are_accepted(env):
    Settings.from_environ(env)


def test_the_documented_defaults_are_unchanged_and_valid():
    s = Settings.from_environ({})
    assert (s.port, s.expiry_grace_s, s.max_batch_items, s.intake_block_ms, s.tenant_rate_per_s) == \
        (8000, 2.0, 100, 1000, 0.0)
    assert (s.callback_timeout_s, s.callback_lease_s, s.worker_metrics_port, s.dispatcher_metrics_port) == \
        (10.0, 60.0, 9464, 9465)


@pytest.mark.parametrize("rule, value, says", [
    (Rule(0, high=65535, whole=True), 3.5, "must be a whole number between 0 and 65535 (got 3.5)"),
    (Rule(0, strict=True, high=1), 0, "must be a number in (0, 1] (got 0)"),
    (Rule(0, high=60_000, high_open=True), 60_000, "must be a number in [0, 60000) (got 60000)"),
    (Rule(1, whole=True), True, "must be a whole number >= 1 (got True)"),
    (Rule(0), float("nan"), "must be a finite number >= 0 (got nan)"),
])
def test_a_rule_says_what_it_accepts(rule, value, says):
    assert rule.problem(value, kind=True) == says


# --- a model's fields --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, says", [
    ("max_running", "3.7", "max_running must be a whole number >= 1 (got 3.7)"),
    ("max_running", "true", "max_running must be a whole number >= 1 (got True)"),
    ("max_running", "0", "max_running must be a whole number >= 1 (got 0)"),
    ("max_batch_size", "-4", "max_batch_size must be a whole number >= 1 (got -4)"),
    ("max_new_tokens", "many", "max_new_tokens must be a whole number >= 1 (got 'many')"),
    ("kv_budget_tokens", "0", "kv_budget_tokens must be a whole number >= 1 (got 0)"),
    ("prefill_chunk_tokens", "-1", "prefill_chunk_tokens must be a whole number >= 0 (got -1)"),
    ("default_timeout_s", "[1]", "default_timeout_s must be a number > 0 (got [1])"),
    ("max_timeout_s", ".inf", "max_timeout_s must be a finite number > 0 (got inf)"),
    ("min_timeout_s", "-1", "min_timeout_s must be a number >= 0 (got -1)"),
    ("device", "gpu", "device must be auto (CUDA when present, else CPU), cpu, cuda, cuda:<index> or mps, got 'gpu'"),
    ("device", "cuda:x", "device must be auto"),
    ("dtype", "fp16", "dtype must be auto (bf16/fp16 on CUDA, fp32 on CPU), float32, float16 or bfloat16"),
    ("device", "yes", "device must be a string, got True"),
    ("max_running", "null", "max_running needs a value"),
])
def test_a_bad_model_field_in_the_file_names_the_model_and_field(tmp_path, field, value, says):
    env = model_file(tmp_path, f"models:\n  - {{name: m, task: generate, source: /x, {field}: {value}}}\n")
    assert refusal(env).startswith(f"model m: {says}")


@pytest.mark.parametrize("field, value, says", [
    ("MAX_RUNNING", "3.7", "BATCHGATE_MODEL__TINY_LLAMA__MAX_RUNNING: max_running must be a whole number >= 1 "
                           "(got '3.7')"),
    ("MAX_RUNNING", "true", "BATCHGATE_MODEL__TINY_LLAMA__MAX_RUNNING: max_running must be a whole number >= 1"),
    ("MAX_RUNNING", "", "BATCHGATE_MODEL__TINY_LLAMA__MAX_RUNNING: max_running must be a whole number >= 1"),
    ("STEP_MS", "-1", "model tiny-llama: step_ms must be a number in [0, 60000) (got -1)"),
    ("DEVICE", "gpu", "model tiny-llama: device must be"),
    ("LANES", '[{"name": "a", ', "BATCHGATE_MODEL__TINY_LLAMA__LANES: lanes do not parse as YAML or JSON"),
    ("LANES", '{"name": "a"}', "BATCHGATE_MODEL__TINY_LLAMA__LANES: lanes must be a list of lanes"),
    ("BOGUS", "1", "BATCHGATE_MODEL__TINY_LLAMA__BOGUS: unknown field 'bogus'; known: "),
])
def test_a_bad_model_field_from_the_environment_names_the_variable_or_field(field, value, says):
    assert refusal({f"BATCHGATE_MODEL__TINY_LLAMA__{field}": value}).startswith(says)


def test_whole_numbers_written_as_such_are_accepted(tmp_path):
    env = model_file(tmp_path, "models:\n  - {name: m, task: generate, source: /x, max_running: 4.0, "
                               "max_batch_size: '8', default_timeout_s: 30, device: 'cuda:1', dtype: bfloat16}\n")
    (m,) = Settings.from_environ(env).models
    assert (m.max_running, m.max_batch_size, m.default_timeout_s, m.device) == (4, 8, 30.0, "cuda:1")
    assert isinstance(m.max_running, int) and isinstance(m.default_timeout_s, float)


# --- lanes ---------------------------------------------------------------------------------------------------------

def lanes_env(*lanes: dict[str, object]) -> dict[str, str]:
    return {"BATCHGATE_MODELS": "tiny-llama", "BATCHGATE_MODEL__TINY_LLAMA__LANES": json.dumps(list(lanes))}


@pytest.mark.parametrize("lane, says", [
    ({"name": "a", "window_ms": "x"}, "lane a: window_ms must be a number >= 0 (got 'x')"),
    ({"name": "a", "window_ms": -1}, "lane a: window_ms must be a number >= 0 (got -1)"),
    ({"name": "a", "window_ms": None}, "lane a: window_ms must be a number >= 0 (got None)"),
    ({"name": "a", "max_backlog": -1}, "lane a: max_backlog must be a whole number >= 1 (got -1)"),
    ({"name": "a", "max_backlog": 0}, "lane a: max_backlog must be a whole number >= 1 (got 0)"),
    ({"name": "a", "max_backlog": 2.5}, "lane a: max_backlog must be a whole number >= 1 (got 2.5)"),
    ({"name": "a", "max_share": 0}, "lane a: max_share must be a number in (0, 1] (got 0)"),
    ({"name": "a", "max_tokens": "lots"}, "lane a: max_tokens must be a whole number >= 1 (got 'lots')"),
    ({"name": "a", "speed": 1}, "lane a: unknown lane field(s) ['speed']; known: name, max_tokens"),
    ({"window_ms": 1}, "each lane needs at least a name"),
])
def test_a_bad_lane_value_is_a_config_error_not_a_traceback(lane, says):
    """`_lane_from` used to run outside from_environ's try: int('x') ended the process with a traceback."""
    assert says in refusal(lanes_env(lane))


@pytest.mark.parametrize("bounds, says", [
    ((100, 50, None), "lane bounds must increase: lane l1 max_tokens 50 is not above lane l0's 100"),
    ((64, 64, None), "lane bounds must increase: lane l1 max_tokens 64 is not above lane l0's 64"),
    ((None, 64), "lane l0 has no max_tokens but is not the last lane: lane l1 after it would get no request"),
    ((64, 1000), "the last lane, l1, takes every request longer than the lanes before it, up to 2304 tokens "
                 "(max_input_tokens + max_new_tokens), so its max_tokens 1000 would be ignored: leave it unset"),
])
def test_lane_bounds_must_increase_and_the_last_cannot_cut_requests_short(bounds, says):
    lanes = [{"name": f"l{i}", "max_tokens": b} for i, b in enumerate(bounds)]
    assert refusal(lanes_env(*lanes)).startswith(f"model tiny-llama: {says}")


def test_a_last_lane_bound_that_holds_every_request_is_accepted():
    (m,) = Settings.from_environ(lanes_env({"name": "short", "max_tokens": 64},
                                           {"name": "long", "max_tokens": 2304})).models
    assert [lane.max_tokens for lane in m.lanes] == [64, 2304]
    embed = ModelSpec(name="e", task=Task.EMBED, source="/x", max_input_tokens=512,
                      lanes=(LaneSpec("short", 64), LaneSpec("long", 512)))
    assert embed.validate() is embed  # an embedding request is its input alone
    with pytest.raises(ConfigError, match="up to 512 tokens"):
        dataclasses.replace(embed, lanes=(LaneSpec("short", 64), LaneSpec("long", 511))).validate()


def test_lane_values_of_a_model_built_in_code_are_checked_too():
    for lane in (LaneSpec("a", None, window_ms=-1.0), LaneSpec("a", None, max_backlog=0), LaneSpec("a", 0)):
        with pytest.raises(ConfigError, match="lane a: "):
            ModelSpec(name="m", task=Task.GENERATE, source="/x", lanes=(lane,)).validate()


# --- the model file ------------------------------------------------------------------------------------------------

def test_an_unknown_top_level_key_is_named_with_the_known_ones(tmp_path):
    env = model_file(tmp_path, "model:\n  - {name: m, task: generate, source: /x}\n")
    says = refusal(env)
    assert says.startswith("config file ") and "unknown top-level key 'model' (did you mean models?); known: models" \
        in says
    inline = refusal({"BATCHGATE_CONFIG_YAML": "models:\n  - {name: m, task: embed, source: /x}\nlanes: []\n"})
    assert inline == "BATCHGATE_CONFIG_YAML: unknown top-level key 'lanes'; known: models"


def test_an_empty_model_list_is_refused(tmp_path):
    assert "`models` is empty; list at least one model" in refusal(model_file(tmp_path, "models: []\n"))
    assert refusal({"BATCHGATE_MODELS": " , "}).startswith("BATCHGATE_MODELS=' , ' names no model")
    assert "`models` must be a list" in refusal(model_file(tmp_path, "models: {name: m}\n"))
    # no file, or BATCHGATE_MODELS="" (unset): the built-ins; an empty file is refused (below)
    assert len(Settings.from_environ({}).models) == 2
    assert len(Settings.from_environ({"BATCHGATE_MODELS": ""}).models) == 2


# --- per-model variables reach every model name ---------------------------------------------------------------------

def test_a_model_name_is_written_in_a_variable_upper_case_with_underscores():
    assert env_model_name("tiny-llama") == env_model_name("tiny_llama") == env_model_name("Tiny.Llama") == "TINY_LLAMA"
    assert env_model_name("llama-3.1-8b") == "LLAMA_3_1_8B"


def test_a_variable_reaches_a_model_whose_name_has_underscores_or_dots(tmp_path):
    env = model_file(tmp_path, "models:\n  - {name: my_lm, task: generate, source: /x}\n"
                               "  - {name: llama.3, task: generate, source: /y}\n")
    s = Settings.from_environ({**env, "BATCHGATE_MODEL__MY_LM__MAX_RUNNING": "4",
                               "BATCHGATE_MODEL__LLAMA_3__MAX_RUNNING": "5"})
    assert [(m.name, m.max_running) for m in s.models] == [("my_lm", 4), ("llama.3", 5)]  # no new models


def test_existing_variable_names_keep_working():
    s = Settings.from_environ({"BATCHGATE_MODEL__TINY_LLAMA__MAX_RUNNING": "7",
                               "BATCHGATE_MODEL__NEW_LM__SOURCE": "/m", "BATCHGATE_MODEL__NEW_LM__TASK": "embed"})
    assert s.model("tiny-llama").max_running == 7 and s.model("new-lm").task is Task.EMBED


def test_the_served_model_wins_over_a_built_in_written_alike_and_two_served_ones_are_refused(tmp_path):
    env = model_file(tmp_path, "models:\n  - {name: tiny_llama, task: generate, source: /x}\n")
    s = Settings.from_environ({**env, "BATCHGATE_MODEL__TINY_LLAMA__MAX_RUNNING": "3"})
    assert [(m.name, m.max_running) for m in s.models] == [("tiny_llama", 3)]
    both = model_file(tmp_path, "models:\n  - {name: my-lm, task: generate, source: /x}\n"
                                "  - {name: my_lm, task: generate, source: /y}\n")
    says = refusal({**both, "BATCHGATE_MODEL__MY_LM__MAX_RUNNING": "3"})
    assert says.startswith("BATCHGATE_MODEL__MY_LM__MAX_RUNNING: MY_LM names models my-lm, my_lm alike")


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "{}\n"])
def test_a_model_file_that_defines_no_models_is_refused_not_replaced_by_the_built_ins(tmp_path, text):
    """A mount or secret that came up empty must not serve the random-weight built-ins as if all were well."""
    for env in (model_file(tmp_path, text), {"BATCHGATE_CONFIG_YAML": text}):
        assert "defines no models" in refusal(env), env
    (tmp_path / "empty.toml").write_text("")
    assert "defines no models" in refusal({"BATCHGATE_CONFIG": str(tmp_path / "empty.toml")})
    assert "BATCHGATE_CONFIG is set but empty" in refusal({"BATCHGATE_CONFIG": " "})


@pytest.mark.parametrize("name", ["BATCHGATE_REDIS_URL", "REDIS_URL"])
def test_a_redis_url_set_but_empty_is_refused_not_the_default(name):
    """An unset secret must not point the process at whatever Redis listens on localhost."""
    assert refusal({name: ""}) == f"{name}='' is not a Redis URL: it is set but empty (unset it for the default)"


@pytest.mark.parametrize(("env", "says"), [
    ({"BATCHGATE_LAMBDA_TENANT": ""}, "BATCHGATE_LAMBDA_TENANT: a tenant name must not be empty"),
    ({"BATCHGATE_LAMBDA_TENANT": "a b"}, "BATCHGATE_LAMBDA_TENANT: tenant name 'a b' must have no spaces"),
    ({"BATCHGATE_LAMBDA_TENANT": "x:y"}, "BATCHGATE_LAMBDA_TENANT: tenant name 'x:y' must have no spaces"),
    ({"BATCHGATE_LAMBDA_TENANT": "t" * 129}, "BATCHGATE_LAMBDA_TENANT: a tenant name must be at most 128 characters"),
    ({"BATCHGATE_METRIC_NAMESPACE": ""}, "BATCHGATE_METRIC_NAMESPACE is set but empty"),
    ({"BATCHGATE_DEPLOYMENT": " "}, "BATCHGATE_DEPLOYMENT is set but empty"),
])
def test_names_the_lambda_and_cloudwatch_use_are_checked_at_start(env, says):
    """The SQS Lambda's tenant names Redis keys as any tenant's name does; CloudWatch refuses an empty name."""
    assert refusal(env).startswith(says)
