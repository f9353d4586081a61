import types

from gpu_worker.sizing import engine_rows, kv_budget_bytes


def test_rows_fit_the_budget_and_the_configured_cap():
    assert engine_rows(max_running=64, budget_bytes=10_000, bytes_per_row=1_000) == 10
    assert engine_rows(max_running=4, budget_bytes=10_000, bytes_per_row=1_000) == 4
    assert engine_rows(max_running=64, budget_bytes=999, bytes_per_row=1_000) == 0


def test_configured_budget_wins_over_the_device():
    cpu = types.SimpleNamespace(type="cpu")
    assert kv_budget_bytes(1000, 16, cpu) == 16_000
    assert 0 < kv_budget_bytes(None, 16, cpu) <= 8 << 30


def test_the_cpu_budget_counts_the_page_cache_the_system_can_drop():
    """MemAvailable, not MemFree: a page cache full of model files would leave a budget of a few rows."""
    from pathlib import Path

    from gpu_worker.sizing import available_memory

    lines = Path("/proc/meminfo").read_text().splitlines()
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines}
    assert abs(available_memory() - meminfo["MemAvailable"]) < 256 << 20  # read a moment apart
