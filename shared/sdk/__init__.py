"""The batchgate Python SDK: submit, wait, poll, cancel; over HTTP or straight into Redis.

    from shared.sdk import BatchgateClient

    client = BatchgateClient("https://batchgate.example.com", api_key="bgk_...")
    sub = client.submit("tiny-llama", {"prompt": "Hello"}, params={"max_new_tokens": 32})
    print(client.result(sub.id).output["text"])

    sub = client.submit("tiny-llama", {"prompt": "Hello"}, stream=True)
    for event in client.events(sub.id):  # tokens as they are decoded, then the result
        print(event.text, end="", flush=True)

Inside an AWS Lambda, pass the handler's `context` (`BatchgateClient(..., lambda_context=context)`):
unless a request names its own `timeout_s` or `deadline`, its deadline becomes the function's
remaining time minus a margin, so work the function cannot wait for is never computed. Importing
the SDK imports neither torch nor the gateway.
"""

from shared.sdk.client import AsyncBatchgateClient, BatchgateClient, Event, Result, Submission
from shared.sdk.errors import (
    AuthError,
    BatchgateError,
    Conflict,
    DeadlineInfeasible,
    InvalidRequest,
    NotFound,
    OverCapacity,
    RequestFailed,
    Unavailable,
)

__all__ = [
    "AsyncBatchgateClient",
    "AuthError",
    "BatchgateClient",
    "BatchgateError",
    "Conflict",
    "DeadlineInfeasible",
    "Event",
    "InvalidRequest",
    "NotFound",
    "OverCapacity",
    "RequestFailed",
    "Result",
    "Submission",
    "Unavailable",
]
