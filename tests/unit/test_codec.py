import msgpack
import pytest

from shared.codec import decode, encode
from shared.errors import CodecError, SchemaVersionError
from shared.messages import (
    Callback,
    ErrorInfo,
    InferenceRequest,
    LaneStat,
    LaneStats,
    RequestMeta,
    RequestResult,
)
from shared.states import FinishReason, Priority, Status, Task


def _request(**kw):
    base = dict(id="req_x", tenant="t", model="m", task=Task.GENERATE, input={"prompt": "hi"},
                params={"max_new_tokens": 4, "stop": ["\n"]}, lane="short", priority=Priority.BATCH,
                created_ms=1, deadline_ms=2, est_tokens=5)
    base.update(kw)
    return InferenceRequest(**base)


@pytest.mark.parametrize("msg", [
    _request(),
    _request(callback=Callback("https://example.com/hook", ("started", "completed")), idempotency_key="k"),
    _request().meta(),
    RequestResult(id="req_x", status=Status.SUCCEEDED, output={"text": "a", "token_ids": [1, 2]},
                  finish_reason=FinishReason.LENGTH, timings={"ttft_ms": 1.5}, started_ms=3, finished_ms=4,
                  worker="w"),
    RequestResult(id="req_x", status=Status.FAILED, error=ErrorInfo("model_error", "boom")),
    LaneStats(model="m", worker="w", at_ms=5, max_rows=8, free_rows=2, deadline_aware=True, prefill_fixed_ms=1.0,
              prefill_ms_per_token=0.1, decode_ms_per_step=20.0, lanes=(LaneStat("short", 1, 2, 3.0, 4.0),)),
])
def test_round_trip(msg):
    assert decode(encode(msg), type(msg)) == msg


def test_enums_and_nested_types_come_back_typed():
    out = decode(encode(_request(callback=Callback("https://x", ("completed",)))), InferenceRequest)
    assert out.task is Task.GENERATE and out.priority is Priority.BATCH
    assert isinstance(out.callback, Callback) and out.callback.events == ("completed",)


def test_unknown_version_is_a_schema_error():
    data = msgpack.packb({"v": 99, "k": "request", "d": {}})
    with pytest.raises(SchemaVersionError, match="99"):
        decode(data, InferenceRequest)


def test_wrong_kind_is_refused():
    with pytest.raises(CodecError, match="expected a 'result'"):
        decode(encode(_request()), RequestResult)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all", msgpack.packb([1, 2]),
                                  msgpack.packb({"v": 1, "k": "request", "d": {"id": "x"}}),
                                  msgpack.packb({"v": 1, "k": "request", "d": "nope"})])
def test_garbage_is_a_codec_error_never_a_crash(data):
    with pytest.raises(CodecError):
        decode(data, InferenceRequest)


def test_meta_drops_the_input():
    meta = _request(input={"prompt": "x" * 10_000}).meta()
    assert isinstance(meta, RequestMeta) and not hasattr(meta, "input")
