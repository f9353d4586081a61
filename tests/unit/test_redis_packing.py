"""hiredis packs the asyncio client's commands (`PackedConnection`): byte for byte what redis-py's own packing
sends, for every kind of argument batchgate sends, and the same errors (or the same bytes, where redis-py packs
what hiredis does not take) for the rest."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from shared.redis_io import PackedConnection

ARGS = st.one_of(st.text(), st.binary(), st.integers(min_value=-(2**70), max_value=2**70),
                 st.floats(allow_nan=False), st.binary().map(memoryview))


def both(*args: object) -> tuple[list[bytes], list[bytes]]:
    return (b"".join(PackedConnection().pack_command(*args)),
            b"".join(bytes(part) for part in Connection().pack_command(*args)))


def test_hiredis_is_what_packs():
    """Else every test here compares redis-py's packing with itself."""
    from shared import redis_io

    assert redis_io._hiredis_pack is not None


@given(st.sampled_from(["XADD", "EVALSHA", b"HSETNX", "CONFIG GET", b"CLIENT SETNAME"]), st.lists(ARGS, max_size=8))
def test_the_bytes_are_redis_pys_own(command, args):
    packed, own = both(command, *args)
    assert packed == own


def test_a_large_value_is_sent_whole():
    value = b"x" * 200_000  # past redis-py's buffer cutoff, where it sends the value as a chunk of its own
    packed, own = both("SET", "k", value)
    assert packed == own and packed.endswith(value + b"\r\n")


@pytest.mark.parametrize("value", [bytearray(b"ab"), [bytearray(b"x"), 1]])
def test_what_hiredis_does_not_take_is_packed_by_redis_py(value):
    args = value if isinstance(value, list) else [value]
    packed, own = both("SET", "k", *args)
    assert packed == own


@pytest.mark.parametrize("value", [True, None, 1 + 2j])
def test_what_redis_cannot_carry_raises_its_usual_error(value):
    with pytest.raises(DataError):
        PackedConnection().pack_command("SET", "k", value)


def test_every_tcp_url_gets_a_packing_connection():
    """`redis://` and `rediss://` (TLS, as ElastiCache with encryption in transit) alike; a unix socket keeps redis-py's
    own (no client is connected here)."""
    from redis.asyncio.connection import UnixDomainSocketConnection

    from shared.redis_io import PackedSSLConnection, make_redis

    kinds = {url: make_redis(url).connection_pool.connection_class
             for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "unix:///tmp/none.sock")}
    assert kinds == {"redis://127.0.0.1:1/0": PackedConnection, "rediss://127.0.0.1:1/0": PackedSSLConnection,
                     "unix:///tmp/none.sock": UnixDomainSocketConnection}
