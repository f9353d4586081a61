"""`batchgate up`: Redis (embedded unless one is named), a gateway, a worker and a webhook dispatcher as
child processes; ready when the gateway answers /readyz and a worker has announced every model; stops
them all on a signal or when one of them exits, the embedded Redis included (each such end is named: the part
and its exit status or signal).

Stopping goes in order, so that work in flight is not lost and nothing retries against a Redis that is
already gone: the gateway first (no new intake), then the worker (it finishes what it runs within its
drain budget, `BATCHGATE_DRAIN_BUDGET_S`, 10 s under `up`), then the webhook dispatcher, then Redis.
The children run in their own sessions, so a terminal's Ctrl+C reaches `up` alone, and on Linux they
die with `up` (PR_SET_PDEATHSIG) should it be killed outright. Exit status: 0 when every part stopped
cleanly on request, 1 when a part failed or had to be killed. The embedded Redis keeps nothing: what was still
queued in it when it stops (requests, batches) is counted and said to be discarded; uploaded files, whose records
it holds, go with it (a directory of their own, removed at the end, unless `BATCHGATE_FILES_DIR` or an S3 bucket
is set).
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from batchgate.state import remove_state, write_state
from shared.config import Settings, redis_url_from, shown_url
from shared.embedded_redis import free_port, start_embedded_redis
from shared.keys import Keys
from shared.lifeline import die_with_parent
from shared.states import Task

STARTUP_TIMEOUT_S = 600.0
UP_DRAIN_BUDGET_S = 10.0  # the worker's drain budget under `up` unless BATCHGATE_DRAIN_BUDGET_S is set
STOP_MARGIN_S = 10.0  # a part's time to exit after its own drain or grace, before it is killed
STOP_ORDER = ("gateway", "batches", "worker", "callbacks")  # intake first, then the work, then its webhooks
PART_NAMES = {"gateway": "gateway", "worker": "worker", "callbacks": "webhook dispatcher (callbacks)",
              "batches": "batch runner (batches)", "redis": "embedded Redis (redis-server)"}


def ended(part: str, status: int) -> str:
    """How a part ended, for a user: "the worker was killed by SIGKILL", "the gateway exited with status 1"."""
    name = PART_NAMES.get(part, part)
    if status < 0:
        try:
            how = f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            how = f"was killed by signal {-status}"
    else:
        how = f"exited with status {status}" if status else "exited (status 0) although nothing asked it to stop"
    return f"the {name} {how}"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _workers_up(redis_url: str, prefix: str, models: set[str]) -> bool:
    import redis

    from shared.redis_io import make_sync_redis

    try:
        client = make_sync_redis(redis_url, socket_timeout=1.0)
        seen: set[str] = set()
        for raw in client.hvals(f"{prefix}:workers"):
            seen.update(json.loads(raw).get("models", []))
        client.close()
        return models <= seen
    except (redis.RedisError, OSError, ValueError):
        return False


def redis_problem(redis_url: str, timeout_s: float = 3.0) -> str | None:
    """Why the Redis at `redis_url` cannot serve the stack (unreachable, or not a Redis), or None when it answers."""
    import redis

    from shared.redis_io import make_sync_redis

    client = None
    try:
        client = make_sync_redis(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        client.ping()
    except redis.exceptions.InvalidResponse as exc:
        return f"it does not answer as Redis does: {' '.join(str(exc).split())}"
    except (redis.RedisError, OSError) as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")
    finally:
        if client is not None:
            client.close()
    return None


def unfinished_work(redis_url: str, prefix: str) -> tuple[int, int] | None:
    """Accepted requests with no result yet (records queued, or running and handed back), and batches not finished,
    or None when the Redis cannot say."""
    import redis

    from shared.redis_io import make_sync_redis

    try:
        client = make_sync_redis(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            count = 0
            records = list(client.scan_iter(match=Keys(prefix).record("*"), count=1000))
            for start in range(0, len(records), 1000):
                pipe = client.pipeline(transaction=False)
                for key in records[start:start + 1000]:
                    pipe.hget(key, "state")
                count += sum(state in (b"queued", b"running") for state in pipe.execute())
            return count, int(client.zcard(Keys(prefix).batches_active()))
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return None


def _port_taken(host: str, port: int) -> bool:
    """Whether another process listens on `host:port` (binding as uvicorn does, with SO_REUSEADDR)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


class Stack:
    """The processes `batchgate up` supervises, and those it watches but did not start (the embedded Redis)."""

    def __init__(self, procs: dict[str, subprocess.Popen[bytes]],
                 watched: Mapping[str, Callable[[], int | None]] | None = None) -> None:
        self.procs = procs
        self.watched = dict(watched or {})  # part -> its poll(): None while it runs, else its exit status
        self.stop_requested = False
        self.signals = 0  # a signal that arrives while stopping means: stop at once

    @classmethod
    def start(cls, env: Mapping[str, str], watched: Mapping[str, Callable[[], int | None]] | None = None) -> Stack:
        """A worker, a gateway, a webhook dispatcher and a batch runner, each `python -m batchgate <part>`;
        SIGINT/SIGTERM ask it to stop. `watched`: parts started elsewhere whose end stops the stack too."""
        cli = [sys.executable, "-m", "batchgate"]
        parts = ("worker", "gateway", "callbacks", "batches")
        stack = cls({part: subprocess.Popen([*cli, part], env=dict(env), start_new_session=True,
                                            preexec_fn=die_with_parent()) for part in parts}, watched)
        signal.signal(signal.SIGINT, stack._on_signal)
        signal.signal(signal.SIGTERM, stack._on_signal)
        return stack

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_requested = True
        self.signals += 1

    def exited(self) -> tuple[str, int] | None:
        """The first part found ended, with its exit status (negative: the signal), or None while all run."""
        for part, p in self.procs.items():
            if (status := p.poll()) is not None:
                return part, status
        for part, poll in self.watched.items():
            if (status := poll()) is not None:
                return part, status
        return None

    def wait_ready(self, base: str, redis_url: str, settings: Settings) -> bool:
        """True once the gateway answers /readyz and workers announced every model; False on a signal, when a
        part ends first, or after `STARTUP_TIMEOUT_S` (then `not_ready` says which part, and why)."""
        end = time.monotonic() + STARTUP_TIMEOUT_S
        models = {m.name for m in settings.models}
        while not self.stop_requested and not self.exited() and time.monotonic() < end:
            if _http_ok(base + "/readyz") and _workers_up(redis_url, settings.key_prefix, models):
                return True
            time.sleep(0.2)
        return False

    def not_ready(self, base: str, port: int, settings: Settings) -> str:
        """Why the stack did not become ready: the part that ended first, else the part that did not answer."""
        if (end := self.exited()) is not None:
            why = ended(*end)
            if end[0] == "gateway" and _port_taken(settings.host, port):
                why += (f": {settings.host}:{port} is in use by another process (choose another port with --port "
                        "or BATCHGATE_PORT)")
            return why
        if not _http_ok(base + "/readyz"):
            return f"the gateway did not answer {base}/readyz within {STARTUP_TIMEOUT_S:g} s"
        return (f"the worker did not announce every model ({', '.join(m.name for m in settings.models)}) within "
                f"{STARTUP_TIMEOUT_S:g} s")

    def supervise(self) -> int:
        """Run until a signal (exit 0) or until a part ends (exit 1), saying which and how."""
        while not self.stop_requested:
            if (end := self.exited()) is not None:
                lost = "; what it held is lost" if end[0] == "redis" else ""
                print(f"batchgate up: {ended(*end)}{lost}; stopping the stack", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        return 0

    def stop(self, drain_budget_s: float = UP_DRAIN_BUDGET_S, shutdown_grace_s: float = 10.0) -> bool:
        """Stop the parts one by one in `STOP_ORDER`; True when each exited cleanly within its time: the worker's
        drain budget, the gateway's shutdown grace (`BATCHGATE_SHUTDOWN_GRACE_S`: its waiters and streams get
        their results), each plus `STOP_MARGIN_S`."""
        clean = True
        signals_before = self.signals
        if any(p.poll() is None for p in self.procs.values()):
            print("batchgate up: stopping in order (Ctrl-C again stops at once)", file=sys.stderr, flush=True)
        for part in STOP_ORDER:
            p = self.procs.get(part)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                own = {"worker": drain_budget_s, "gateway": shutdown_grace_s}.get(part, 0.0)
                end = time.monotonic() + own + STOP_MARGIN_S
                while p.poll() is None and time.monotonic() < end and self.signals == signals_before:
                    time.sleep(0.05)
                if p.poll() is None:
                    why = ("still running at a second Ctrl+C" if self.signals != signals_before
                           else "did not stop in time")
                    print(f"batchgate up: the {PART_NAMES.get(part, part)} {why}; killing it", file=sys.stderr,
                          flush=True)
                    p.kill()
                    p.wait()
                    clean = False
            if p.returncode not in (0, -signal.SIGTERM):
                clean = False
        return clean


def _port_or_free(preferred: int, host: str = "127.0.0.1") -> int:
    """`preferred` (a documented default) when it is free or 0 (off), else a free port."""
    if preferred == 0:
        return 0
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, preferred))
        return preferred
    except OSError:
        return free_port(host)


def run_stack(settings: Settings, environ: Mapping[str, str]) -> int:
    """Start the stack from `environ` (the caller's, with its command-line overrides) and supervise it."""
    embedded, files_dir = None, None
    redis_url = redis_url_from(environ)
    if not redis_url:
        embedded = start_embedded_redis()
        redis_url = embedded.url
        if not environ.get("BATCHGATE_FILES_DIR") and not environ.get("BATCHGATE_FILES_S3_BUCKET"):
            # the files' records live in this Redis: their bytes would outlive it on disk, unreachable
            files_dir = tempfile.mkdtemp(prefix="batchgate-up-files-")
    else:  # a Redis named: find out now, not from the parts' tracebacks and a stack that never gets ready
        problem = redis_problem(redis_url)
        if problem:
            print(f"batchgate up: cannot reach Redis at {shown_url(redis_url)} ({problem})", file=sys.stderr)
            return 1
    port = settings.port or free_port()
    env = {**environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_HOST": settings.host,
           "BATCHGATE_PORT": str(port), "BATCHGATE_MODELS": ",".join(m.name for m in settings.models)}
    if files_dir is not None:
        env["BATCHGATE_FILES_DIR"] = files_dir
    # the documented metrics ports (9464 worker, 9465 dispatcher) unless set or taken
    env.setdefault("BATCHGATE_WORKER_METRICS_PORT", str(_port_or_free(settings.worker_metrics_port)))
    env.setdefault("BATCHGATE_DISPATCHER_METRICS_PORT", str(_port_or_free(settings.dispatcher_metrics_port)))
    env.setdefault("BATCHGATE_AUTH", "off")  # local use; the gateway logs it loudly
    env.setdefault("BATCHGATE_DRAIN_BUDGET_S", str(UP_DRAIN_BUDGET_S))
    drain_budget_s = float(env["BATCHGATE_DRAIN_BUDGET_S"])
    stack = Stack.start(env, watched={"redis": embedded.poll} if embedded is not None else None)
    base = f"http://{settings.host}:{port}"
    code = 1
    try:
        if not stack.wait_ready(base, redis_url, settings):
            if stack.stop_requested:
                code = 0
            else:
                why = stack.not_ready(base, port, settings)
                print(f"batchgate up: the stack did not become ready: {why}; stopping the stack", file=sys.stderr)
        else:
            write_state(environ, {"redis_url": redis_url, "key_prefix": settings.key_prefix, "gateway": base,
                                  "redis": embedded.kind if embedded else "external",
                                  "worker_metrics_port": int(env["BATCHGATE_WORKER_METRICS_PORT"]),
                                  "dispatcher_metrics_port": int(env["BATCHGATE_DISPATCHER_METRICS_PORT"])})
            _banner(base, redis_url, embedded.kind if embedded else "external", env, settings)
            code = stack.supervise()
    finally:
        remove_state(environ)
        asked = code == 0  # stopped on request: no part's end was said yet
        if not stack.stop(drain_budget_s, settings.shutdown_grace_s):
            code = 1  # a part that failed or had to be killed (the return comes after this block)
        if embedded is not None:
            if not _embedded_ended_well(embedded.poll(), redis_url, settings.key_prefix, asked):
                code = 1
            embedded.stop()  # last: everything that used it has stopped
        if files_dir is not None:
            shutil.rmtree(files_dir, ignore_errors=True)
        print("batchgate up: stopped", file=sys.stderr, flush=True)
    return code


def _embedded_ended_well(status: int | None, redis_url: str, prefix: str, asked: bool) -> bool:
    """Before the embedded Redis stops with the stack: say how many accepted requests it discards (it keeps
    nothing), or, should it have ended on its own, say so (unless said already: `asked` is False when the stack
    stopped because a part ended, and named it); False in that case."""
    if status is not None:
        if asked:
            print(f"batchgate up: {ended('redis', status)}; what it held is lost", file=sys.stderr, flush=True)
        return False
    queued, batches = unfinished_work(redis_url, prefix) or (0, 0)
    for n, one, many in ((queued, "accepted request was still queued and is", "accepted requests were still queued "
                          "and are"), (batches, "batch not finished is", "batches not finished are")):
        if n:
            print(f"batchgate up: {n} {one if n == 1 else many} discarded with the embedded Redis (it keeps "
                  "nothing; set REDIS_URL to a persistent Redis to keep them)", file=sys.stderr, flush=True)
    return True


def _metrics_url(port: str) -> str:
    return f"http://127.0.0.1:{port}/metrics" if port != "0" else "off"


def _examples(base: str, settings: Settings) -> list[str]:
    """`try:` lines for the models served: the first embedding model's and the first generation model's."""
    embed = next((m.name for m in settings.models if m.task is Task.EMBED), None)
    generate = next((m for m in settings.models if m.task is Task.GENERATE), None)
    lines = []
    if embed is not None:
        lines.append(f"    curl -s -X POST '{base}/v1/models/{embed}/requests?wait=5' "
                     "-H 'content-type: application/json' -d '{\"input\": {\"texts\": [\"hello\"]}}'")
    if generate is not None:
        params = json.dumps({"max_new_tokens": min(32, generate.max_new_tokens)})
        lines.append(f"    curl -s -X POST '{base}/v1/models/{generate.name}/requests?wait=10' "
                     "-H 'content-type: application/json' "
                     f"-d '{{\"input\": {{\"prompt\": \"Once upon a time\"}}, \"params\": {params}}}'")
    return ["  try:", *lines] if lines else []


def _banner(base: str, redis_url: str, redis_kind: str, env: Mapping[str, str], settings: Settings) -> None:
    allow = env.get("BATCHGATE_CALLBACK_ALLOW", "")
    lines = [
        f"batchgate is up: {base}",
        f"  redis:   {shown_url(redis_url)} ({redis_kind})",
        f"  models:  {', '.join(m.name + ' (' + m.task.value + ')' for m in settings.models)}",
        f"  metrics: {base}/metrics (gateway), {_metrics_url(env['BATCHGATE_WORKER_METRICS_PORT'])} (worker), "
        f"{_metrics_url(env['BATCHGATE_DISPATCHER_METRICS_PORT'])} (webhook dispatcher)",
        *_examples(base, settings),
        "  auth:    " + ("OFF (local use: every caller is tenant default)" if env.get("BATCHGATE_AUTH") == "off"
                         else "API keys (batchgate keys create --tenant NAME)"),
        "  webhooks: " + (f"may also target {allow} (BATCHGATE_CALLBACK_ALLOW)" if allow else
                          "public addresses only; for a receiver on this machine (development), start with "
                          "BATCHGATE_CALLBACK_ALLOW=127.0.0.1 batchgate up"),
        "  admin:   batchgate keys|tenants|webhooks ... find this stack by itself while it runs",
        "  Ctrl-C stops everything (intake, then in-flight work, then webhooks, then Redis).",
    ]
    print("\n".join(lines), flush=True)
