"""The clients `make_redis` makes (a single Redis, or each node of a cluster) send commands hiredis packed, and
what they send reads back as it was written."""

from __future__ import annotations

import pytest

from shared.redis_io import PackedConnection, make_redis

pytestmark = pytest.mark.redis


async def test_commands_go_packed_and_read_back_whole(redis_url, prefix):
    client = make_redis(redis_url)
    try:
        key = f"{prefix}:{{p}}:hash"
        values = {"s": "tëxt ✓", "b": b"\x00\xff\r\n", "i": -(2**63), "f": 0.1, "big": b"v" * 100_000}
        await client.hset(key, mapping=values)
        assert await client.hgetall(key) == {k.encode(): (v if isinstance(v, bytes) else str(v).encode())
                                             for k, v in values.items()}
        pipe = client.pipeline(transaction=False)
        pipe.xadd(f"{prefix}:{{p}}:stream", {"m": b"\x01\x02"})
        pipe.xlen(f"{prefix}:{{p}}:stream")
        assert (await pipe.execute())[1] == 1
        nodes = client.get_nodes() if hasattr(client, "get_nodes") else []
        classes = {node.connection_class for node in nodes} or {client.connection_pool.connection_class}
        assert classes == {PackedConnection}
    finally:
        await client.aclose()
