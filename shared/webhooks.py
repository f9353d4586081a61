"""Standard Webhooks signing (sender side) and verification (receiver side), via `standardwebhooks`.

Headers: `webhook-id` (the same on every attempt of one delivery), `webhook-timestamp` (fresh per
attempt), `webhook-signature` (`v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, one per active secret,
space-separated: during a secret rotation receivers accept either).

Receiver, e.g. in an AWS Lambda behind a Function URL or in Flask:

    from shared.webhooks import verify           # or: from standardwebhooks.webhooks import Webhook
    event = verify(secret, body_bytes, headers)  # raises WebhookVerificationError if forged or stale
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

__all__ = ["WebhookVerificationError", "sign_headers", "verify"]


def sign_headers(secrets: tuple[str, ...] | list[str], msg_id: str, body: str,
                 now: datetime | None = None) -> dict[str, str]:
    ts = now or datetime.now(tz=UTC)
    signatures = " ".join(Webhook(secret).sign(msg_id, ts, body) for secret in secrets)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(ts.timestamp())),
        "webhook-signature": signatures,
    }


def verify(secret: str, body: bytes | str, headers: dict[str, str]) -> Any:
    """Check a delivery's signature and freshness (+-5 minutes); returns the parsed JSON payload."""
    return Webhook(secret).verify(body, {k.lower(): v for k, v in headers.items()})
