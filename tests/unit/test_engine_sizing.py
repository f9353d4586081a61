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
