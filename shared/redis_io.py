"""Redis client construction: one place that sets timeouts, retries and backoff, for a single Redis
(`redis://`, `rediss://`) or a Redis Cluster (`redis+cluster://host:port`, `rediss+cluster://`: any node; the
client finds the others and follows slot moves and failovers)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import PipelineCommand, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.commands.core import AsyncCoreCommands
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    OutOfMemoryError,
    ReadOnlyError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Errors that mean "Redis cannot take this call right now" (as opposed to a bad command): not reachable, or full
# (maxmemory with noeviction, as batchgate's Redis must run: OOM refuses writes until memory frees), or a replica
# answering while a failover promotes it, or a Redis Cluster failing over (CLUSTERDOWN and MASTERDOWN, TRYAGAIN, a
# slot no node covers yet: what redis-py raises once its own retries of these are spent): a 503 with Retry-After
# for a caller, a retry for a worker.
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError, OutOfMemoryError,
               ReadOnlyError, ClusterDownError, TryAgainError, SlotNotCoveredError)


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

T = TypeVar("T")
START_WAIT_MAX_S = 10.0  # the longest pause between tries of a process waiting for its Redis at start-up


async def until_reachable(step: Callable[[], Awaitable[T]], stop: asyncio.Event, what: str, log: Any, *,
                          errors: tuple[type[BaseException], ...] = UNAVAILABLE) -> tuple[bool, T | None]:
    """Run a start-up step until Redis answers it: a process started before its Redis (a boot order, a Redis
    restarting) waits for it, as the gateway does, instead of exiting (a supervisor's restart loop, the models
    loaded again each time). Jittered backoff from 0.5 s to `START_WAIT_MAX_S`; (False, None) if `stop` is set
    first, else (True, the step's result)."""
    pause = 0.5
    while True:
        try:
            return True, await step()
        except errors as exc:
            log.warning(f"{what}: Redis is not reachable yet; waiting for it", error=str(exc) or repr(exc),
                        retry_in_s=round(pause, 1))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), pause * random.uniform(0.8, 1.2))
        if stop.is_set():
            return False, None
        pause = min(pause * 2, START_WAIT_MAX_S)


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def plain_url(url: str) -> str:
    """The URL with a cluster scheme turned into the plain one (what redis-py and redis-cli understand)."""
    scheme, _, rest = url.partition("://")
    return f"{CLUSTER_SCHEMES.get(scheme.lower(), scheme)}://{rest}"


def make_sync_redis(url: str, **kwargs: Any) -> Any:
    """A blocking client (the scaler Lambda, the supervisor's checks): `redis.Redis`, or `redis.cluster.RedisCluster`
    for a cluster URL."""
    import redis as sync

    if is_cluster(url):
        from redis.cluster import RedisCluster as SyncCluster

        return SyncCluster.from_url(plain_url(url), **kwargs)
    return sync.Redis.from_url(url, **kwargs)


def delete_prefix_sync(url: str, prefix: str) -> int:
    """Delete every key under `prefix:` (on every master of a cluster), and nothing else; returns how many (tests
    and benchmarks clean up their own keys with it)."""
    client = make_sync_redis(url)
    n = 0
    try:
        for node in client.get_primaries() if is_cluster(url) else [None]:
            scan = {"target_nodes": node} if node is not None else {}
            keys = list(client.scan_iter(match=f"{prefix}:*", count=1000, **scan))
            if node is None:  # one Redis: a DEL of many keys at a time
                n += sum(client.delete(*keys[i:i + 1000]) for i in range(0, len(keys), 1000))
            else:  # a cluster's keys are in many slots: one DEL each
                n += sum(client.delete(key) for key in keys)
    finally:
        client.close()
    return n


try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # hiredis is optional (redis-py's "hiredis" extra): redis-py packs in Python then
    _hiredis_pack = None


class _HiredisPacking:
    """Commands packed by hiredis (in C), as redis-py's synchronous client already packs them where hiredis is
    installed: its asyncio client packs each argument in Python, a fifth of a submit's gateway CPU
    (`scripts/bench_gateway.py --profile`). The bytes are the same; what hiredis does not take (a bytearray, a bool,
    None) goes to redis-py's own packing, which sends it or raises the error it always raised."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if _hiredis_pack is None:
            return super().pack_command(*args)  # type: ignore[misc]
        head = args[0]
        if isinstance(head, str):  # "CONFIG GET" is two arguments, as redis-py splits it
            args = (*head.encode().split(), *args[1:])
        elif b" " in head:
            args = (*head.split(), *args[1:])
        try:
            return [_hiredis_pack(args)]
        except TypeError:
            return super().pack_command(*args)  # type: ignore[misc]


class PackedConnection(_HiredisPacking, Connection):
    """A TCP connection (`redis://`) whose commands hiredis packs."""


class PackedSSLConnection(_HiredisPacking, SSLConnection):
    """A TLS connection (`rediss://`, as ElastiCache with encryption in transit) whose commands hiredis packs."""


PACKED = {Connection: PackedConnection, SSLConnection: PackedSSLConnection}  # a unix socket's keeps redis-py's


def make_redis(url: str, *, socket_timeout: float = 10.0, retries: int = 2,
               max_connections: int | None = 200, retry_timeouts: bool = True) -> aioredis.Redis:
    """An asyncio client with bounded timeouts and a short retry on connection errors.

    `socket_timeout` must exceed the longest BLOCK a caller uses (intake blocks for ~1 s).
    A thawed serverless container or a restarted Redis leaves dead connections in the pool: the
    retry reconnects once or twice with jittered backoff before the error reaches the caller.
    `retry_timeouts` False: a command that timed out is not sent again (a Redis that accepts connections and
    answers nothing, stopped or wedged, then fails a caller within one `socket_timeout`, not three).
    """
    on_error = [RedisConnectionError, RedisTimeoutError] if retry_timeouts else [RedisConnectionError]
    if is_cluster(url):
        return _cluster(url, socket_timeout=socket_timeout, retries=retries, max_connections=max_connections,
                        on_error=on_error)
    # A blocking pool: under a burst of concurrent requests, callers wait (up to 5 s) for a free
    # connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections or 200,
        timeout=5,
        socket_connect_timeout=2.0,
        socket_timeout=socket_timeout,
        socket_keepalive=True,
        health_check_interval=30,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries, supported_errors=tuple(on_error)),
        retry_on_error=on_error,
        decode_responses=False,
    )
    pool.connection_class = PACKED.get(pool.connection_class, pool.connection_class)
    return aioredis.Redis(connection_pool=pool, auto_close_connection_pool=True)


def _cluster(url: str, *, socket_timeout: float, retries: int, max_connections: int | None,
             on_error: list[type[Exception]]) -> aioredis.Redis:
    """A cluster client with the same timeouts. Every caller uses the commands both kinds share; each script
    and transaction stays within one slot (see `shared.keys`)."""
    client = _Cluster.from_url(
        plain_url(url),
        max_connections=max_connections or 200,
        socket_connect_timeout=2.0,
        socket_timeout=socket_timeout,
        socket_keepalive=True,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries, supported_errors=tuple(on_error)),
        retry_on_error=on_error,
        decode_responses=False,
    )
    client._limit = max_connections or 200
    return client  # type: ignore[return-value]


class _Cluster(RedisCluster):
    _warm: asyncio.Lock | None = None
    _limit = 200  # commands in flight at once: beyond, callers wait (as on a single Redis' blocking pool) instead
    _gate: asyncio.Semaphore | None = None  # of failing with MaxConnectionsError

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # redis-py's cluster client takes no connection class: the nodes it learns are made from these kwargs,
        # and those it was given are made already
        kind = self.connection_kwargs.get("connection_class")
        self.connection_kwargs["connection_class"] = PACKED.get(kind, kind)
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = PACKED.get(node.connection_class, node.connection_class)

    def gate(self) -> asyncio.Semaphore:
        self._gate = self._gate or asyncio.Semaphore(self._limit)
        return self._gate

    async def ready(self) -> None:
        """The first commands wait for the topology, not race to it (redis-py 8.1 breaks connections then)."""
        if self._initialize:
            self._warm = self._warm or asyncio.Lock()
            async with self._warm:
                await self.initialize()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self.ready()
        async with self.gate():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> SlotPipeline:  # type: ignore[override]
        return SlotPipeline(self)


class SlotPipeline(AsyncCoreCommands):  # type: ignore[misc]
    """What `pipeline()` gives on a cluster, instead of redis-py's ClusterPipeline (8.1), which, on a connection
    error in one pipeline, closes the whole client under every other task using it (their commands then fail
    with AttributeErrors), and refuses EVALSHA and PUBLISH. Commands queue as on a pipeline; `execute` sends
    each node's commands in order over one of its connections (one round trip per node, the nodes
    concurrently); a command that meets a moved slot or a lost connection (a failover) is sent again on its
    own, in order, by the client, which follows the new topology. Not a transaction: on a cluster, what must
    be atomic is one script on one slot. `wait_replicas` makes `execute` return only once each node's writes
    reached that many replicas (WAIT on the same connection), else raise `NotReplicated`."""

    def __init__(self, client: _Cluster) -> None:
        self.client = client
        self._queue: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._wait: tuple[int, int] | None = None

    def execute_command(self, *args: Any, **options: Any) -> SlotPipeline:  # type: ignore[override]
        self._queue.append((args, options))
        return self

    def wait_replicas(self, replicas: int, timeout_ms: int) -> None:
        self._wait = (replicas, timeout_ms) if replicas > 0 else None

    def __len__(self) -> int:
        return len(self._queue)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        queue, self._queue = self._queue, []
        if not queue:
            return []
        await self.client.ready()
        encoder = self.client.get_encoder()
        by_node: dict[str, tuple[Any, list[PipelineCommand]]] = {}
        for i, (args, options) in enumerate(queue):
            node = self.client.nodes_manager.get_node_from_slot(key_slot(encoder.encode(_key_of(args))))
            by_node.setdefault(node.name, (node, []))[1].append(PipelineCommand(i, *args, **options))
        results: list[Any] = [None] * len(queue)
        await asyncio.gather(*(self._run(node, cmds, results) for node, cmds in by_node.values()))
        if raise_on_error:
            for r in results:
                if isinstance(r, Exception):
                    raise r
        return results

    async def _run(self, node: Any, cmds: list[PipelineCommand], results: list[Any]) -> None:
        wait = [PipelineCommand(-1, "WAIT", *self._wait)] if self._wait else []
        try:
            async with self.client.gate():
                await node.execute_pipeline([*cmds, *wait])
        except Exception as exc:
            for c in cmds:
                c.result = exc
        again = [c for c in cmds if isinstance(c.result, _SEND_AGAIN)]
        for c in cmds:
            results[c.position] = c.result
        for c in again:  # in order: the client follows the slot to its node now
            try:
                results[c.position] = await self.client.execute_command(*c.args, **c.kwargs)
            except Exception as exc:
                results[c.position] = exc
        if self._wait and (again or not isinstance(wait[0].result, int) or wait[0].result < self._wait[0]):
            results[cmds[0].position] = NotReplicated(
                f"writes to {node.name} reached {wait[0].result!r} replicas, {self._wait[0]} required")

    async def __aenter__(self) -> SlotPipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._queue = []


class NotReplicated(RedisConnectionError):
    """Writes reached fewer replicas than a durable write requires (within its timeout)."""


async def fewest_replicas(client: Any) -> int:
    """The replicas connected to the master with the fewest (a single Redis: its own; a cluster: every master's, as
    its client sends INFO to one node unless told), from INFO replication."""
    if isinstance(client, RedisCluster):
        info = await client.info("replication", target_nodes=RedisCluster.PRIMARIES)
    else:
        info = await client.info("replication")
    if "role" in info:  # one node's
        return int(info.get("connected_slaves", 0))
    masters = [v for v in info.values() if isinstance(v, dict) and v.get("role") == "master"]
    return min((int(v.get("connected_slaves", 0)) for v in masters), default=0)


_SEND_AGAIN = (MovedError, AskError, TryAgainError, ClusterDownError, RedisConnectionError, RedisTimeoutError,
               ConnectionError, TimeoutError, OSError)


def _key_of(args: tuple[Any, ...]) -> Any:
    """The key a queued command routes by: EVAL/EVALSHA's first key, else its first argument."""
    name = str(args[0]).upper()
    if name in ("EVAL", "EVALSHA"):
        return args[3] if len(args) > 3 and int(args[2]) > 0 else b""
    return args[1] if len(args) > 1 else b""


def wait_replicas(pipe: Any, replicas: int, timeout_ms: int) -> None:
    """Make a pipeline durable: its writes reach `replicas` replicas before `execute` returns, or it raises
    `NotReplicated` (`BATCHGATE_REDIS_WAIT_REPLICAS`). No-op for 0."""
    if replicas <= 0:
        return
    if isinstance(pipe, SlotPipeline):
        pipe.wait_replicas(replicas, timeout_ms)
    else:  # a single Redis: WAIT on the pipeline's own connection, checked by `check_replicated`
        pipe.execute_command("WAIT", replicas, timeout_ms)


def check_replicated(replies: list[Any], pipe: Any, replicas: int) -> list[Any]:
    """The replies of a pipeline `wait_replicas` made durable, without the WAIT's; raises `NotReplicated`."""
    if replicas <= 0 or isinstance(pipe, SlotPipeline):
        return replies
    *rest, acked = replies
    if not isinstance(acked, int) or acked < replicas:
        raise NotReplicated(f"writes reached {acked!r} replicas, {replicas} required")
    return rest


async def pubsub_of(redis: Any, **kwargs: Any) -> aioredis.client.PubSub:
    """A PubSub for `redis`. On a cluster, a plain connection to one of its nodes, picked at random each call: a
    PUBLISH reaches every node of a cluster, so any node hears every channel, and the cluster client's own PubSub
    cannot take a SUBSCRIBE while another task reads. A caller that loses the node calls again and gets another."""
    if not isinstance(redis, RedisCluster):
        return redis.pubsub(**kwargs)
    await redis.initialize()  # the client learns the nodes on its first command
    node = random.choice(redis.get_nodes())
    pool = aioredis.ConnectionPool(host=node.host, port=node.port, socket_connect_timeout=2.0, socket_keepalive=True,
                                   **{k: v for k, v in redis.get_connection_kwargs().items()
                                      if k in ("username", "password", "ssl", "socket_timeout")})
    return aioredis.client.PubSub(connection_pool=pool, **kwargs)


MAX_KEYS_PER_SCRIPT = 64  # a script blocks the server while it runs: many records a call, not unboundedly many


def script_groups(client: Any, keys: Sequence[str]) -> list[list[int]]:
    """The indexes of `keys`, grouped for one script call each: on one Redis any keys go together, on a Cluster
    only keys of one hash slot; at most `MAX_KEYS_PER_SCRIPT` a group. A script that writes many records in one
    call costs one EVAL, not one each."""
    if isinstance(client, RedisCluster):
        by_slot: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_slot.setdefault(key_slot(key.encode()), []).append(i)
        groups = list(by_slot.values())
    else:
        groups = [list(range(len(keys)))] if keys else []
    return [g[at:at + MAX_KEYS_PER_SCRIPT] for g in groups for at in range(0, len(g), MAX_KEYS_PER_SCRIPT)]


def in_pipeline(pipe: Any, script: str, keys: Sequence[Any], args: Sequence[Any]) -> None:
    """Queue a Lua script on a pipeline as EVAL of its source. Not redis-py's `Script` objects: in a pipeline
    they cost a SCRIPT EXISTS on every execute, and a Redis Cluster pipeline refuses EVALSHA. Redis keeps the
    compiled script, so the source is compiled once per server."""
    pipe.eval(script, len(keys), *keys, *args)


def raise_if_cancelling(exc: BaseException | None = None) -> None:
    """redis-py can turn the cancellation of a command in flight into a ConnectionError; a loop that
    tolerates outages must not swallow its own cancellation with it (the task would never stop)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


@contextlib.asynccontextmanager
async def tolerate_outage() -> AsyncIterator[None]:
    """Like `contextlib.suppress(*UNAVAILABLE)`, minus swallowing a cancellation."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise_if_cancelling(exc)
