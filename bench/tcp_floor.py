"""The floor under one request at a time: plain TCP on uvloop beside raw pyzmq, one run.

    python bench/tcp_floor.py [--rounds 5] [--requests 3000] [--size 100]

Each round starts two echo pairs on 127.0.0.1, one after the other, each a server process and
this process as the client, and times --requests requests of --size bytes one at a time after a
warm-up:

- raw pyzmq: a blocking ROUTER echoing (as `bench/reqrep.py`'s raw server) and a blocking
  DEALER;
- uvloop TCP: asyncio Protocols on uvloop, TCP_NODELAY, the server writing back what it reads.

Both sides of raw pyzmq pay zmq's I/O thread: a message crosses from the application's thread to
it and back on each side. Plain TCP on an event loop does not. The medians of the rounds' p50s
say what a transport without that hop could save irismesh, whose links run on zmq (see
bench/README.md: irismesh sits at 1.3-1.9x raw pyzmq's p50).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import zmq

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    uvloop = None


def _exit_on_stdin_eof() -> None:
    """The parent closes our stdin to stop us."""

    def wait() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=wait, daemon=True).start()


def serve_zmq() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    _exit_on_stdin_eof()
    print(port, flush=True)
    recv, send = sock.recv_multipart, sock.send_multipart
    while True:
        send(recv())


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:  # uvloop's is no asyncio.Transport
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


async def _serve_tcp() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # until the parent closes stdin
    server.close()


class _Client(asyncio.Protocol):
    def __init__(self, size: int) -> None:
        self.size = size
        self.waiting: asyncio.Future[None] | None = None
        self.got = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= self.size and self.waiting is not None and not self.waiting.done():
            self.got -= self.size
            self.waiting.set_result(None)


async def _time_tcp(port: int, size: int, warmup: int, n: int) -> float:
    loop = asyncio.get_running_loop()
    transport, client = await loop.create_connection(lambda: _Client(size), "127.0.0.1", port)
    payload = b"x" * size
    samples = []
    for i in range(warmup + n):
        client.waiting = loop.create_future()
        began = time.perf_counter_ns()
        transport.write(payload)
        await client.waiting
        if i >= warmup:
            samples.append(time.perf_counter_ns() - began)
    transport.close()
    return statistics.median(samples) / 1000


def _time_zmq(port: int, size: int, warmup: int, n: int) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.connect(f"tcp://127.0.0.1:{port}")
    payload = b"x" * size
    samples = []
    for i in range(warmup + n):
        began = time.perf_counter_ns()
        sock.send(payload)
        sock.recv()
        if i >= warmup:
            samples.append(time.perf_counter_ns() - began)
    sock.close()
    ctx.term()
    return statistics.median(samples) / 1000


def _server(kind: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        raise SystemExit(f"the {kind} echo server did not start")
    return proc, int(line)


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--serve", choices=("zmq", "tcp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "zmq":
        serve_zmq()
        return 0
    if args.serve == "tcp":
        (uvloop.run if uvloop is not None else asyncio.run)(_serve_tcp())
        return 0
    if uvloop is None:
        raise SystemExit("uvloop is not installed: pip install uvloop")
    if args.rounds < 1 or args.requests < 100 or args.size < 1:
        parser.error("--rounds and --size must be positive, --requests at least 100")
    warmup = 300
    zmq_p50: list[float] = []
    tcp_p50: list[float] = []
    for round_ in range(args.rounds):
        proc, port = _server("zmq")
        try:
            zmq_p50.append(_time_zmq(port, args.size, warmup, args.requests))
        finally:
            _stop(proc)
        proc, port = _server("tcp")
        try:
            tcp_p50.append(uvloop.run(_time_tcp(port, args.size, warmup, args.requests)))
        finally:
            _stop(proc)
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
