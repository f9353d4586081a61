"""The headers' deadline (`gateway.header_timeout`): a connection that never finishes its headers is answered
408 and closed, on both of uvicorn's HTTP implementations; a request whose headers came in time is served, its
body left to the app's own deadline; and the gateway process applies `BATCHGATE_HEADER_TIMEOUT_S`."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from gateway.header_timeout import protocol_class
from shared.embedded_redis import free_port
from tests.stack import gateway_process

pytestmark = [pytest.mark.redis]

TIMEOUT_S = 0.6


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers its length."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        msg = await receive()
        size += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(impl: str) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(echo_app, host="127.0.0.1", port=port, http=protocol_class(TIMEOUT_S, impl),
                            log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    listener = socket.create_server(("127.0.0.1", port))  # listening before the server runs: connects queue
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    first = connect(port)  # a whole request answered: the server is serving (a blocking read, no polling)
    first.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert read_all(first).startswith(b"HTTP/1.1 200 ")
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def read_response(sock: socket.socket) -> bytes:
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(4096)
    head, _, body = out.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(4096)
    return head.split(b"\r\n")[0] + b" " + body


@pytest.mark.parametrize("impl", ["h11", "httptools"])
def test_headers_that_never_end_get_408_and_the_connection_closes(impl):
    with serving(impl) as port:
        idle = connect(port)  # sends nothing at all
        t0 = time.monotonic()
        assert read_all(idle).startswith(b"HTTP/1.1 408 ")
        assert TIMEOUT_S * 0.9 <= time.monotonic() - t0 < TIMEOUT_S + 2

        slow = connect(port)  # trickles its headers: the deadline runs from the first byte, never pushed back
        t0 = time.monotonic()
        closed_at = None
        for ch in b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100:
            try:
                slow.sendall(bytes([ch]))
            except OSError:
                break
            slow.settimeout(0.05)
            try:
                if slow.recv(4096).startswith(b"HTTP/1.1 408 "):
                    closed_at = time.monotonic()
                    break
            except TimeoutError:
                pass
        assert closed_at is not None and TIMEOUT_S * 0.9 <= closed_at - t0 < TIMEOUT_S + 2


@pytest.mark.parametrize("impl", ["h11", "httptools"])
def test_requests_whose_headers_come_in_time_are_served_each_with_its_own_deadline(impl):
    with serving(impl) as port:
        sock = connect(port)
        for _ in range(3):  # kept alive across requests slower, together, than one deadline
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")
            time.sleep(TIMEOUT_S / 2)
            sock.sendall(b"\r\n")
            assert read_response(sock) == b"HTTP/1.1 200 OK 0"
        # the body is not the headers' deadline's concern: it may come later (the app bounds it)
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nab")
        time.sleep(TIMEOUT_S * 2)
        sock.sendall(b"cde")
        assert read_response(sock) == b"HTTP/1.1 200 OK 5"
        sock.sendall(b"GET / HTTP/1.1\r\n")  # and the next request's headers have their own deadline
        assert read_all(sock).startswith(b"HTTP/1.1 408 ")


def test_the_gateway_applies_the_configured_header_and_keep_alive_timeouts(redis_url, prefix, tmp_path: Path):
    """Headers: 1 s. Keep-alive: 3 s, so an idle connection outlives the headers' deadline (which starts only
    with a request's first byte) and is closed by the gateway after 3 s; by default 75 s, longer than the idle
    limits of the clients and load balancers in front (httpx 5 s, an AWS ALB 60 s): they close first."""
    from shared.config import Settings

    assert Settings().keep_alive_s > 60
    port = free_port()
    env = {**os.environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix, "BATCHGATE_AUTH": "off",
           "BATCHGATE_HOST": "127.0.0.1", "BATCHGATE_PORT": str(port), "BATCHGATE_MODELS": "echo",
           "BATCHGATE_CONFIG_YAML": "models:\n  - {name: echo, task: generate, kind: echo}\n",
           "BATCHGATE_HEADER_TIMEOUT_S": "1", "BATCHGATE_KEEP_ALIVE_S": "3"}
    proc, _ = gateway_process(env, tmp_path / "gateway.log")
    try:
        sock = connect(port)
        sock.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\n")
        t0 = time.monotonic()
        assert read_all(sock).startswith(b"HTTP/1.1 408 ")
        assert 0.9 <= time.monotonic() - t0 < 5

        sock = connect(port)
        for _ in range(2):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.5)  # idle past the headers' deadline, within the keep-alive
        t0 = time.monotonic()
        assert read_all(sock) == b""  # closed by the gateway once idle for 3 s, without a word
        assert 0.5 <= time.monotonic() - t0 < 4
    finally:
        proc.terminate()
        proc.wait(30)
