"""A webhook receiver on loopback that the test controls: counts connections, records requests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field


@dataclass
class Received:
    at: float
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    port: int
    policy: Callable[[Received, int], tuple[int, dict[str, str], float]]  # -> status, headers, delay
    connections: int = 0
    requests: list[Received] = field(default_factory=list)
    servers: list[asyncio.base_events.Server] = field(default_factory=list)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_for(self, n: int, timeout: float = 20.0) -> None:
        """Until `n` requests have been received (woken by each arrival; TimeoutError past `timeout`)."""
        async with asyncio.timeout(timeout):
            while len(self.requests) < n:
                self._arrived.clear()
                await self._arrived.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                rec = Received(time.monotonic(), method, path, headers, body)
                self.requests.append(rec)
                self._arrived.set()
                status, extra, delay = self.policy(rec, len(self.requests))
                if delay:
                    await asyncio.sleep(delay)
                head = [f"HTTP/1.1 {status} X", "content-length: 0", *(f"{k}: {v}" for k, v in extra.items())]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()


def ok(rec: Received, n: int) -> tuple[int, dict[str, str], float]:
    return 200, {}, 0.0


@contextlib.asynccontextmanager
async def receiver(policy: Callable[[Received, int], tuple[int, dict[str, str], float]] = ok,
                   ipv6: bool = False) -> AsyncIterator[Receiver]:
    r = Receiver(0, policy)
    server = await asyncio.start_server(r._handle, "127.0.0.1", 0)
    r.port = server.sockets[0].getsockname()[1]
    r.servers.append(server)
    if ipv6 and socket.has_ipv6:
        with contextlib.suppress(OSError):
            r.servers.append(await asyncio.start_server(r._handle, "::1", r.port))
    try:
        yield r
    finally:
        for s in r.servers:
            s.close()
