"""What to do after a webhook attempt, and when to try again. Pure: numbers in, a verdict out."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

RETRYABLE_4XX = frozenset({408, 409, 425, 429})


@dataclass(frozen=True, slots=True)
class Verdict:
    status: str  # "delivered" | "retry" | "failed" | "disabled"
    reason: str


def classify(status_code: int | None, error: str | None = None) -> Verdict:
    """`status_code` None means no response (timeout, connection error, refused before connecting)."""
    if status_code is None:
        return Verdict("retry", error or "no response")
    if 200 <= status_code < 300:
        return Verdict("delivered", f"HTTP {status_code}")
    if status_code == 410:
        return Verdict("disabled", "HTTP 410 Gone: the endpoint is disabled for this tenant")
    if 300 <= status_code < 400:
        return Verdict("failed", f"HTTP {status_code}: redirects are not followed")
    if status_code >= 500 or status_code in RETRYABLE_4XX:
        return Verdict("retry", f"HTTP {status_code}")
    return Verdict("failed", f"HTTP {status_code}: not retried")


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: random.Random,
              retry_after_s: float | None = None) -> float:
    """Delay before attempt `attempt + 1` (attempt counts from 1): exponential, equal jitter, capped;
    never sooner than the receiver's Retry-After."""
    ceiling = min(cap_s, base_s * 2 ** (attempt - 1))
    delay = ceiling / 2 + rng.uniform(0, ceiling / 2)
    return max(delay, retry_after_s or 0.0)


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    except ValueError:
        from datetime import UTC, datetime
        from email.utils import parsedate_to_datetime

        try:
            return max(0.0, (parsedate_to_datetime(value) - datetime.now(tz=UTC)).total_seconds())
        except (TypeError, ValueError):
            return None
