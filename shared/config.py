"""Configuration: one frozen dataclass per process, built at start-up from an injectable environ.

Models come from a YAML or TOML file (`BATCHGATE_CONFIG`, or the same YAML inline in
`BATCHGATE_CONFIG_YAML` where there is no file system to ship a file in, as on Lambda) and/or
environment variables:
- `BATCHGATE_MODELS=minilm,tiny-llama` picks which models this process serves (built-ins or names
  defined in the file);
- `BATCHGATE_MODEL__<NAME>__<FIELD>=value` sets one field of a model (NAME: its name upper-case, each `-`, `_` or
  `.` as `_`, so `my_lm.v2` is MY_LM_V2; see `env_model_name`),
  and defines a new model when NAME is not known yet, e.g.
  `BATCHGATE_MODEL__MY_LM__SOURCE=/models/my-lm` + `BATCHGATE_MODEL__MY_LM__TASK=generate`.
Nothing here is read at import time.

This module is the one reader of the environment: every `BATCHGATE_*` variable (and `REDIS_URL`)
goes through `Settings.from_environ`, and the rest of the code takes a `Settings`. The exceptions
(`BATCHGATE_FAULTS`, the test-only fault injection that shared/faults.py parses, `BATCHGATE_STATE_DIR`,
the tests' own) are listed in `OTHER_ENV`; `from_environ` warns of a `BATCHGATE_*` variable it does not know.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import secrets
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from shared.config_checks import (
    DEVICE_RE,
    DEVICES_TEXT,
    DTYPES,
    DTYPES_TEXT,
    MODEL_RULES,
    NAME_RE,
    SETTINGS_RULES,
    check_lanes,
    check_number,
    coerce_number,
    env_model_name,
    lane_from,
    resolve_env_model,
    top_level_problem,
)
from shared.errors import ConfigError
from shared.lanes import DEFAULT_LANES, LaneSpec
from shared.states import Task

ENV_PREFIX = "BATCHGATE_"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    task: Task
    source: str
    device: str = "auto"
    dtype: str = "auto"
    lanes: tuple[LaneSpec, ...] = DEFAULT_LANES
    max_batch_size: int = 32  # requests per prefill (generate) or texts per forward (embed)
    max_batch_tokens: int = 8192  # padded tokens per prefill / encoder forward
    max_running: int = 64  # generate: rows in the running decode batch
    # generate: prompt tokens one step may prefill beside decoding rows; a longer prompt is prefilled in
    # chunks of this size, one per step, while the rows keep decoding. 0: never chunk (see docs/scheduling.md)
    prefill_chunk_tokens: int = 512
    # generate: rows the lanes after the first may hold together in the running batch while their queues are not
    # backed up, so short requests' decode steps stay nearer their own cost; 0: no bound (the default: measured on
    # a CPU, 8 took ~11% off short latency but ~30% onto the long tail and ~6% off capacity; docs/scheduling.md)
    long_rows: int = 0
    kv_budget_tokens: int | None = None  # generate: KV cache size in tokens; None = sized from the device
    max_input_tokens: int = 512
    max_new_tokens: int = 512
    default_max_new_tokens: int = 64
    max_texts: int = 64
    # generate: token ids must be below this (input_ids checked at submit); None: the model directory's
    # config.json says, where the gateway can read it (shared.token_limits)
    vocab_size: int | None = None
    # a tokenizer.json (or a directory holding one) the gateway counts tokens with; "": the model's own,
    # where the gateway can find it (shared.token_limits)
    tokenizer: str = ""
    default_timeout_s: float = 60.0
    max_timeout_s: float = 3600.0
    # the shortest timeout accepted: below it no request can finish (a batching window, a forward and two
    # Redis round trips), so it is refused as invalid (422), not as over capacity (429: a retry never helps)
    min_timeout_s: float = 0.005
    # "deadline": EDF lanes, expiry without compute, admission control. "fifo": arrival order, deadlines
    # ignored (the baseline the overload benchmark compares against; not for production).
    scheduling: str = "deadline"
    # "model": weights from `source`. "echo" (generate only): no model at all, the worker's runner echoes the
    # prompt's tokens (gpu_worker/echo_runner.py), so a benchmark measures batchgate itself, not a model
    kind: str = "model"
    step_ms: float = 0.0  # echo: each decode step sleeps this long (0: none), standing in for a forward
    # echo: a cost curve like a real model's on a CPU, for measuring scheduling and admission without a model: a
    # decode step also sleeps this much per row it advances, and a start this much per prompt token it prefills
    step_ms_per_row: float = 0.0
    prefill_ms_per_token: float = 0.0
    # generate: the format its chat answers make tool calls in, which OpenAI's tool_choice "auto" needs read from
    # its text: "hermes" (<tool_call>{"name", "arguments"}</tool_call>: Hermes, Qwen 2.5 and 3); "": none
    tool_call_parser: str = ""  # one of TOOL_CALL_PARSERS
    # generate: a Jinja chat template that renders conversations instead of the tokenizer's own (vLLM's
    # --chat-template): its text (anything holding "{", "}" or a line break), else the path of a file holding it
    chat_template: str = ""
    # generate: a request may bring a chat template of its own (`input.chat_template`, vLLM's request field, which
    # vLLM takes only with --trust-request-chat-template): the worker runs the caller's Jinja (sandboxed, but its
    # loops and strings can take the worker's time and memory), so it is refused unless the model's file trusts
    # its callers with it; the gateway only compiles it (it counts such a conversation by its contents)
    trust_request_chat_template: bool = False

    @property
    def deadline_aware(self) -> bool:
        return self.scheduling == "deadline"


    @property
    def echo(self) -> bool:
        """No model: the echo runner answers (see `kind`)."""
        return self.kind == "echo"

    def lane(self, name: str) -> LaneSpec | None:
        return next((lane for lane in self.lanes if lane.name == name), None)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence a request can make: its prompt plus its new tokens, at most."""
        return self.max_input_tokens + self.max_new_tokens

    @property
    def lane_names(self) -> tuple[str, ...]:
        return tuple(lane.name for lane in self.lanes)

    def validate(self) -> ModelSpec:
        if not NAME_RE.match(self.name):
            raise ConfigError(f"model name {self.name!r}: use lower-case letters, digits, '.', '_' or '-'")
        where = f"model {self.name}"
        for attr, rule in MODEL_RULES.items():
            value = getattr(self, attr)
            if value is not None or attr not in ("vocab_size", "kv_budget_tokens"):
                check_number(where, attr, value, rule)
        longest = (self.max_seq_len, "max_input_tokens + max_new_tokens") if self.task is Task.GENERATE else \
            (self.max_input_tokens, "max_input_tokens")
        check_lanes(self.name, self.lanes, *longest)
        if self.scheduling not in ("deadline", "fifo"):
            raise ConfigError(f"{where}: scheduling must be deadline or fifo, got {self.scheduling!r}")
        if not DEVICE_RE.match(self.device):
            hint = " (a GPU is cuda)" if self.device.lower() == "gpu" else ""
            raise ConfigError(f"{where}: device must be {DEVICES_TEXT}, got {self.device!r}{hint}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"{where}: dtype must be {DTYPES_TEXT}, got {self.dtype!r}")
        self._validate_kind()
        if not self.min_timeout_s < self.default_timeout_s <= self.max_timeout_s:
            raise ConfigError(f"{where}: need 0 <= min_timeout_s < default_timeout_s <= max_timeout_s (got "
                              f"{self.min_timeout_s:g}, {self.default_timeout_s:g}, {self.max_timeout_s:g})")
        return self

    def _validate_kind(self) -> None:
        if self.kind not in ("model", "echo"):
            raise ConfigError(f"model {self.name}: kind must be model or echo, got {self.kind!r}")
        if self.tool_call_parser not in ("", *TOOL_CALL_PARSERS):
            raise ConfigError(f"model {self.name}: tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)} "
                              f"or empty, got {self.tool_call_parser!r}")
        if self.echo and self.task is not Task.GENERATE:
            raise ConfigError(f"model {self.name}: kind echo is a generation model (task: generate)")
        for name in ("chat_template", "trust_request_chat_template"):
            if getattr(self, name) and self.task is not Task.GENERATE:
                raise ConfigError(f"model {self.name}: {name} is for generation models (task: generate)")

    def chat_template_text(self) -> str | None:
        """The model file's chat template (`chat_template`: its text, or read from the file it names, as vLLM reads
        --chat-template); None where it sets none. `ConfigError` where the file cannot be read."""
        value = self.chat_template
        if not value:
            return None
        if any(c in value for c in "{}\n"):
            return value
        path = Path(value).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"model {self.name}: chat_template {value!r} is not a template (it holds no '{{') and "
                              f"not a file that can be read: {exc}") from None

    def to_public(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task.value,
            "kind": self.kind,
            "scheduling": self.scheduling,
            "lanes": [{"name": lane.name, "max_tokens": lane.max_tokens, "window_ms": lane.window_ms,
                       "max_backlog": lane.max_backlog, "max_share": lane.max_share, "engine": lane.engine}
                      for lane in self.lanes],
            "limits": {  # each task's own: new tokens for a generation model, texts per request for an encoder
                "max_input_tokens": self.max_input_tokens,
                **({"max_new_tokens": self.max_new_tokens} if self.task is Task.GENERATE else
                   {"max_texts": self.max_texts}),
                "default_timeout_s": self.default_timeout_s,
                "max_timeout_s": self.max_timeout_s,
            },
        }


# the formats shared.tool_call_formats reads calls in
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "llama4_pythonic")


BUILTIN_MODELS: dict[str, ModelSpec] = {
    "minilm": ModelSpec(
        name="minilm", task=Task.EMBED, source="builtin:minilm",
        lanes=(LaneSpec("short", 64, 5.0), LaneSpec("long", None, 15.0)),
        max_batch_size=64, max_batch_tokens=8192, max_input_tokens=512,
    ),
    "tiny-llama": ModelSpec(
        name="tiny-llama", task=Task.GENERATE, source="builtin:tiny-llama",
        max_input_tokens=2048, max_new_tokens=256, max_batch_tokens=4096, vocab_size=8192,
    ),
    "bench-llama": ModelSpec(
        name="bench-llama", task=Task.GENERATE, source="builtin:bench-llama",
        max_input_tokens=2048, max_new_tokens=256, max_batch_tokens=4096, vocab_size=8192,
    ),
}
DEFAULT_MODELS = ("minilm", "tiny-llama")


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# Every BATCHGATE_* variable batchgate reads; `from_environ` warns of any other (a typo, MAXWAIT_S for
# MAX_WAIT_S say, would otherwise be ignored without a word). Add a setting here when you add it below
# (tests/unit/test_config.py checks every name the repository writes is here).
SETTINGS_ENV = frozenset(ENV_PREFIX + name for name in (
    "REDIS_URL", "KEY_PREFIX", "REDIS_WAIT_REPLICAS", "REDIS_WAIT_MS", "HOST", "PORT", "RESULT_TTL_S", "MAX_BODY_BYTES",
    "BODY_TIMEOUT_S", "HEADER_TIMEOUT_S", "SHUTDOWN_GRACE_S", "MAX_WAIT_S", "EXPIRY_GRACE_S", "KEEP_ALIVE_S",
    "LOG_LEVEL", "LOG_FORMAT", "WORKER_NAME", "WORKER_METRICS_PORT", "INTAKE_BLOCK_MS", "RECLAIM_IDLE_S",
    "MAX_DELIVERIES", "DRAIN_BUDGET_S", "TORCH_THREADS", "CPU_ENGINES", "AUTH", "TENANT_RATE_PER_S", "TENANT_BURST",
    "TENANT_MAX_BACKLOG", "MAX_BATCH_ITEMS", "CALLBACK_ALLOW", "CALLBACK_MAX_ATTEMPTS", "CALLBACK_BASE_S",
    "CALLBACK_CAP_S", "CALLBACK_CONNECT_TIMEOUT_S", "CALLBACK_TIMEOUT_S", "CALLBACK_LEASE_S", "MODEL_CACHE",
    "WEBHOOK_SECRET", "DISPATCHER_METRICS_PORT", "LAMBDA_TENANT", "LAMBDA_MARGIN_S", "METRIC_NAMESPACE", "DEPLOYMENT",
    "CLOUDWATCH_ENDPOINT", "FILES_DIR", "FILES_S3_BUCKET", "FILES_S3_PREFIX", "FILES_S3_ENDPOINT", "MAX_FILE_BYTES",
    "MAX_FILE_LINES",
    "CONFIG", "CONFIG_YAML", "MODELS",  # load_models; BATCHGATE_MODEL__<NAME>__<FIELD> too (env_model_overrides)
))
# ... and the ones read elsewhere, which `from_environ` leaves alone
OTHER_ENV = frozenset(ENV_PREFIX + name for name in (
    "FAULTS",  # shared/faults.py: test-only fault injection
    "STATE_DIR",  # batchgate/state.py: where `batchgate up` leaves word of itself
    "API_KEY",  # scripts/chaos.py
    # the tests' own
    "TEST_REDIS", "TEST_REDIS_URL", "FAST_TIER", "FUZZ_EXAMPLES", "FUZZ_REPORT", "FAULTS_REPORT", "TF_PLUGIN_DIR",
    "TEST_DEVICE",
))
KNOWN_ENV = SETTINGS_ENV | OTHER_ENV
_warned_env: set[str] = set()


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """The BATCHGATE_* variables in `env` that nothing reads (sorted)."""
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in KNOWN_ENV
                  and not k.startswith(ENV_PREFIX + "MODEL__"))


def warn_unknown_env(env: Mapping[str, str]) -> None:
    """A warning (once per process and name) for each BATCHGATE_* variable that nothing reads."""
    for name in unknown_env(env):
        if name not in _warned_env:
            _warned_env.add(name)
            close = difflib.get_close_matches(name, sorted(KNOWN_ENV), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            logging.getLogger("batchgate.config").warning(
                "batchgate: warning: unknown setting %s is ignored%s", name, hint)


def shown_url(url: str) -> str:
    """A Redis URL as messages and banners show it: its password (and any `password=` in its query) as `***`, so a
    terminal, a log or a support ticket never holds it."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]  # the path and query (`?password=` is a password too)
    creds, at, host = netloc.rpartition("@")
    if at:
        user, colon, _ = creds.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"***@{host}"  # a lone part before @ is a password to redis-py
    tail = re.sub(r"(?i)(password=)[^&]*", r"\1***", tail)
    return f"{scheme}{sep}{netloc}{tail}"


def redis_url_problem(url: str) -> str | None:
    """What is wrong with `url` as a Redis URL, or None when redis-py can use it (a cluster URL included)."""
    from redis.connection import parse_url

    scheme, sep, rest = url.partition("://")
    plain = scheme.lower().removesuffix("+cluster")
    if not sep or plain not in ("redis", "rediss", "unix"):
        return "it must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://"
    try:
        parse_url(f"{plain}://{rest}")
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "bg"
    # durable writes: a submit is answered, and a result counts as written, only once Redis replicated it to this
    # many replicas (WAIT), within redis_wait_ms; 0: Redis' asynchronous replication (a failover can lose the
    # last writes; see docs/reliability.md)
    redis_wait_replicas: int = 0
    redis_wait_ms: int = 1000
    host: str = "127.0.0.1"
    port: int = 8000
    result_ttl_s: int = 3600
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request body must arrive whole within this (else 408, connection closed)
    header_timeout_s: float = 10.0  # ... and its headers within this of the request's first byte (or the connect)
    # an idle keep-alive connection is closed after this: longer than the clients' and load balancers' own idle
    # limits (httpx 5 s, an AWS ALB 60 s), so they close first and never reuse a connection as it is closed
    keep_alive_s: float = 75.0
    # gateway SIGTERM: waits and event streams in flight go on (their results may still come) for this long
    # less 2 s, then answer what they have (a stream: an `error` event to reconnect), and the gateway exits
    shutdown_grace_s: float = 10.0
    max_wait_s: float = 60.0
    expiry_grace_s: float = 2.0
    log_level: str = "info"
    log_format: str = "auto"  # json | console | auto (console on a TTY)
    worker_name: str = ""
    worker_metrics_port: int = 9464  # 0 disables the worker's /metrics listener
    intake_block_ms: int = 1000
    reclaim_idle_s: float = 30.0  # an entry idle this long belongs to a dead worker and is reclaimed
    max_deliveries: int = 3  # deliveries after which an entry is dead-lettered (it keeps killing workers)
    drain_budget_s: float = 30.0  # SIGTERM: time to finish in-flight work before handing it back
    # CPU only: torch threads per compute thread; 0 = automatic (one thread may grow a pool: see CpuShare)
    torch_threads: int = 0
    # CPU only: a model's lane engines take turns on one compute thread ("shared") or run side by side
    # on threads of their own, splitting the cores ("parallel")
    cpu_engines: str = "shared"
    auth: str = "api_key"  # "api_key" | "off" (local use only; logged loudly)
    tenant_rate_per_s: float = 0.0  # default per-tenant submit rate (0: unlimited); per tenant: batchgate tenants
    tenant_burst: int = 0
    tenant_max_backlog: int = 0  # default per-tenant queued+running cap (0: unlimited)
    max_batch_items: int = 100  # inputs per POST .../requests:batch
    callback_allow: str = ""  # hosts and networks webhooks may target although not public (SSRF allow-list)
    callback_max_attempts: int = 10
    callback_base_s: float = 20.0  # first retry after ~base, doubling (with jitter) up to the cap
    callback_cap_s: float = 3600.0  # 10 attempts with these defaults span about 2 hours
    callback_connect_timeout_s: float = 3.0
    callback_timeout_s: float = 10.0  # total time for one attempt
    callback_lease_s: float = 60.0  # a dispatcher that dies mid-attempt gives the delivery back after this
    models: tuple[ModelSpec, ...] = field(default_factory=lambda: tuple(BUILTIN_MODELS[n] for n in DEFAULT_MODELS))
    model_cache_dir: str = ""
    # the webhook dispatcher (`batchgate callbacks`)
    webhook_secret: str = field(default="", repr=False)  # signing secret of tenants that have none
    dispatcher_metrics_port: int = 9465  # 0 disables the dispatcher's /metrics listener
    # the Lambda adapters (gateway/lambda_handler.py, gateway/scaling_handler.py)
    lambda_tenant: str = "default"  # the tenant direct and SQS invocations act for, unless they carry a key
    lambda_margin_s: float = 0.5  # a direct invocation without a timeout: its remaining time minus this
    metric_namespace: str = "batchgate"  # CloudWatch namespace of the backlog metric
    deployment: str = ""  # its Deployment dimension (from_environ: the key prefix unless set)
    cloudwatch_endpoint: str = ""  # empty: the AWS default
    # the file store of the Files and Batch APIs (shared/files.py): S3 when a bucket is named, else a directory
    files_dir: str = ""  # empty: default_files_dir() ($XDG_DATA_HOME/batchgate/files)
    files_s3_bucket: str = ""
    files_s3_prefix: str = ""  # prepended to every object key, e.g. "files/"
    files_s3_endpoint: str = ""  # empty: the AWS default (tests: a moto server; or an S3-compatible store)
    max_file_bytes: int = 200 << 20  # one uploaded file (OpenAI's batch input limit is 200 MB)
    max_file_lines: int = 50_000  # lines of one uploaded file (OpenAI's requests per batch)

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        warn_unknown_env(env)
        get = env.get
        d = cls(models=())

        def parsed(name: str, default: Any, kind: type) -> Any:
            raw = get(ENV_PREFIX + name)
            try:
                return default if raw is None else kind(raw)
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise ConfigError(f"{ENV_PREFIX}{name}={raw!r} is not {what}") from None

        def integer(name: str, default: int) -> int:
            return int(parsed(name, default, int))

        def number(name: str, default: float) -> float:
            return float(parsed(name, default, float))

        redis_url = redis_url_from(env)
        if redis_url is not None:
            problem = (redis_url_problem(redis_url) if redis_url.strip()
                       else "it is set but empty (unset it for the default)")
            if problem:
                source = ENV_PREFIX + "REDIS_URL" if get(ENV_PREFIX + "REDIS_URL") is not None else "REDIS_URL"
                raise ConfigError(f"{source}={shown_url(redis_url)!r} is not a Redis URL: {problem}")
        for name in ("METRIC_NAMESPACE", "DEPLOYMENT"):  # a CloudWatch name: never empty
            if (value := get(ENV_PREFIX + name)) is not None and not value.strip():
                raise ConfigError(f"{ENV_PREFIX}{name} is set but empty: CloudWatch needs a name (unset it for the "
                                  "default)")
        cache_dir = get(ENV_PREFIX + "MODEL_CACHE") or str(Path.home() / ".cache" / "batchgate" / "models")
        key_prefix = get(ENV_PREFIX + "KEY_PREFIX", d.key_prefix)
        try:
            models = load_models(env)
            return cls(
                redis_url=redis_url or d.redis_url,
                key_prefix=key_prefix,
                redis_wait_replicas=integer("REDIS_WAIT_REPLICAS", d.redis_wait_replicas),
                redis_wait_ms=integer("REDIS_WAIT_MS", d.redis_wait_ms),
                host=get(ENV_PREFIX + "HOST", d.host),
                port=integer("PORT", d.port),
                result_ttl_s=integer("RESULT_TTL_S", d.result_ttl_s),
                max_body_bytes=integer("MAX_BODY_BYTES", d.max_body_bytes),
                body_timeout_s=number("BODY_TIMEOUT_S", d.body_timeout_s),
                header_timeout_s=number("HEADER_TIMEOUT_S", d.header_timeout_s),
                keep_alive_s=number("KEEP_ALIVE_S", d.keep_alive_s),
                shutdown_grace_s=number("SHUTDOWN_GRACE_S", d.shutdown_grace_s),
                max_wait_s=number("MAX_WAIT_S", d.max_wait_s),
                expiry_grace_s=number("EXPIRY_GRACE_S", d.expiry_grace_s),
                log_level=get(ENV_PREFIX + "LOG_LEVEL", d.log_level).lower(),
                log_format=get(ENV_PREFIX + "LOG_FORMAT", d.log_format).lower(),
                # unique per start: a restarted container with the same host name and pid 1 must not inherit
                # the pending entries of its previous life as if they were its own
                worker_name=get(ENV_PREFIX + "WORKER_NAME")
                or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}",
                worker_metrics_port=integer("WORKER_METRICS_PORT", d.worker_metrics_port),
                intake_block_ms=integer("INTAKE_BLOCK_MS", d.intake_block_ms),
                reclaim_idle_s=number("RECLAIM_IDLE_S", d.reclaim_idle_s),
                max_deliveries=integer("MAX_DELIVERIES", d.max_deliveries),
                drain_budget_s=number("DRAIN_BUDGET_S", d.drain_budget_s),
                torch_threads=integer("TORCH_THREADS", d.torch_threads),
                cpu_engines=get(ENV_PREFIX + "CPU_ENGINES", d.cpu_engines).lower(),
                auth=get(ENV_PREFIX + "AUTH", d.auth).lower(),
                tenant_rate_per_s=number("TENANT_RATE_PER_S", d.tenant_rate_per_s),
                tenant_burst=integer("TENANT_BURST", d.tenant_burst),
                tenant_max_backlog=integer("TENANT_MAX_BACKLOG", d.tenant_max_backlog),
                max_batch_items=integer("MAX_BATCH_ITEMS", d.max_batch_items),
                callback_allow=get(ENV_PREFIX + "CALLBACK_ALLOW", d.callback_allow),
                callback_max_attempts=integer("CALLBACK_MAX_ATTEMPTS", d.callback_max_attempts),
                callback_base_s=number("CALLBACK_BASE_S", d.callback_base_s),
                callback_cap_s=number("CALLBACK_CAP_S", d.callback_cap_s),
                callback_connect_timeout_s=number("CALLBACK_CONNECT_TIMEOUT_S", d.callback_connect_timeout_s),
                callback_timeout_s=number("CALLBACK_TIMEOUT_S", d.callback_timeout_s),
                callback_lease_s=number("CALLBACK_LEASE_S", d.callback_lease_s),
                models=models,
                model_cache_dir=cache_dir,
                webhook_secret=get(ENV_PREFIX + "WEBHOOK_SECRET", d.webhook_secret),
                dispatcher_metrics_port=integer("DISPATCHER_METRICS_PORT", d.dispatcher_metrics_port),
                lambda_tenant=get(ENV_PREFIX + "LAMBDA_TENANT", d.lambda_tenant),
                lambda_margin_s=number("LAMBDA_MARGIN_S", d.lambda_margin_s),
                metric_namespace=get(ENV_PREFIX + "METRIC_NAMESPACE", d.metric_namespace),
                deployment=get(ENV_PREFIX + "DEPLOYMENT", key_prefix),
                cloudwatch_endpoint=get(ENV_PREFIX + "CLOUDWATCH_ENDPOINT", d.cloudwatch_endpoint),
                files_dir=get(ENV_PREFIX + "FILES_DIR") or default_files_dir(env),
                files_s3_bucket=get(ENV_PREFIX + "FILES_S3_BUCKET", d.files_s3_bucket),
                files_s3_prefix=get(ENV_PREFIX + "FILES_S3_PREFIX", d.files_s3_prefix),
                files_s3_endpoint=get(ENV_PREFIX + "FILES_S3_ENDPOINT", d.files_s3_endpoint),
                max_file_bytes=integer("MAX_FILE_BYTES", d.max_file_bytes),
                max_file_lines=integer("MAX_FILE_LINES", d.max_file_lines),
            ).validate()
        except (ValueError, TypeError) as exc:  # a value no check above foresaw: still one line, no traceback
            raise ConfigError(f"invalid setting: {' '.join(str(exc).split())}") from None

    def validate(self) -> Settings:
        if not re.match(r"^[A-Za-z0-9_.-]{1,32}$", self.key_prefix):
            raise ConfigError(f"{ENV_PREFIX}KEY_PREFIX must be 1-32 letters, digits, '_', '.' or '-' "
                              f"(got {self.key_prefix!r})")
        from shared.tenants import tenant_name_problem

        if problem := tenant_name_problem(self.lambda_tenant):  # it names keys in Redis, as any tenant's name
            raise ConfigError(f"{ENV_PREFIX}LAMBDA_TENANT: {problem}")
        for name, attr, rule in SETTINGS_RULES:  # each refusal names the variable, its range and the value it got
            problem = rule.problem(getattr(self, attr))
            if problem:
                raise ConfigError(f"{ENV_PREFIX}{name} {problem}")
        if self.callback_lease_s <= self.callback_timeout_s:  # else a slow attempt is started again meanwhile
            raise ConfigError(f"{ENV_PREFIX}CALLBACK_LEASE_S must be > {ENV_PREFIX}CALLBACK_TIMEOUT_S (got "
                              f"{self.callback_lease_s:g} <= {self.callback_timeout_s:g}): another dispatcher "
                              "takes a delivery over when its lease ends, even mid-attempt")
        if self.cpu_engines not in ("shared", "parallel"):
            raise ConfigError(f"BATCHGATE_CPU_ENGINES must be shared or parallel (got {self.cpu_engines!r})")
        if self.auth not in ("api_key", "off"):
            raise ConfigError(f"BATCHGATE_AUTH must be api_key or off (got {self.auth!r})")
        self._validate_logging()
        self._validate_webhook_secret()
        from shared.ssrf import AllowList  # stdlib only: no cycle

        try:
            AllowList.parse(self.callback_allow)
        except ValueError as exc:
            raise ConfigError(f"BATCHGATE_CALLBACK_ALLOW: {exc}") from exc
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ConfigError(f"model names must be unique, got {names}")
        return self

    def _validate_webhook_secret(self) -> None:
        """A default signing secret that Standard Webhooks cannot read would fail every delivery it signs."""
        if not self.webhook_secret:
            return
        from shared.webhooks import sign_headers

        try:
            sign_headers((self.webhook_secret,), "msg_check", "")
        except Exception as exc:
            raise ConfigError(f"{ENV_PREFIX}WEBHOOK_SECRET must be base64, optionally after `whsec_`, as Standard "
                              "Webhooks secrets are (e.g. `whsec_` and the base64 of 24 random bytes): this one does "
                              f"not decode ({type(exc).__name__})") from None

    def _validate_logging(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"BATCHGATE_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in ("json", "console", "auto"):
            raise ConfigError(f"BATCHGATE_LOG_FORMAT must be json, console or auto, got {self.log_format!r}")


def default_files_dir(env: Mapping[str, str]) -> str:
    """Where uploaded files live without `BATCHGATE_FILES_DIR` (and without an S3 bucket):
    `$XDG_DATA_HOME/batchgate/files`, else `~/.local/share/batchgate/files`."""
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "batchgate" / "files")


def redis_url_from(env: Mapping[str, str]) -> str | None:
    """The Redis URL an environment names (`BATCHGATE_REDIS_URL`, else `REDIS_URL`), or None when it names none. A
    variable set but empty names one, which is refused (`redis_url_problem`): an unset secret must not point a
    process at whatever Redis listens on this machine."""
    for name in (ENV_PREFIX + "REDIS_URL", "REDIS_URL"):
        if env.get(name) is not None:
            return env[name]
    return None


# --- model configuration -------------------------------------------------------------------------

_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(ModelSpec)}


def _coerce(where: str, model: str, name: str, value: Any) -> Any:
    """One field of a model from the file or the environment (`where` names it: `model NAME` or the variable)."""
    if name not in _FIELD_TYPES:
        known = ", ".join(sorted(_FIELD_TYPES))
        raise ConfigError(f"{where}: unknown field {name!r}; known: {known}")
    if name == "lanes":
        return _lanes(where, value)
    if name == "task":
        try:
            return Task(str(value))
        except ValueError as exc:
            raise ConfigError(f"{where}: task must be generate or embed, got {value!r}") from exc
    kind = str(_FIELD_TYPES[name])
    if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null", "auto") and "None" in kind):
        if "None" in kind:
            return None
        raise ConfigError(f"{where}: {name} needs a value")
    if name in MODEL_RULES:
        return coerce_number(where, name, value, MODEL_RULES[name])
    if kind == "bool":
        return _flag(where, name, value)
    if isinstance(value, Mapping | list | bool):
        raise ConfigError(f"{where}: {name} must be a string, got {value!r}")
    return str(value)


def _lanes(where: str, value: Any) -> tuple[LaneSpec, ...]:
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: lanes do not parse as YAML or JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(value, list):
        raise ConfigError(f"{where}: lanes must be a list of lanes, got {value!r}")
    return tuple(lane_from(lane, where) for lane in value)


FLAGS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _flag(where: str, name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str | int) and str(value).strip().lower() in FLAGS:
        return FLAGS[str(value).strip().lower()]
    raise ConfigError(f"{where}: {name} must be true or false, got {value!r}")


def _spec_from(name: str, fields: Mapping[str, Any], base: ModelSpec | None,
               where: Mapping[str, str] | None = None) -> ModelSpec:
    """A model from its fields (over `base`, a model of that name already known); `where`: each field's setting
    as a refusal names it (the environment's variables), else `model NAME`."""
    values = {k: _coerce((where or {}).get(k, f"model {name}"), name, k, v) for k, v in fields.items() if k != "name"}
    if base is not None:
        return replace(base, name=name, **values)
    if values.get("kind") == "echo":  # no weights to load: nothing to name
        values.setdefault("source", "")
    missing = {"task", "source"} - set(values)
    if missing:
        raise ConfigError(f"model {name}: {', '.join(sorted(missing))} required for a model that is not built in")
    return ModelSpec(name=name, **values)


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from exc
    return parse_config(text, toml=p.suffix == ".toml", where=f"config file {p}")


def parse_config(text: str, *, toml: bool = False, where: str = "config") -> dict[str, Any]:
    try:
        data = tomllib.loads(text) if toml else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{where} does not parse: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: top level must be a mapping")
    return data


def env_model_overrides(env: Mapping[str, str]) -> dict[str, dict[str, tuple[str, str]]]:
    """`BATCHGATE_MODEL__<NAME>__<FIELD>=value` variables: {NAME as written: {field: (variable, value)}}."""
    overrides: dict[str, dict[str, tuple[str, str]]] = {}
    for key, value in sorted(env.items()):
        if key.startswith(ENV_PREFIX + "MODEL__"):
            parts = key[len(ENV_PREFIX + "MODEL__"):].split("__")
            if len(parts) != 2 or not all(parts):
                raise ConfigError(f"{key}: expected BATCHGATE_MODEL__<NAME>__<FIELD> (NAME: the model's name in "
                                  "upper case, each '-', '_' or '.' as '_')")
            overrides.setdefault(env_model_name(parts[0]), {})[parts[1].lower()] = (key, value)
    return overrides


def _file_models(data: Mapping[str, Any], where: str, known: dict[str, ModelSpec]) -> list[str]:
    """The models a model file defines (added to `known`), in its order; its top level must be `models:`, a
    list of at least one model."""
    problem = top_level_problem(data, where)
    if problem:
        raise ConfigError(problem)
    if "models" not in data:  # an empty file (a mount or secret that came up empty): never the built-ins in its place
        raise ConfigError(f"{where} defines no models: its top level must be `models:`, a list of at least one "
                          f"model (to serve the built-ins {', '.join(DEFAULT_MODELS)}, set no model file)")
    entries = data["models"]
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: `models` must be a list of models, got {type(entries).__name__}")
    if not entries:
        raise ConfigError(f"{where}: `models` is empty; list at least one model (without the key, the built-ins "
                          f"{', '.join(DEFAULT_MODELS)} are served)")
    names = []
    for entry in entries:
        if not isinstance(entry, Mapping) or "name" not in entry:
            raise ConfigError(f"{where}: every model needs a name (got {entry!r})")
        name = str(entry["name"])
        known[name] = _spec_from(name, entry, known.get(name))
        names.append(name)
    return names


def load_models(env: Mapping[str, str]) -> tuple[ModelSpec, ...]:
    """Built-ins, then the config file, then `BATCHGATE_MODEL__*` overrides; `BATCHGATE_MODELS` selects."""
    known: dict[str, ModelSpec] = dict(BUILTIN_MODELS)
    selected: list[str] = list(DEFAULT_MODELS)
    path = env.get(ENV_PREFIX + "CONFIG")
    inline = env.get(ENV_PREFIX + "CONFIG_YAML")  # for Lambdas, which have no file to ship it in
    if path is not None and inline is not None:
        raise ConfigError(f"set {ENV_PREFIX}CONFIG or {ENV_PREFIX}CONFIG_YAML, not both")
    if path is not None and not path.strip():
        raise ConfigError(f"{ENV_PREFIX}CONFIG is set but empty: give the model file's path, or unset it to serve "
                          f"the built-ins {', '.join(DEFAULT_MODELS)}")
    if path or inline is not None:
        data = read_config_file(path) if path else parse_config(inline or "", where=ENV_PREFIX + "CONFIG_YAML")
        selected = _file_models(data, f"config file {path}" if path else ENV_PREFIX + "CONFIG_YAML", known)
    for written, fields in env_model_overrides(env).items():
        variables = {f: var for f, (var, _) in fields.items()}
        name = resolve_env_model(written, known, selected, next(iter(variables.values())))
        known[name] = _spec_from(name, {f: v for f, (_, v) in fields.items()}, known.get(name), variables)
        if name not in selected:
            selected.append(name)
    if env.get(ENV_PREFIX + "MODELS"):
        selected = [n.strip() for n in env[ENV_PREFIX + "MODELS"].split(",") if n.strip()]
        if not selected:
            raise ConfigError(f"{ENV_PREFIX}MODELS={env[ENV_PREFIX + 'MODELS']!r} names no model; give "
                              "comma-separated model names, or unset it to serve the configured models")
    missing = [n for n in selected if n not in known]
    if missing:
        raise ConfigError(f"unknown model(s) {missing}; known: {sorted(known)}")
    return tuple(known[n].validate() for n in selected)


# The built-in models' chat template (set at load too, over the one a cache built before it holds): the tools
# the model may call as JSON, then each message on its own turn (with the calls an assistant's made), then the
# assistant's turn to speak.
SIMPLE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}{{ '\\n' }}{% endfor %}"  # not trimmed
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
