"""A real Redis Cluster on loopback for tests: 3 masters and 3 replicas (`redis-server --cluster-enabled yes`,
joined by `redis-cli --cluster create`), a short node timeout so a replica takes over fast after a master is
killed. Started once per test session when the suites run against a cluster (`BATCHGATE_TEST_REDIS=cluster`),
or by hand: `python -m tests.redis_cluster` prints its URL and keeps it up until Ctrl+C."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from shared.redis_io import delete_prefix_sync, make_sync_redis

NODE_TIMEOUT_MS = 1500
BUS_OFFSET = 10_000  # a node's cluster bus listens on its port + 10000


@dataclass
class Node:
    port: int
    proc: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def restart(self) -> None:
        """Start again on its port and directory: it keeps its cluster identity and rejoins (as a replica of
        whoever took over its slots)."""
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_ping(self.port)


@dataclass
class LocalCluster:
    nodes: list[Node] = field(default_factory=list)
    workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """Where batchgate reaches it: any node, with the cluster scheme (`shared.redis_io.make_redis`)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def client(self) -> RedisCluster:
        live = next(n for n in self.nodes if n.proc.poll() is None)
        return RedisCluster(host="127.0.0.1", port=live.port)

    def masters(self) -> list[Node]:
        """The nodes serving slots now (after a failover, a former replica among them)."""
        by_port = {n.port: n for n in self.nodes}
        info = self.client().cluster_nodes()
        return [by_port[int(addr.split(":")[1].split("@")[0])] for addr, node in info.items()
                if "master" in str(node["flags"]) and "fail" not in str(node["flags"])]

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.terminate()
        for n in self.nodes:
            try:
                n.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                n.kill()
        if self.workdir is not None:
            self.workdir.cleanup()


def sync_client(url: str) -> redis.Redis:
    """A blocking client for `url`, a single Redis or (with a cluster scheme) a cluster."""
    return make_sync_redis(url)  # type: ignore[no-any-return]


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under `prefix:` (on every master of a cluster), and nothing else."""
    delete_prefix_sync(url, prefix)


def start_cluster(nodes: int = 6, replicas: int = 1, *, appendonly: bool = False) -> LocalCluster:
    """A cluster of `nodes` on loopback; started again on other ports (three tries) where a node could not listen
    (its port taken between the check and its bind)."""
    for attempt in range(3):
        try:
            return _start_cluster(nodes, replicas, appendonly=appendonly)
        except NodeDidNotStart:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class NodeDidNotStart(RuntimeError):
    pass


def _start_cluster(nodes: int, replicas: int, *, appendonly: bool) -> LocalCluster:
    cluster = LocalCluster(workdir=tempfile.TemporaryDirectory(prefix="batchgate-cluster-"))
    base = Path(cluster.workdir.name)
    try:
        for port in _ports(nodes):
            d = base / str(port)
            d.mkdir()
            argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(d),
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--repl-diskless-sync-delay", "0",
                    "--appendonly", "yes" if appendonly else "no", "--daemonize", "no"]
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cluster.nodes.append(Node(port, proc, argv))
        for n in cluster.nodes:
            _wait_ping(n.port, n.proc)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in cluster.nodes],
                        "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        _wait_ok(cluster, replicas=nodes - nodes // (replicas + 1))
        return cluster
    except BaseException:
        cluster.stop()
        raise


# below Linux's ephemeral range (32768-60999), where the client connections of tests running beside can take a port
# between the check and a node's bind: the nodes' ports and their bus ports (+10000) both
PORTS = range(20_000, 32_768 - BUS_OFFSET)


def _ports(n: int) -> list[int]:
    """`n` distinct loopback ports whose bus ports are free too."""
    rng = random.SystemRandom()
    found: list[int] = []
    while len(found) < n:
        port = rng.choice(PORTS)
        if port not in found and all(_free(p) for p in (port, port + BUS_OFFSET)):
            found.append(port)
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_ping(port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5).ping():
                return
        except redis.RedisError:
            if proc is not None and proc.poll() is not None:  # it could not listen: its port was taken
                raise NodeDidNotStart(f"redis-server on port {port} exited ({proc.returncode})") from None
            time.sleep(0.05)
    raise NodeDidNotStart(f"redis-server on port {port} did not start")


def _replicas_online(client: redis.Redis) -> bool:
    """A master's replicas finished their first sync (a WAIT before that counts none of them)."""
    info = client.info("replication")
    if info.get("role") != "master":
        return True
    states = [v.get("state") for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
    return len(states) == int(info.get("connected_slaves", 0)) and all(st == "online" for st in states)


def _wait_ok(cluster: LocalCluster, replicas: int, timeout: float = 30) -> None:
    """Every node says ok, and every node knows every replica as one."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        clients = [redis.Redis(host="127.0.0.1", port=n.port) for n in cluster.nodes]
        ok = all(c.cluster("info").get("cluster_state") == "ok" for c in clients)
        if ok and all(sum("slave" in str(v["flags"]) for v in c.cluster("nodes").values()) == replicas
                      for c in clients) and all(_replicas_online(c) for c in clients):
            return
        time.sleep(0.1)
    raise RuntimeError("the cluster did not reach state ok")


if __name__ == "__main__":
    c = start_cluster()
    print(c.url, flush=True)
    try:
        signal.pause()
    finally:
        c.stop()
