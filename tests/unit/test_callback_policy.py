import random

import pytest

from shared.callback_policy import backoff_s, classify, parse_retry_after


@pytest.mark.parametrize(("code", "status"), [
    (200, "delivered"), (204, "delivered"), (500, "retry"), (503, "retry"), (429, "retry"), (408, "retry"),
    (409, "retry"), (425, "retry"), (None, "retry"), (410, "disabled"), (302, "failed"), (301, "failed"),
    (400, "failed"), (401, "failed"), (404, "failed"), (422, "failed"),
])
def test_classify(code, status):
    assert classify(code, "timeout").status == status


def test_backoff_doubles_with_jitter_and_caps():
    rng = random.Random(0)
    for attempt in range(1, 12):
        d = backoff_s(attempt, base_s=2.0, cap_s=1800.0, rng=rng)
        ceiling = min(1800.0, 2.0 * 2 ** (attempt - 1))
        assert ceiling / 2 <= d <= ceiling


def test_default_schedule_spans_about_two_hours():
    rng = random.Random(1)
    total = sum(backoff_s(a, 20.0, 3600.0, rng) for a in range(1, 10))  # 9 waits between 10 attempts
    assert 1.2 * 3600 < total < 3 * 3600


def test_retry_after_is_honoured():
    assert backoff_s(1, 2.0, 1800.0, random.Random(0), retry_after_s=120) == 120
    assert parse_retry_after("30") == 30 and parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past
