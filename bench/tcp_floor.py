"""The floor under one request at a time: plain TCP on uvloop beside raw pyzmq, one run.

    python bench/tcp_floor.py [--rounds 5] [--requests 3000] [--size 100]

Each round starts two echo servers on 127.0.0.1, one after the other, each a child process with
this process as the client, and times --requests requests of --size bytes one at a time after a
warm-up:

- raw pyzmq: `bench/reqrep.py`'s raw server (a blocking ROUTER echoing) and a blocking DEALER;
- uvloop TCP: asyncio Protocols on uvloop, TCP_NODELAY, the server writing back what it reads.

Both sides of raw pyzmq pay zmq's I/O thread: a message crosses from the application's thread to
it and back on each side. Plain TCP on an event loop does not. The medians of the rounds' p50s
are the floor under irismesh's TCP links (the default, `irismesh/_stream.py`), which carry
irismesh's frames over the same kind of connection (see bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reqrep  # bench/reqrep.py: the same raw pyzmq server
from _harness import ChildProcesses, on_stdin_eof

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    uvloop = None

WARMUP = 300


def _nodelay(transport: Any) -> None:  # uvloop's transports are no asyncio.Transport
    transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


async def serve_tcp() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Echo, "127.0.0.1", 0)
    stopped = asyncio.Event()
    on_stdin_eof(lambda: loop.call_soon_threadsafe(stopped.set))
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    await stopped.wait()
    server.close()


class _Client(asyncio.Protocol):
    def __init__(self, size: int) -> None:
        self.size = size
        self.waiting: asyncio.Future[None] | None = None
        self.got = 0

    def connection_made(self, transport: Any) -> None:
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= self.size and self.waiting is not None and not self.waiting.done():
            self.got -= self.size
            self.waiting.set_result(None)


async def _time_tcp(port: int, size: int, n: int) -> float:
    loop = asyncio.get_running_loop()
    transport, client = await loop.create_connection(lambda: _Client(size), "127.0.0.1", port)
    payload = b"x" * size
    samples = []
    for i in range(WARMUP + n):
        client.waiting = loop.create_future()
        began = time.perf_counter_ns()
        transport.write(payload)
        await client.waiting
        if i >= WARMUP:
            samples.append(time.perf_counter_ns() - began)
    transport.close()
    return statistics.median(samples) / 1000


def _time_zmq(endpoint: str, size: int, n: int) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.connect(endpoint)
    payload = b"x" * size
    samples = []
    for i in range(WARMUP + n):
        began = time.perf_counter_ns()
        sock.send(payload)
        reqrep._raw_recv(sock, payload)
        if i >= WARMUP:
            samples.append(time.perf_counter_ns() - began)
    sock.close()
    ctx.term()
    return statistics.median(samples) / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--serve", choices=("zmq", "tcp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "zmq":
        reqrep.serve_raw()
        return 0
    if args.serve == "tcp":
        (uvloop.run if uvloop is not None else asyncio.run)(serve_tcp())
        return 0
    if uvloop is None:
        raise SystemExit("uvloop is not installed: pip install uvloop")
    if args.rounds < 1 or args.requests < 100 or args.size < 1:
        parser.error("--rounds and --size must be positive, --requests at least 100")
    zmq_p50: list[float] = []
    tcp_p50: list[float] = []
    me = [sys.executable, __file__, "--serve"]
    with ChildProcesses() as children:
        for round_ in range(args.rounds):
            server = children.spawn("raw pyzmq server", [*me, "zmq"])
            endpoint = server.expect_prefix("READY ", timeout=30.0)
            zmq_p50.append(_time_zmq(endpoint, args.size, args.requests))
            children.stop(server)
            server = children.spawn("uvloop TCP server", [*me, "tcp"])
            port = int(server.expect_prefix("READY ", timeout=30.0))
            tcp_p50.append(uvloop.run(_time_tcp(port, args.size, args.requests)))
            children.stop(server)
            print(
                f"round {round_ + 1}/{args.rounds}: raw pyzmq {zmq_p50[-1]:.0f} us, "
                f"uvloop TCP {tcp_p50[-1]:.0f} us",
                file=sys.stderr,
                flush=True,
            )
    z, t = statistics.median(zmq_p50), statistics.median(tcp_p50)
    print(f"one outstanding, {args.size} B, p50, median of {args.rounds} rounds:")
    print(f"  raw pyzmq (blocking DEALER/ROUTER): {z:.0f} us")
    print(f"  uvloop TCP (asyncio Protocols):     {t:.0f} us ({t / z:.2f}x raw pyzmq)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
