"""The rules a configuration is checked against: the range each numeric setting accepts, a model's lanes, the
model file's top level, and how a model's name is written in an environment variable.

Pure (no I/O, nothing read at import). shared/config.py applies them; each refusal is one line that names the
setting (the variable, or the model-file field) and what it accepts, with the value it got.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared.errors import ConfigError
from shared.lanes import LaneSpec

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")  # a model's or a lane's name


def shown(value: Any) -> str:
    """A value as a refusal quotes it: 3 for 3.0, 0.5, nan, inf; a string (from a file) quoted."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return repr(value)
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _bound(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


@dataclass(frozen=True, slots=True)
class Rule:
    """A numeric setting's accepted range: `low` (exclusive when `strict`) up to `high` (exclusive when
    `high_open`); `whole`: integers only; `note`: what a special value means ("0: no rate limit")."""

    low: float
    strict: bool = False
    high: float | None = None
    high_open: bool = False
    whole: bool = False
    note: str = ""

    def range_text(self) -> str:
        if self.high is None:
            return f"{'>' if self.strict else '>='} {_bound(self.low)}"
        if not self.strict and not self.high_open:
            return f"between {_bound(self.low)} and {_bound(self.high)}"
        opening, closing = "(" if self.strict else "[", ")" if self.high_open else "]"
        return f"in {opening}{_bound(self.low)}, {_bound(self.high)}{closing}"

    def text(self, *, kind: bool = False) -> str:
        """What the rule accepts: '>= 0', or with `kind` 'a whole number >= 1' / 'a number > 0'."""
        return f"{'a whole number' if self.whole else 'a number'} {self.range_text()}" if kind else self.range_text()

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):  # NaN compares false both ways; an infinity is no duration or size
            return False
        above = value > self.low if self.strict else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def problem(self, value: Any, *, kind: bool = False) -> str | None:
        """'must be >= 0 (got -1)' (and the note), or None when `value` is in range."""
        if isinstance(value, bool) or not isinstance(value, int | float) or (self.whole and not isinstance(value, int)):
            return f"must be {self.text(kind=True)} (got {shown(value)}){self.note_text()}"
        if self.holds(value):
            return None
        wanted = self.text(kind=kind) if math.isfinite(value) else f"a finite number {self.range_text()}"
        return f"must be {wanted} (got {shown(value)}){self.note_text()}"

    def note_text(self) -> str:
        return f"; {self.note}" if self.note else ""


PORT = Rule(0, high=65535, whole=True)

# (variable without BATCHGATE_, Settings attribute, rule): every numeric setting (tests/unit/test_config_validation.py
# checks none is missing)
SETTINGS_RULES: tuple[tuple[str, str, Rule], ...] = (
    ("REDIS_WAIT_REPLICAS", "redis_wait_replicas", Rule(0, whole=True, note="0: Redis' asynchronous replication")),
    ("REDIS_WAIT_MS", "redis_wait_ms", Rule(1, whole=True)),
    ("PORT", "port", Rule(0, high=65535, whole=True, note="0: `batchgate up` picks a free port")),
    ("RESULT_TTL_S", "result_ttl_s", Rule(1, whole=True)),
    ("MAX_BODY_BYTES", "max_body_bytes", Rule(1024, whole=True)),
    ("BODY_TIMEOUT_S", "body_timeout_s", Rule(0, strict=True)),
    ("HEADER_TIMEOUT_S", "header_timeout_s", Rule(0, strict=True)),
    ("KEEP_ALIVE_S", "keep_alive_s", Rule(0, strict=True)),
    ("SHUTDOWN_GRACE_S", "shutdown_grace_s", Rule(0)),
    ("MAX_WAIT_S", "max_wait_s", Rule(0)),
    ("EXPIRY_GRACE_S", "expiry_grace_s", Rule(0)),
    ("WORKER_METRICS_PORT", "worker_metrics_port", Rule(0, high=65535, whole=True, note="0: no /metrics listener")),
    # Redis reads with BLOCK 0 would wait for ever
    ("INTAKE_BLOCK_MS", "intake_block_ms", Rule(1, whole=True)),
    ("RECLAIM_IDLE_S", "reclaim_idle_s", Rule(0, strict=True)),
    ("MAX_DELIVERIES", "max_deliveries", Rule(1, whole=True)),
    ("DRAIN_BUDGET_S", "drain_budget_s", Rule(0)),
    ("TORCH_THREADS", "torch_threads", Rule(0, whole=True, note="0: automatic")),
    ("TENANT_RATE_PER_S", "tenant_rate_per_s", Rule(0, note="0: no rate limit")),
    ("TENANT_BURST", "tenant_burst", Rule(0, whole=True, note="0: the rate, rounded up")),
    ("TENANT_MAX_BACKLOG", "tenant_max_backlog", Rule(0, whole=True, note="0: no quota")),
    ("MAX_BATCH_ITEMS", "max_batch_items", Rule(1, whole=True)),
    ("CALLBACK_MAX_ATTEMPTS", "callback_max_attempts", Rule(1, whole=True)),
    ("CALLBACK_BASE_S", "callback_base_s", Rule(0, strict=True)),
    ("CALLBACK_CAP_S", "callback_cap_s", Rule(0, strict=True)),
    ("CALLBACK_CONNECT_TIMEOUT_S", "callback_connect_timeout_s", Rule(0, strict=True)),
    ("CALLBACK_TIMEOUT_S", "callback_timeout_s", Rule(0, strict=True)),
    ("CALLBACK_LEASE_S", "callback_lease_s", Rule(0, strict=True)),
    ("DISPATCHER_METRICS_PORT", "dispatcher_metrics_port",
     Rule(0, high=65535, whole=True, note="0: no /metrics listener")),
    ("LAMBDA_MARGIN_S", "lambda_margin_s", Rule(0)),
    ("MAX_FILE_BYTES", "max_file_bytes", Rule(1, whole=True)),
    ("MAX_FILE_LINES", "max_file_lines", Rule(1, whole=True)),
)

# a model's numeric fields (as the model file and BATCHGATE_MODEL__<NAME>__<FIELD> name them)
_AT_LEAST_1 = Rule(1, whole=True)
_SLEEP_MS = Rule(0, high=60_000, high_open=True)
MODEL_RULES: dict[str, Rule] = {
    "max_batch_size": _AT_LEAST_1, "max_batch_tokens": _AT_LEAST_1, "max_running": _AT_LEAST_1,
    "max_input_tokens": _AT_LEAST_1, "max_new_tokens": _AT_LEAST_1, "default_max_new_tokens": _AT_LEAST_1,
    "max_texts": _AT_LEAST_1,
    "vocab_size": Rule(1, whole=True, note="null: read from the model's config.json"),
    "kv_budget_tokens": Rule(1, whole=True, note="null: sized from the device"),
    "prefill_chunk_tokens": Rule(0, whole=True, note="0: never chunk"),
    "long_rows": Rule(0, whole=True, note="0: no bound"),
    "min_timeout_s": Rule(0), "default_timeout_s": Rule(0, strict=True), "max_timeout_s": Rule(0, strict=True),
    "step_ms": _SLEEP_MS, "step_ms_per_row": _SLEEP_MS, "prefill_ms_per_token": _SLEEP_MS,
}
LANE_RULES: dict[str, Rule] = {
    "max_tokens": Rule(1, whole=True, note="unset: open (the last lane)"),
    "window_ms": Rule(0),
    "max_backlog": Rule(1, whole=True),
    "max_share": Rule(0, strict=True, high=1),
}
# a lane's fields as LaneSpec defaults them; without max_tokens, a lane is open
LANE_DEFAULTS: dict[str, Any] = {"max_tokens": None, **{f.name: f.default for f in dataclasses.fields(LaneSpec)
                                                        if f.default is not dataclasses.MISSING}}

# what `device` may name (the worker checks at start that the host has it); `gpu` is not torch's name for it
DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
DEVICES_TEXT = "auto (CUDA when present, else CPU), cpu, cuda, cuda:<index> or mps"
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPES_TEXT = "auto (bf16/fp16 on CUDA, fp32 on CPU), float32, float16 or bfloat16"


def _parsed(value: Any, parse: Callable[[str], int | float]) -> int | float | None:
    """`value` if it is a number (a bool is not), a string `parse` reads, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            return parse(value.strip())
        except ValueError:
            return None
    return value if isinstance(value, int | float) else None


def as_whole(value: Any) -> int | None:
    """`value` as an integer when it is one (3, 3.0, "3"), else None (3.7, True, "three")."""
    number = _parsed(value, int)
    if isinstance(number, float):
        return int(number) if number.is_integer() else None
    return number


def as_number(value: Any) -> float | None:
    """`value` as a float when it is a number (3, 0.5, "0.5"), else None (True, "fast", a list)."""
    number = _parsed(value, float)
    return None if number is None else float(number)


def coerce_number(where: str, field: str, value: Any, rule: Rule) -> int | float:
    """A model or lane field's value as its type, or a ConfigError naming the field and its range."""
    number = as_whole(value) if rule.whole else as_number(value)
    if number is None:
        raise ConfigError(f"{where}: {field} must be {rule.text(kind=True)} (got {shown(value)}){rule.note_text()}")
    return number


def check_number(where: str, field: str, value: Any, rule: Rule) -> None:
    problem = rule.problem(value, kind=True)
    if problem:
        raise ConfigError(f"{where}: {field} {problem}")


# --- lanes -----------------------------------------------------------------------------------------------------

def lane_from(raw: Any, where: str) -> LaneSpec:
    """One lane of a model file or `BATCHGATE_MODEL__<NAME>__LANES` (`where`: `model NAME` or the variable); a
    field of the wrong type or out of range is a ConfigError naming the model, the lane and the field."""
    if not isinstance(raw, Mapping) or "name" not in raw:
        raise ConfigError(f"{where}: each lane needs at least a name (got {raw!r})")
    where = f"{where}: lane {raw['name']}"
    known = ("name", *LANE_DEFAULTS)
    unknown = sorted(set(raw) - set(known), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown lane field(s) {unknown}; known: {', '.join(known)}")
    values = {**LANE_DEFAULTS, **{k: v for k, v in raw.items() if k != "name"}}
    for field, rule in LANE_RULES.items():
        if field in values and not (field == "max_tokens" and values[field] is None):
            values[field] = coerce_number(where, field, values[field], rule)
    values["engine"] = str(values["engine"])
    return LaneSpec(name=str(raw["name"]), **values)


def check_lanes(model: str, lanes: Sequence[LaneSpec], longest: int, longest_text: str) -> None:
    """A model's lanes: names, engines, each lane's values, and their bounds. Every lane but the last needs a
    bound, each above the one before (a request goes to the first lane whose bound holds it, so a lane bounded
    at or below an earlier one would get nothing). The last lane takes every request longer than the lane before
    it, whatever its own bound: a bound on it below the longest request the model takes (`longest`) would be
    ignored, and would size its engine's KV cache too short, so it must be unset (open) or at least `longest`."""
    if not lanes:
        raise ConfigError(f"model {model}: needs at least one lane")
    names = [lane.name for lane in lanes]
    if len(set(names)) != len(names) or not all(NAME_RE.match(n) for n in names):
        raise ConfigError(f"model {model}: lane names must be unique and simple (lower-case letters, digits, '.', "
                          f"'_' or '-'), got {names}")
    for lane in lanes:
        for field, rule in LANE_RULES.items():
            value = getattr(lane, field)
            if value is not None or field != "max_tokens":
                check_number(f"model {model}: lane {lane.name}", field, value, rule)
        if not NAME_RE.match(lane.engine):
            raise ConfigError(f"model {model}: lane {lane.name} engine {lane.engine!r} is not a simple name")
    engines = [lane.engine for lane in lanes]
    if any(engines.index(e) != i and engines[i - 1] != e for i, e in enumerate(engines)):
        raise ConfigError(f"model {model}: an engine's lanes must be adjacent in length order, got {engines}")
    for before, lane in itertools.pairwise(lanes):
        if before.max_tokens is None:
            raise ConfigError(f"model {model}: lane {before.name} has no max_tokens but is not the last lane: lane "
                              f"{lane.name} after it would get no request; only the last lane may be open")
        if lane.max_tokens is not None and lane.max_tokens <= before.max_tokens:
            raise ConfigError(f"model {model}: lane bounds must increase: lane {lane.name} max_tokens "
                              f"{lane.max_tokens} is not above lane {before.name}'s {before.max_tokens} (a request "
                              "goes to the first lane that holds it)")
    last = lanes[-1]
    if last.max_tokens is not None and last.max_tokens < longest:
        raise ConfigError(f"model {model}: the last lane, {last.name}, takes every request longer than the lanes "
                          f"before it, up to {longest} tokens ({longest_text}), so its max_tokens {last.max_tokens} "
                          f"would be ignored: leave it unset (open) or set it >= {longest}")


# --- the model file and the environment --------------------------------------------------------------------

TOP_LEVEL_KEYS = ("models",)


def top_level_problem(data: Mapping[str, Any], where: str) -> str | None:
    """An unknown top-level key of a model file (`model:` for `models:`), named with the known ones."""
    unknown = sorted(str(k) for k in data if k not in TOP_LEVEL_KEYS)
    if not unknown:
        return None
    close = difflib.get_close_matches(unknown[0], TOP_LEVEL_KEYS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    keys = ", ".join(repr(k) for k in unknown)
    return f"{where}: unknown top-level key {keys}{hint}; known: {', '.join(TOP_LEVEL_KEYS)}"


def env_model_name(name: str) -> str:
    """How `BATCHGATE_MODEL__<NAME>__<FIELD>` writes a model's name: upper-case, each character other than a
    letter or digit ('-', '_', '.') as '_'. `tiny-llama`, `tiny_llama` and `tiny.llama` are all TINY_LLAMA."""
    return re.sub(r"[^A-Z0-9]", "_", name.upper())


def resolve_env_model(written: str, known: Iterable[str], served: Iterable[str], variable: str) -> str:
    """The model a `BATCHGATE_MODEL__<NAME>__...` variable names: the known model whose name NAME writes (see
    `env_model_name`); of several (`my-lm` and `my_lm`), the one served (the file's, else the defaults); with no
    match, a new model named NAME in lower case with '_' as '-'. Several served models NAME writes alike are
    refused: no variable could tell them apart."""
    matches = sorted(n for n in known if env_model_name(n) == env_model_name(written))
    if len(matches) > 1:
        matches = [n for n in matches if n in set(served)] or matches
    if len(matches) > 1:
        raise ConfigError(f"{variable}: {written} names models {', '.join(matches)} alike (each '-', '_' or '.' is "
                          "written '_'); rename one of them to set it from the environment")
    return matches[0] if matches else written.lower().replace("_", "-")
