"""Gateway benchmark: the control plane's ceiling. An echo model (`kind: echo`: no weights, no torch, the
worker's usual intake, scheduler and publisher) takes the model out, so what is measured is batchgate itself:
the gateway, Redis, the worker's I/O and the waiters. Everything runs as separate processes on this machine:
a private `redis-server` (or --redis-url), --gateways `batchgate gateway` processes, --workers `batchgate
worker` processes, and the load generator (this process: a minimal HTTP/1.1 client on raw asyncio streams,
so that it takes as little of the shared cores as it can).

Per configuration (gateway processes x workers; every gateway count with every worker count):
- submit: closed-loop clients POST requests without waiting (202), spread over the gateways: accepted
  requests per second, per gateway process;
- e2e: closed-loop clients POST with `?wait=` (200 with the result): finished requests per second, per
  gateway process and per worker. The highest is the ceiling.
Each phase also reads, before and after its measured window: CPU time (utime + stime from /proc/<pid>/stat)
of the gateway processes serving it, of the workers and of redis-server (its pid from `INFO server`), so the
load generator sharing the cores does not distort it; and `INFO commandstats`, whose deltas divided by the
requests give Redis commands per request, per command name. commandstats counts what Redis executes:
commands a Lua script runs count too (an EVALSHA of a 3-command script is 4).

Census (MONITOR, a few requests, one at a time): which commands one submit issues, with no worker running
(client commands vs those run inside scripts: MONITOR marks the latter `lua`), and one whole request
lifecycle without a callback (submit with `?wait=`: the gateway, the worker, the waiter), with the commands
of an idle window of the same length subtracted (heartbeats, load reports, blocking reads).

Added latency, at --latency-load x the ceiling (open-loop Poisson arrivals on the ceiling's configuration),
alternate requests measuring each way through the gateway:
- the way in, submit-to-202: a submit without waiting, from sent to its 202 received (HTTP, admission,
  the store pipeline);
- the way out, done-to-wake-up: a submit with `?wait=` (the gateway subscribes to the request's "done"
  channel before it stores it), its result received minus when the worker finished it (the result's
  `created_at` + `timings.total_ms`: one clock, one machine, microseconds): the publisher writing the
  result and its event, the waiter woken by pub/sub, re-reading the record, answering.
The queueing and batching between the two (the lanes' windows) are scheduling, not the gateway's, and are
not counted. `added_latency_p99_ms` is p99 in + p99 out, an upper bound of a request's p99 of both. Beside
them, a bare Redis PING round trip from this process, on its own connection, in the same window (and idle,
before it): the floor any Redis-backed hop pays on this machine at that moment.

`--profile N` instead profiles N submits in-process (cProfile over the Starlette app through httpx's
ASGITransport, the benchmark's Redis, no worker) and prints where the CPU goes.

    python scripts/bench_gateway.py --json docs/bench/gateway.json
    python scripts/bench_gateway.py --gateways 1,2,4 --workers 1,2,3,4 --measure-s 10
    python scripts/bench_gateway.py --profile 500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.keys import Keys  # noqa: E402
from shared.lanes import DEFAULT_LANES  # noqa: E402

MODEL = "echo"
TICK_S = os.sysconf("SC_CLK_TCK")
NOT_COUNTED = {"info", "monitor"}  # the benchmark's own probes
GOALS = {"gateway_cpu_ms_per_submit": 0.35, "added_latency_p99_ms": 5.0, "redis_commands_per_request": 12}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def dist(values: list[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "p50": pct(values, 0.5), "p99": pct(values, 0.99)}


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), in seconds; None where /proc cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S


# --- the stack -----------------------------------------------------------------------------------

@dataclass
class Proc:
    role: str
    popen: subprocess.Popen[bytes]
    port: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class Stack:
    redis_url: str
    prefix: str
    tmp: Path
    env: dict[str, str]
    gateways: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    redis_proc: subprocess.Popen[bytes] | None = None
    redis_pid: int | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        m = re.match(r"redis://([^:/]+):(\d+)", self.redis_url)
        return (m.group(1), int(m.group(2))) if m else ("127.0.0.1", 6379)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def start(self, role: str, extra: dict[str, str] | None = None, wrap: tuple[str, ...] = ()) -> Proc:
        env = {**self.env, **(extra or {})}
        n = len(self.gateways if role == "gateway" else self.workers)
        log = (self.tmp / f"{role}-{n}.log").open("w")
        argv = [sys.executable, *wrap] if wrap else [sys.executable, "-m", "batchgate", role]
        popen = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        proc = Proc(role, popen, int(env.get("BATCHGATE_PORT", "0")))
        (self.gateways if role == "gateway" else self.workers).append(proc)
        return proc

    def add_gateway(self, wrap: tuple[str, ...] = ()) -> Proc:
        """A gateway process, ready; `wrap`: the interpreter's arguments instead of `-m batchgate gateway`."""
        port = free_port()
        proc = self.start("gateway", {"BATCHGATE_PORT": str(port)}, wrap)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            self._alive(proc)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    return proc
            time.sleep(0.1)
        raise RuntimeError(f"gateway on port {port} did not become ready (log: {self.tmp})")

    def set_workers(self, n: int) -> None:
        """Start workers until `n` run (each ready, i.e. announced), or stop the newest (SIGTERM: they drain)."""
        while len(self.workers) > n:
            proc = self.workers.pop()
            proc.popen.send_signal(signal.SIGTERM)
            proc.popen.wait(timeout=60)
        with self.client() as c:
            while len(self.workers) < n:
                proc = self.start("worker", {"BATCHGATE_WORKER_METRICS_PORT": "0"})
                end = time.monotonic() + 120
                while c.hlen(Keys(self.prefix).workers()) < len(self.workers):
                    self._alive(proc)
                    if time.monotonic() > end:
                        raise RuntimeError(f"worker did not become ready (log: {self.tmp})")
                    time.sleep(0.1)

    def _alive(self, proc: Proc) -> None:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.role} exited at start-up; its log is in {self.tmp}")

    def backlog(self) -> int:
        keys = Keys(self.prefix)
        with self.client() as c:
            return sum(int(c.xlen(keys.lane_stream(MODEL, lane.name))) for lane in DEFAULT_LANES)

    def drain(self, timeout_s: float = 120) -> None:
        """Wait until the workers have emptied the lanes (a submit phase may leave a backlog behind)."""
        end = time.monotonic() + timeout_s
        while (left := self.backlog()) and time.monotonic() < end:
            print(f"    draining the backlog: {left} requests", flush=True)
            time.sleep(1.0)

    def stop(self) -> None:
        for proc in [*self.gateways, *self.workers]:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in [*self.gateways, *self.workers]:
            try:
                proc.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.popen.kill()


def model_file(args: argparse.Namespace) -> dict[str, Any]:
    """One echo model with the default lanes (their windows included), backlogs that never refuse."""
    lanes = [{"name": ln.name, "max_tokens": ln.max_tokens, "window_ms": ln.window_ms, "max_share": ln.max_share,
              "max_backlog": 1_000_000} for ln in DEFAULT_LANES]
    return {"models": [{"name": MODEL, "task": "generate", "kind": "echo", "step_ms": args.step_ms,
                        "max_running": args.rows, "max_input_tokens": 512, "max_new_tokens": 512,
                        "max_timeout_s": 3600, "lanes": lanes}]}


@contextlib.contextmanager
def stack(args: argparse.Namespace) -> Iterator[Stack]:
    tmp = Path(tempfile.mkdtemp(prefix="batchgate-bench-gateway-"))
    prefix = f"bgbench-{secrets.token_hex(3)}"
    redis_proc = None
    url = args.redis_url
    if not url:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("no redis-server on PATH: install one, or pass --redis-url")
        port = free_port()
        redis_proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                       "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        _wait_redis(url)
    cfg = tmp / "models.yaml"
    cfg.write_text(yaml.safe_dump(model_file(args)))
    env = {**os.environ, "BATCHGATE_CONFIG": str(cfg), "BATCHGATE_REDIS_URL": url, "BATCHGATE_KEY_PREFIX": prefix,
           "BATCHGATE_AUTH": "off", "BATCHGATE_LOG_LEVEL": args.log_level, "BATCHGATE_LOG_FORMAT": "json",
           "BATCHGATE_MAX_WAIT_S": "600", "BATCHGATE_FILES_DIR": str(tmp / "files"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    st = Stack(url, prefix, tmp, env, redis_proc=redis_proc)
    with st.client() as c:
        st.redis_pid = int(c.info("server")["process_id"])
    try:
        yield st
    finally:
        st.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        else:  # a shared Redis: remove what this run created, nothing else
            with st.client() as c:
                keys = list(c.scan_iter(match=f"{prefix}:*", count=1000))
                if keys:
                    c.delete(*keys)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_redis(url: str) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        with contextlib.suppress(redis.RedisError), redis.Redis.from_url(url) as c:
            if c.ping():
                return
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


# --- measuring -----------------------------------------------------------------------------------

@dataclass
class Snapshot:
    at: float
    cpu: dict[int, float | None]
    commands: Counter[str]
    own_cpu: float


def commandstats(c: redis.Redis) -> Counter[str]:
    out: Counter[str] = Counter()
    for key, row in c.info("commandstats").items():
        name = key.removeprefix("cmdstat_")
        if name not in NOT_COUNTED:
            out[name] = int(row["calls"])
    return out


def snapshot(st: Stack, c: redis.Redis) -> Snapshot:
    pids = [p.pid for p in [*st.gateways, *st.workers]] + ([st.redis_pid] if st.redis_pid else [])
    return Snapshot(time.perf_counter(), {pid: proc_cpu_s(pid) for pid in pids}, commandstats(c), time.process_time())


def cpu_delta(a: Snapshot, b: Snapshot, pids: list[int]) -> float | None:
    values = [(a.cpu.get(p), b.cpu.get(p)) for p in pids]
    if any(x is None or y is None for x, y in values):
        return None
    return sum(y - x for x, y in values)  # type: ignore[operator]


def per_request(a: Snapshot, b: Snapshot, st: Stack, gateways: list[Proc], n: int) -> dict[str, Any]:
    """CPU ms per request of each role, and Redis commands per request (by name), between two snapshots."""
    n = max(1, n)
    gw = cpu_delta(a, b, [p.pid for p in gateways])
    wk = cpu_delta(a, b, [p.pid for p in st.workers])
    rd = cpu_delta(a, b, [st.redis_pid]) if st.redis_pid else None
    commands = {k: (b.commands[k] - a.commands[k]) / n for k in b.commands if b.commands[k] > a.commands[k]}
    return {
        "gateway_cpu_ms_per_request": None if gw is None else gw * 1000 / n,
        "worker_cpu_ms_per_request": None if wk is None else wk * 1000 / n,
        "redis_cpu_ms_per_request": None if rd is None else rd * 1000 / n,
        "loadgen_cpu_ms_per_request": (b.own_cpu - a.own_cpu) * 1000 / n,
        "redis_commands_per_request": sum(commands.values()),
        "commands": dict(sorted(commands.items(), key=lambda kv: -kv[1])),
    }


class Http:
    """One keep-alive HTTP/1.1 connection, requests written by hand and responses read by Content-Length: the
    load generator's share of the CPU stays small (httpx spends ~10x more per request)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        reused = self.writer is not None
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        head = f"{method} {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        self.writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        try:
            headers = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
            if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                raise
            # the server closed the kept-alive connection while it sat idle (uvicorn's keep-alive timeout), before
            # this request reached it: as any HTTP client does, send it again on a new connection
            self.close()
            self.writer = None
            return await self.request(method, path, body)
        status = int(headers[9:12])
        m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", headers)
        data = await self.reader.readexactly(int(m.group(1))) if m else b""
        return status, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def submit_body(args: argparse.Namespace, timeout_s: float) -> bytes:
    rng = random.Random(0)
    ids = [rng.randrange(97, 123) for _ in range(args.prompt_tokens)]  # letters: the echo's text is readable
    return json.dumps({"input": {"input_ids": ids}, "params": {"max_new_tokens": args.new_tokens},
                       "timeout_s": timeout_s}).encode()


SUBMIT_PATH = f"/v1/models/{MODEL}/requests"


async def closed_loop(st: Stack, gateways: list[Proc], args: argparse.Namespace, *, wait: bool,
                      label: str) -> dict[str, Any]:
    """`--clients` clients back to back (client i on gateway i mod n) for --warm-s + --measure-s; requests that
    end inside the measured window count; snapshots at its two ends."""
    body = submit_body(args, 600)
    path = SUBMIT_PATH + ("?wait=120" if wait else "")
    want = 200 if wait else 202
    t0 = time.perf_counter()
    start, end = t0 + args.warm_s, t0 + args.warm_s + args.measure_s
    counted, failed = 0, 0
    lat: list[float] = []
    snaps: list[Snapshot] = []
    conns = [Http(gateways[i % len(gateways)].port) for i in range(args.clients)]
    c = st.client()

    async def client(conn: Http) -> None:
        nonlocal counted, failed
        while (now := time.perf_counter()) < end:
            status, data = await conn.request("POST", path, body)
            done = time.perf_counter()
            ok = status == want and (not wait or b'"succeeded"' in data)
            if start <= done <= end:
                if ok:
                    counted += 1
                    lat.append((done - now) * 1000)
                else:
                    failed += 1

    async def bracket() -> None:
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        snaps.append(await asyncio.to_thread(snapshot, st, c))
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        snaps.append(await asyncio.to_thread(snapshot, st, c))

    try:
        await asyncio.gather(bracket(), *(client(conn) for conn in conns))
    finally:
        for conn in conns:
            conn.close()
        c.close()
    rps = counted / (snaps[1].at - snaps[0].at)
    out = {"requests": counted, "failed": failed, "rps": rps, "rps_per_gateway": rps / len(gateways),
           "rps_per_worker": rps / max(1, len(st.workers)), "latency_ms": dist(lat),
           **per_request(snaps[0], snaps[1], st, gateways, counted)}
    gw = out["gateway_cpu_ms_per_request"]
    print(f"    {label}: {rps:8.1f} req/s, gateway {gw or 0:.3f} ms CPU/req, "
          f"redis {out['redis_cpu_ms_per_request'] or 0:.3f} ms, {out['redis_commands_per_request']:.1f} cmds/req",
          flush=True)
    return out


# --- Redis round trips and MONITOR ---------------------------------------------------------------

class RawRedis:
    """PING on a connection of its own, no client library: the bare round trip."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def ping_ms(self) -> float:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        t0 = time.perf_counter()
        self.writer.write(b"*1\r\n$4\r\nPING\r\n")
        await self.reader.readuntil(b"\r\n")
        return (time.perf_counter() - t0) * 1000

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


_MONITOR_LINE = re.compile(r'^\+\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"(?: "([^"]*)")?')


class Monitor:
    """MONITOR on a socket of its own, read on a thread: which commands were issued, and whether a client sent
    each or a Lua script ran it."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.sendall(b"MONITOR\r\n")
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._buf = b""
        self._read_line()  # +OK
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _read_line(self) -> str | None:
        while b"\r\n" not in self._buf:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return None
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line.decode("utf-8", "replace")

    def _run(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stop.is_set():
            line = self._read_line()
            if line:
                self.lines.append(line)

    def stop(self) -> Counter[tuple[str, str]]:
        """(command, "client" | "lua") -> count."""
        time.sleep(0.1)  # the last lines are on their way
        self._stop.set()
        self._thread.join()
        self.sock.close()
        counts: Counter[tuple[str, str]] = Counter()
        for line in self.lines:
            m = _MONITOR_LINE.match(line)
            if m is None:
                continue
            name = m.group(2).lower()
            if name in ("script", "client", "config", "xinfo", "xgroup") and m.group(3):
                name += "|" + m.group(3).lower()
            if name.split("|")[0] not in NOT_COUNTED:
                counts[(name, "lua" if m.group(1) == "lua" else "client")] += 1
        return counts


def census_view(counts: Counter[tuple[str, str]], n: int, idle: Counter[tuple[str, str]] | None = None,
                idle_scale: float = 0.0) -> dict[str, Any]:
    """Per request: client commands and those run inside scripts, each by name (`idle` x `idle_scale` taken off)."""
    net: dict[tuple[str, str], float] = {}
    for key in set(counts) | set(idle or {}):
        value = counts.get(key, 0) - (idle or {}).get(key, 0) * idle_scale
        if value > 0.005 * n:
            net[key] = value / n
    client = {k[0]: round(v, 2) for k, v in sorted(net.items(), key=lambda kv: -kv[1]) if k[1] == "client"}
    lua = {k[0]: round(v, 2) for k, v in sorted(net.items(), key=lambda kv: -kv[1]) if k[1] == "lua"}
    n_client, n_lua = round(sum(client.values()), 2), round(sum(lua.values()), 2)
    return {"requests": n, "client_commands": n_client, "lua_commands": n_lua, "total": round(n_client + n_lua, 2),
            "client": client, "lua": lua}


async def census(st: Stack, args: argparse.Namespace, *, wait: bool, idle: bool) -> dict[str, Any]:
    """`--census` requests one at a time under MONITOR (one gateway). With `idle`, an idle window of the same
    length first, whose commands (heartbeats, load reports, blocking reads) are taken off."""
    host, port = st.host_port
    idle_counts: Counter[tuple[str, str]] | None = None
    conn = Http(st.gateways[0].port)
    body = submit_body(args, 600)
    path = SUBMIT_PATH + ("?wait=60" if wait else "")
    await conn.request("POST", path, body)  # a first request: connections opened, nothing lazy left
    try:
        t0 = time.perf_counter()
        mon = Monitor(host, port)
        for _ in range(args.census):
            status, _ = await conn.request("POST", path, body)
            assert status == (200 if wait else 202), status
        spent = time.perf_counter() - t0
        counts = mon.stop()
        if idle:
            mon = Monitor(host, port)
            await asyncio.sleep(spent)
            idle_counts = mon.stop()
    finally:
        conn.close()
    return {**census_view(counts, args.census, idle_counts, 1.0), "seconds": spent,
            "background_subtracted": idle}


# --- added latency -------------------------------------------------------------------------------

async def submit_202(conn: Http, body: bytes) -> float | None:
    """The way in: a submit without waiting, sent to 202 received (ms)."""
    t0 = time.perf_counter()
    status, _ = await conn.request("POST", SUBMIT_PATH, body)
    return (time.perf_counter() - t0) * 1000 if status == 202 else None


async def done_to_wake(conn: Http, body: bytes) -> float | None:
    """The way out: a submit that waits (`?wait=`; the gateway subscribes before it stores the request), its
    result received minus the worker's finish (`created_at` + `timings.total_ms`, epoch ms), in ms."""
    status, data = await conn.request("POST", SUBMIT_PATH + "?wait=60", body)
    received_ms = time.time() * 1000
    if status != 200:
        return None
    rec = json.loads(data)
    if rec.get("status") != "succeeded":
        return None
    return received_ms - (round(rec["created_at"] * 1000) + rec["timings"]["total_ms"])


async def latency_phase(st: Stack, gateways: list[Proc], rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """Poisson arrivals at `rate` over the gateways, alternately a submit without waiting (its submit-to-202) and
    one that waits (its done-to-wake-up); a bare PING every 5 ms on a connection of its own."""
    host, port = st.host_port
    raw = RawRedis(host, port)
    idle_ping = [await raw.ping_ms() for _ in range(200)]
    body = submit_body(args, 600)
    pools: list[list[Http]] = [[] for _ in gateways]
    rng = random.Random(1)
    way_in: list[float | None] = []
    way_out: list[float | None] = []
    pings: list[float] = []
    end = time.perf_counter() + args.latency_s

    async def prober() -> None:
        while time.perf_counter() < end:
            pings.append(await raw.ping_ms())
            await asyncio.sleep(0.005)

    async def arrival(i: int) -> None:
        pool = pools[i % len(gateways)]
        conn = pool.pop() if pool else Http(gateways[i % len(gateways)].port)
        try:
            if i % 2 == 0:
                way_in.append(await submit_202(conn, body))
            else:
                way_out.append(await done_to_wake(conn, body))
        finally:
            pool.append(conn)

    tasks = [asyncio.create_task(prober())]
    i = 0
    at = time.perf_counter()
    while at < end:
        at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.create_task(arrival(i)))
        i += 1
    await asyncio.gather(*tasks)
    raw.close()
    for pool in pools:
        for conn in pool:
            conn.close()
    ins = [x for x in way_in if x is not None]
    outs = [x for x in way_out if x is not None]
    d_in, d_out = dist(ins), dist(outs)
    added = {q: None if d_in[q] is None or d_out[q] is None else d_in[q] + d_out[q]  # type: ignore[operator]
             for q in ("p50", "p99")}
    return {
        "offered_rps": rate, "requests": i, "failed": (len(way_in) - len(ins)) + (len(way_out) - len(outs)),
        "submit_to_202_ms": d_in, "done_to_wake_ms": d_out, "added_ms": {"n": min(len(ins), len(outs)), **added},
        "redis_ping_ms": dist(pings), "redis_ping_idle_ms": dist(idle_ping),
    }


def handler_seconds(gw: Proc) -> tuple[float, int, dict[str, float]]:
    """(seconds, count, count at or below each bucket) of the gateway's submit handler on its 202s so far
    (`batchgate_http_seconds`): the time inside the gateway, from the request read to the response built,
    without the event loop's queue."""
    text = httpx.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=5).text
    got = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^batchgate_http_seconds_(sum|count)\{route="submit",status="202"\} (\S+)$', text, re.M)}
    buckets = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^batchgate_http_seconds_bucket\{le="([^"]+)",route="submit",status="202"\} (\S+)$', text, re.M)}
    return got.get("sum", 0.0), int(got.get("count", 0)), buckets


def handler_tail(before: list[tuple[float, int, dict[str, float]]],
                 after: list[tuple[float, int, dict[str, float]]]) -> dict[str, float | None]:
    """The share of the phase's 202s whose time inside the handler passed 5 and 10 ms: how much of the way-in
    tail the gateway's own code makes, against the queue before it (event loop, scheduler, the generator)."""
    n = sum(b[1] - a[1] for a, b in zip(before, after, strict=True))
    out: dict[str, float | None] = {}
    for le in ("0.005", "0.01"):
        within = sum(b[2].get(le, 0.0) - a[2].get(le, 0.0) for a, b in zip(before, after, strict=True))
        out[f"over_{float(le) * 1000:g}_ms"] = (n - within) / n if n else None
    return out


# --- the run ---------------------------------------------------------------------------------------

def counts(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def run(args: argparse.Namespace) -> dict[str, Any]:
    gateway_counts, worker_counts = counts(args.gateways), counts(args.workers)
    report: dict[str, Any] = {"config": vars(args), "configs": []}
    with stack(args) as st:
        with st.client() as c:
            report["redis"] = {"private": not args.redis_url, "version": c.info("server")["redis_version"],
                               "pid": st.redis_pid}
        print(f"redis {report['redis']['version']} (pid {st.redis_pid}, "
              f"{'private' if not args.redis_url else 'shared: figures include other clients'})", flush=True)
        for _ in range(max(gateway_counts)):
            st.add_gateway()
        print(f"{len(st.gateways)} gateway process(es) up; census of a submit (no worker running)", flush=True)
        report["census_submit"] = asyncio.run(census(st, args, wait=False, idle=False))
        for w in worker_counts:
            st.set_workers(w)
            st.drain()
            if w == worker_counts[0]:
                print(f"census of a request lifecycle ({w} worker)", flush=True)
                report["census_lifecycle"] = asyncio.run(census(st, args, wait=True, idle=True))
            for g in gateway_counts:
                print(f"  {g} gateway(s) x {w} worker(s)", flush=True)
                gws = st.gateways[:g]
                row = {"gateways": g, "workers": w,
                       "submit": asyncio.run(closed_loop(st, gws, args, wait=False, label="submit")), }
                st.drain()
                row["e2e"] = asyncio.run(closed_loop(st, gws, args, wait=True, label="e2e   "))
                report["configs"].append(row)
        best = max(report["configs"], key=lambda r: r["e2e"]["rps"])
        st.set_workers(best["workers"])
        st.drain()
        gws = st.gateways[:best["gateways"]]
        # this VM's speed drifts: the ceiling the load is a share of is measured again, just before
        print(f"  the ceiling again ({best['gateways']} gateway(s) x {best['workers']} worker(s)), then its "
              f"{args.latency_load:g} for {args.latency_s:g} s", flush=True)
        ceiling = asyncio.run(closed_loop(st, gws, args, wait=True, label="e2e   "))["rps"]
        rate = args.latency_load * ceiling
        st.drain()
        handler0 = [handler_seconds(gw) for gw in gws]
        lat = asyncio.run(latency_phase(st, gws, rate, args))
        handler1 = [handler_seconds(gw) for gw in gws]
        n = sum(b[1] - a[1] for a, b in zip(handler0, handler1, strict=True))
        spent = sum(b[0] - a[0] for a, b in zip(handler0, handler1, strict=True))
        report["latency"] = {"gateways": best["gateways"], "workers": best["workers"], "ceiling_rps": ceiling, **lat,
                             "handler_202_mean_ms": spent * 1000 / n if n else None,
                             "handler_202_share": handler_tail(handler0, handler1)}
    summarise(report)
    return report


def summarise(report: dict[str, Any]) -> None:
    """The headline keys: the ceiling, the per-request costs of the smallest configuration, the goals."""
    rows = report["configs"]
    first = rows[0]
    lat = report["latency"]
    life = report["census_lifecycle"]
    report.update({
        "submit_rps": max(r["submit"]["rps"] for r in rows),
        "e2e_rps": max(r["e2e"]["rps"] for r in rows),
        "submit_rps_per_gateway": first["submit"]["rps_per_gateway"],
        "e2e_rps_per_worker": first["e2e"]["rps_per_worker"],
        "gateway_cpu_ms_per_submit": first["submit"]["gateway_cpu_ms_per_request"],
        "gateway_cpu_ms_per_request": first["e2e"]["gateway_cpu_ms_per_request"],
        "redis_cpu_ms_per_request": first["e2e"]["redis_cpu_ms_per_request"],
        "worker_cpu_ms_per_request": first["e2e"]["worker_cpu_ms_per_request"],
        # what Redis executes per whole request (commandstats, commands inside scripts included), under load
        "redis_commands_per_request": first["e2e"]["redis_commands_per_request"],
        # what clients send per whole request (a script call is one), one request at a time (MONITOR)
        "redis_client_commands_per_request": life["client_commands"],
        # the same under load, where reads, acks and deletes are batched: commandstats less the commands the
        # scripts run (a request's scripts run the same commands however many requests share a pipeline)
        "redis_client_commands_per_request_under_load": first["e2e"]["redis_commands_per_request"]
        - life["lua_commands"],
        "redis_commands_per_submit": report["census_submit"]["total"],
        "redis_client_commands_per_submit": report["census_submit"]["client_commands"],
        "added_latency_p50_ms": lat["added_ms"]["p50"],
        "added_latency_p99_ms": lat["added_ms"]["p99"],
        "redis_ping_p99_ms": lat["redis_ping_ms"]["p99"],
    })
    cpu, added = report["gateway_cpu_ms_per_submit"], report["added_latency_p99_ms"]
    report["goals"] = {
        "gateway_cpu_ms_per_submit <= 0.35": None if cpu is None else cpu <= GOALS["gateway_cpu_ms_per_submit"],
        "added_latency_p99_ms <= 5": None if added is None else added <= GOALS["added_latency_p99_ms"],
        "redis_client_commands_per_request <= 12 (one at a time)":
            report["redis_client_commands_per_request"] <= GOALS["redis_commands_per_request"],
        "redis_client_commands_per_request <= 12 (under load)":
            report["redis_client_commands_per_request_under_load"] <= GOALS["redis_commands_per_request"],
        "redis_commands_per_request <= 12 (commands inside scripts counted)":
            report["redis_commands_per_request"] <= GOALS["redis_commands_per_request"],
    }


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'gw x wk':8}{'submit/s':>10}{'/gw':>9}{'e2e/s':>9}{'/wk':>9}{'gw ms/sub':>10}{'gw ms/req':>10}"
          f"{'redis ms':>9}{'wk ms':>8}{'cmds/req':>9}")
    for r in report["configs"]:
        s, e = r["submit"], r["e2e"]
        print(f"{r['gateways']} x {r['workers']:<4}{s['rps']:>10.1f}{s['rps_per_gateway']:>9.1f}{e['rps']:>9.1f}"
              f"{e['rps_per_worker']:>9.1f}{fmt(s['gateway_cpu_ms_per_request']):>10}"
              f"{fmt(e['gateway_cpu_ms_per_request']):>10}{fmt(e['redis_cpu_ms_per_request']):>9}"
              f"{fmt(e['worker_cpu_ms_per_request']):>8}{e['redis_commands_per_request']:>9.1f}")
    print("(ms: CPU per request; submit: 202 without waiting; e2e: ?wait= to the result; cmds: commandstats)")
    lat = report["latency"]
    print(f"\nadded latency at {lat['offered_rps']:.0f} req/s ({lat['requests']} requests, half each way; "
          f"{lat['failed']} failed):")
    print(f"{'':26}{'p50 ms':>9}{'p99 ms':>9}")
    for name, key in (("submit to 202", "submit_to_202_ms"), ("done to waiter wake-up", "done_to_wake_ms"),
                      ("added (in + out)", "added_ms"), ("redis PING, same window", "redis_ping_ms"),
                      ("redis PING, idle", "redis_ping_idle_ms")):
        print(f"{name:26}{fmt(lat[key]['p50']):>9}{fmt(lat[key]['p99']):>9}")
    tail = lat.get("handler_202_share") or {}
    shares = ", ".join(f"{v:.2%} over {k.removeprefix('over_').replace('_', ' ')}" for k, v in tail.items()
                       if v is not None)
    print(f"(inside the gateway's submit handler, a 202 took {fmt(lat['handler_202_mean_ms'])} ms on average"
          f"{'; ' + shares if shares else ''})")
    for name, key in (("one submit", "census_submit"), ("one request lifecycle", "census_lifecycle")):
        c = report[key]
        print(f"\nredis commands, {name} (MONITOR, {c['requests']} one at a time): {c['client_commands']:.1f} sent by "
              f"clients + {c['lua_commands']:.1f} inside scripts")
        print("  client: " + ", ".join(f"{k} {v:g}" for k, v in c["client"].items()))
        print("  lua:    " + ", ".join(f"{k} {v:g}" for k, v in c["lua"].items()))
    print(f"\nper whole request (first configuration, under load): {report['redis_commands_per_request']:.1f} commands "
          f"executed (commandstats), {report['redis_client_commands_per_request_under_load']:.1f} sent by clients; "
          f"one at a time: {report['redis_client_commands_per_request']:.1f} sent by clients")
    print("\ngoals: " + "; ".join(f"{k}: {'met' if v else 'NOT met' if v is not None else '?'}"
                                  for k, v in report["goals"].items()))


# --- profile mode ------------------------------------------------------------------------------------

_CATEGORIES = (("/uvicorn/", "uvicorn"), ("httptools", "uvicorn"), ("uvloop", "asyncio (uvloop)"),
               ("/redis/", "redis-py"), ("hiredis", "redis-py"),
               ("/starlette/", "starlette"), ("/structlog/", "structlog (logs)"), ("msgspec", "msgspec"),
               ("msgpack", "msgpack"), ("/prometheus_client/", "prometheus"), ("/gateway/", "batchgate gateway/"),
               ("/shared/", "batchgate shared/"), ("asyncio", "asyncio"), ("/json/", "json"),
               ("_socket", "socket syscalls"), ("select.epoll", "asyncio"))


def _category(path: str, fn: str) -> str:
    text = path + " " + fn
    return next((name for key, name in _CATEGORIES if key in text), "other (builtins)")


# `batchgate gateway` with a profiler that SIGUSR1 starts and SIGUSR2 stops and writes out (start-up, warm-up and
# shut-down left out).
PROFILED_GATEWAY = """
import cProfile, signal, sys
from batchgate.cli import main
prof = cProfile.Profile()
def start(*_):
    prof.enable()
def stop(*_):
    prof.disable()
    prof.dump_stats(sys.argv[1])
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
main(["gateway"])
"""


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """cProfile inside one gateway process (no worker) over `args.profile` submits sent by this process: where
    the gateway's CPU goes, by package and by function. The profiler slows everything it watches (Python
    calls most), so the shares matter more than the absolute figures."""
    import pstats

    with stack(args) as st:
        out_file = st.tmp / "gateway.prof"
        gw = st.add_gateway(wrap=("-c", PROFILED_GATEWAY, str(out_file)))
        body = submit_body(args, 600)

        async def drive(n: int) -> int:
            conns = [Http(gw.port) for _ in range(min(8, args.clients))]
            sent = 0

            async def client(conn: Http) -> None:
                nonlocal sent
                while sent < n:
                    sent += 1
                    status, _ = await conn.request("POST", SUBMIT_PATH, body)
                    assert status == 202, status

            await asyncio.gather(*(client(conn) for conn in conns))
            for conn in conns:
                conn.close()
            return sent

        asyncio.run(drive(200))  # warm: connections opened, every first-use path taken
        gw.popen.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        cpu0 = proc_cpu_s(gw.pid)
        sent = asyncio.run(drive(args.profile))
        cpu1 = proc_cpu_s(gw.pid)
        gw.popen.send_signal(signal.SIGUSR2)
        end = time.monotonic() + 30
        while not out_file.exists() and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(0.5)  # written whole
        stats = pstats.Stats(str(out_file))
    by_cat: Counter[str] = Counter()
    for (path, _line, fn), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        by_cat[_category(path, fn)] += tt
    total = sum(by_cat.values())
    cpu_ms = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) * 1000 / sent
    print(f"gateway CPU per submit under the profiler: {fmt(cpu_ms)} ms (/proc); {sent} submits, profiled time "
          "by package:")
    for name, t in by_cat.most_common():
        print(f"  {name:32}{t / sent * 1e6:8.1f} us  {t / total:6.1%}")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(r"gateway/|shared/", 30)
    return {"profile": {"submits": sent, "gateway_cpu_ms_per_submit_profiled": cpu_ms,
                        "us_per_submit_by_package": {k: v / sent * 1e6 for k, v in by_cat.most_common()}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateways", default="1,2", help="gateway process counts to measure, e.g. 1,2,4")
    ap.add_argument("--workers", default="1,2", help="worker counts to measure, e.g. 1,2,3,4")
    ap.add_argument("--clients", type=int, default=32, help="closed-loop clients per phase")
    ap.add_argument("--warm-s", type=float, default=2.0)
    ap.add_argument("--measure-s", type=float, default=5.0, help="seconds counted per phase")
    ap.add_argument("--latency-s", type=float, default=10.0, help="seconds of the added-latency phase")
    ap.add_argument("--latency-load", type=float, default=0.5, help="its offered load, as a share of the ceiling")
    ap.add_argument("--census", type=int, default=50, help="requests the MONITOR census follows, one at a time")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=0.0, help="the echo model's sleep per decode step")
    ap.add_argument("--rows", type=int, default=64, help="the echo model's rows per worker (max_running)")
    ap.add_argument("--log-level", default="info", help="of the gateways and workers (info: as deployed)")
    ap.add_argument("--redis-url", default="", help="an existing Redis (default: a private redis-server, so "
                                                    "commandstats and its CPU are this run's alone)")
    ap.add_argument("--profile", type=int, default=0, help="profile a gateway over this many submits instead")
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if args.profile:
        report = profile(args)
    else:
        report = run(args)
        print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
