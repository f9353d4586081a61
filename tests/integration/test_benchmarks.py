"""The benchmark scripts run and write the JSON keys the checks read (figures are not asserted here).

Marked `alone`: a benchmark saturates the machine and its requests meet admission as load allows, so `make test`
runs these by themselves (on one Redis), not beside the passes that run side by side."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.alone]


def run_bench(script: str, out, *args: str, model_cache=None,
              timeout: int = 600) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run `scripts/<script>` with `args` and `--json out` (the built-in models from `model_cache`, when given);
    it must succeed. Returns the process and its JSON report."""
    env = {**os.environ, "BATCHGATE_MODEL_CACHE": str(model_cache)} if model_cache is not None else None
    proc = subprocess.run([sys.executable, f"scripts/{script}", *args, "--json", str(out)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_engine_benchmark_smoke(tmp_path, model_cache):
    proc, report = run_bench("bench_engine.py", tmp_path / "engine.json", "--requests", "4", "--reps", "1",
                             "--model-cache", str(model_cache))
    assert set(report["methods"]) == {"batch1", "static", "hf_continuous", "batchgate"}
    for row in report["methods"].values():
        assert row["tokens_per_s"] > 0 and row["wall_s"] > 0
    for key in ("ratio_vs_static", "ratio_vs_batch1", "ratio_vs_hf_continuous"):
        assert report[key] > 0
    assert report["outputs_match_reference"] is True
    assert "ratio_vs_hf_continuous" in proc.stdout  # the human table


def test_engine_benchmark_long_prefill_mode(tmp_path, model_cache):
    """Rows decoding while a 2,048-token prompt arrives: the keys the checks read (the figures themselves are
    the benchmark's to report, not a test's to time). The model is given as a local directory (`--model-dir`, as
    for a real-size shape from scripts/make_llama.py): here the built-in's own."""
    from gpu_worker.models import ensure_builtin_llama

    model_dir = ensure_builtin_llama("bench-llama", model_cache)
    proc, report = run_bench("bench_engine.py", tmp_path / "long.json", "--long-prefill", "--reps", "1",
                             "--model-cache", str(model_cache), "--model-dir", str(model_dir))
    assert report["model"] == str(model_dir) and report["params_m"] == 33.6
    assert report["decode_step_ms"] > 0 and report["max_itl_ms_during_long_prefill"] > 0
    assert report["whole_prefill_max_itl_ms"] > 0 and report["median"]["chunked"]["long_ttft_ms"] > 0
    assert report["fused_exact"] is True and report["median"]["fused"]["fused"] == 1.0  # the built-in model fuses
    assert report["separate_chunks_max_itl_ms"] > 0
    assert report["max_itl_ms_without_prefill"] > 0 and report["bare_max_vs_decode_step"] >= 1
    for name, (run,) in report["runs"].items():  # every gap during the prefill, with what its step prefilled
        assert max(ms for ms, _ in run["trace"]) == run["max_itl_ms_during_long_prefill"]
        assert sum(tokens > 0 for _, tokens in run["trace"]) >= {"fused": 2, "chunked": 4, "whole": 1}[name]
    assert "longest gap" in proc.stdout  # the human table


def test_engine_benchmark_window_mode(tmp_path, model_cache):
    """Sliding-window layers keeping their window against every column: the keys the checks read, and the same
    greedy tokens both ways."""
    proc, report = run_bench("bench_engine.py", tmp_path / "window.json", "--window", "--window-size", "32",
                             "--window-rows", "2", "--window-prompt", "96", "--window-steps", "6", "--reps", "1",
                             "--model-cache", str(model_cache))
    assert set(report["archs"]) == {"mistral", "hybrid"}
    for r in report["archs"].values():
        assert r["tokens_equal"] is True
        assert 0 < r["kv_bytes_per_row_ring"] < r["kv_bytes_per_row_full"]
        assert r["rows_in_budget_ring"] > r["rows_in_budget_full"] and r["decode_step_ms_ring"] > 0
    assert report["archs"]["mistral"]["ring_layers"] == 8 and report["archs"]["hybrid"]["ring_layers"] == 6
    assert "tokens equal" in proc.stdout  # the human table


@pytest.mark.redis
@pytest.mark.timeout(900)  # as long as its subprocess may take (pytest's default is 300 s)
def test_batches_benchmark_smoke(tmp_path, redis_url, model_cache):
    """The Batch API benchmark on the whole stack, tiny: the keys its goals are read from."""
    # an idle-capacity window long enough for a few of its requests (64-256 prompt and 32-128 new tokens, 4 at a
    # time) to finish on a busy 2-core machine: in 4 s none did once, and the benchmark rightly stops there
    proc, report = run_bench("bench_batches.py", tmp_path / "batches.json", "--items", "6", "--interactive-rps", "2",
                             "--interactive-s", "3", "--capacity-clients", "4", "--capacity-warm-s", "2",
                             "--capacity-s", "10", "--redis-url", redis_url, model_cache=model_cache, timeout=900)
    assert report["idle_capacity_rps"] > 0 and report["batch_share_of_idle_capacity"] > 0
    assert report["interactive_p99_ratio"] > 0 and report["interactive_with_batch_n"] == 6
    assert "goal <= 1.2" in proc.stdout  # the human summary


@pytest.mark.redis
@pytest.mark.timeout(900)  # six stacks in turn, as long as its subprocess may take (pytest's default is 300 s)
def test_e2e_benchmark_smoke(tmp_path, redis_url, model_cache):
    proc, report = run_bench("bench_e2e.py", tmp_path / "e2e.json", "--requests", "12", "--rounds", "2",
                             "--capacity-clients", "4", "--capacity-warm-s", "1", "--capacity-s", "6",
                             "--capacity-reps", "1", "--redis-url", redis_url, "--plot", str(tmp_path / "cdf.png"),
                             model_cache=model_cache, timeout=900)
    for name in ("lanes_on", "long_rows_8", "two_engines", "lanes_off", "batch1", "short_alone"):
        for key in ("short_p99_ms", "goodput_rps", "throughput_rps"):
            assert report[name][key] is not None, (name, key)
    # the lane targets' two figures, side by side in the one run
    assert report["short_p99_vs_alone"] == report["lanes_on"]["short_p99_ms"] / report["short_alone"]["short_p99_ms"]
    caps = report["capacity_rps_by_stack"]
    assert report["capacity_vs_fifo"] == caps["lanes_on"] / caps["lanes_off"]
    assert "short_p99_vs_alone" in proc.stdout and "capacity_vs_fifo" in proc.stdout
    assert report["lanes_on"]["classes"]["all"]["requests"] == 12  # both rounds, pooled
    assert report["short_alone"]["classes"]["all"]["requests"] == report["lanes_on"]["classes"]["short"]["requests"]
    assert report["short_p99_ratio_on_vs_off"] > 0 and report["short_p99_floor_ratio"] > 0
    # the ratio factors into the floor and lanes on's distance from it
    assert report["short_p99_ratio_on_vs_off"] == pytest.approx(
        report["short_p99_floor_ratio"] * report["short_p99_on_vs_alone"])
    assert report["rounds"] == 2 and (tmp_path / "cdf.png").stat().st_size > 0
    # short_alone runs on lanes_on's stack
    assert set(report["capacity_rps_by_stack"]) == {"lanes_on", "long_rows_8", "two_engines", "lanes_off"}
    assert report["capacity_rps"] == report["capacity_rps_by_stack"]["lanes_on"] > 0
    assert "round 2/2" in proc.stdout


def run_overload(out, redis_url, model_cache, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The overload benchmark at smoke-test sizes (4 s of offered load, a 5 s capacity measurement)."""
    return run_bench("bench_overload.py", out, *extra, "--duration", "4", "--capacity-clients", "8",
                     "--capacity-warm-s", "1", "--capacity-s", "4", "--redis-url", redis_url, model_cache=model_cache,
                     timeout=900)


@pytest.mark.redis
def test_overload_benchmark_smoke(tmp_path, redis_url, model_cache):
    proc, report = run_overload(tmp_path / "overload.json", redis_url, model_cache)
    assert report["capacity_rps"] > 0 and report["overload"] == 2.0
    for name in ("deadline_aware", "fifo"):
        row = report[name]
        assert row["offered"] == int(row["offered_rps"] * 4) > 0
        assert sum(row["statuses"].values()) == row["offered"]  # every request accounted for
        assert row["goodput_rps"] >= 0 and "goodput_vs_capacity" in row
    assert report["compute_on_expired"] == report["deadline_aware"]["compute_on_expired"]
    assert report["deadline_aware"]["all_terminal_or_429"] is True
    assert "capacity (sustained" in proc.stdout and "goodput/s" in proc.stdout  # progress and the human table


@pytest.mark.redis
def test_overload_benchmark_mixed_mode_reports_admission_mistakes(tmp_path, redis_url, model_cache):
    proc, report = run_overload(tmp_path / "overload-mixed.json", redis_url, model_cache, "--workload", "mixed")
    assert report["workload"] == "mixed" and report["timeout_s"] == 60.0 and report["capacity_rps"] > 0
    for phase in ("steady", "overload"):
        row = report[phase]
        assert sum(row["statuses"].values()) == row["offered"] > 0  # every request accounted for
        assert row["all_terminal_or_429"] is True
        adm = row["admission"]
        assert 0 <= adm["refused_feasible"] <= adm["refused_deadline"] <= row["rejected_429"]
        assert adm["accepted_then_expired"] <= row["expired"]
    assert report["refused_feasible_share"] == max(report[p]["admission"]["refused_feasible_share"]
                                                   for p in ("steady", "overload"))
    assert "refused ok" in proc.stdout and "acc+exp" in proc.stdout


@pytest.mark.redis
def test_webhook_benchmark_smoke(tmp_path, redis_url):
    proc, report = run_bench("bench_webhooks.py", tmp_path / "webhooks.json", "--duration", "2", "--rate", "20",
                             "--tarpit-s", "2", "--grace-s", "10", "--redis-url", redis_url, timeout=120)
    for name in ("no_tarpit", "tarpit"):
        assert report[name]["normal_delivered"] == report[name]["normal_deliveries"] == 40
        assert report[name]["p99_s"] is not None
    assert report["tarpit"]["tarpit_received"] > 0 and report["p99_ratio"] is not None
    assert "tarpit / no tarpit" in proc.stdout  # the human table


@pytest.mark.redis
def test_gateway_benchmark_smoke(tmp_path, redis_url):
    """The control plane's benchmark with the echo model: every configuration's figures, the census, the added
    latency and the goals (a private redis-server where one is installed, so its counters are the run's own)."""
    redis_args = [] if shutil.which("redis-server") else ["--redis-url", redis_url]
    proc, report = run_bench("bench_gateway.py", tmp_path / "gateway.json", "--gateways", "1", "--workers", "1",
                             "--clients", "4", "--warm-s", "0.3", "--measure-s", "1", "--latency-s", "1",
                             "--census", "5", *redis_args, timeout=300)
    (row,) = report["configs"]
    assert (row["gateways"], row["workers"]) == (1, 1)
    for phase in ("submit", "e2e"):
        assert row[phase]["requests"] > 0 and row[phase]["failed"] == 0
        assert row[phase]["rps_per_gateway"] == row[phase]["rps"] > 0
    assert report["e2e_rps"] == row["e2e"]["rps"] and report["submit_rps"] == row["submit"]["rps"]
    for key in ("gateway_cpu_ms_per_submit", "gateway_cpu_ms_per_request", "redis_cpu_ms_per_request",
                "added_latency_p99_ms", "redis_ping_p99_ms"):
        assert report[key] is not None and report[key] > 0, key
    assert report["redis_commands_per_request"] > report["redis_client_commands_per_request"] > 0
    submit = report["census_submit"]
    assert submit["client"]["xadd"] == 1 and "script|exists" not in submit["client"]  # no SCRIPT EXISTS per call
    assert report["census_lifecycle"]["client"]["xreadgroup"] > 0
    tail = report["latency"]["handler_202_share"]  # read from the gateway's histogram over the latency phase
    assert set(tail) == {"over_5_ms", "over_10_ms"} and 0 <= tail["over_10_ms"] <= tail["over_5_ms"] <= 1
    assert set(report["goals"]) and "added latency" in proc.stdout and "one request lifecycle" in proc.stdout
