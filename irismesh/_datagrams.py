"""The membership transport: one UDP socket per node, read in batches from the event loop.

Membership datagrams are small, independent and idempotent (SWIM tolerates their loss), so
they travel as UDP, as memberlist's do, never on the links that carry requests: probing a
member must not need a link to it. The socket binds the host of the node's link endpoint, on
the same port number when it is free (one number to open in a firewall), else on any.

Like the zmq sockets, the socket is non-blocking and registered with `loop.add_reader`; each
wake-up reads up to `BATCH` datagrams, then lets the driver act on what they caused. A send
that the kernel refuses (buffer full, host unreachable) is dropped and counted: SWIM treats it
as the loss it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import Callable

BATCH = 256
_RECEIVE_BUFFER = 1 << 20  # a push-pull of a large mesh arrives as a burst of datagrams
_MAX_DATAGRAM = 65535


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6 host]:port"."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DatagramSocket:
    """A bound, non-blocking UDP socket feeding `on_datagram(source, data)`."""

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.setblocking(False)
        with contextlib.suppress(OSError):  # capped by the system: the default still works
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
        try:
            sock.bind((host, port))
        except OSError:
            if port == 0:
                sock.close()
                raise
            sock.bind((host, 0))  # the link's port number is taken for UDP here: any other
        self._sock = sock
        self._addresses: dict[str, tuple[str, int]] = {}
        self.address = join_address(host, sock.getsockname()[1])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_datagram: Callable[[str, bytes], None] = lambda source, data: None
        self._on_batch: Callable[[], None] = lambda: None
        self._stats: Counter[str] = Counter()
        self._closed = False

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_datagram: Callable[[str, bytes], None],
        on_batch: Callable[[], None],
        stats: Counter[str],
    ) -> None:
        """Read from the loop: each datagram to `on_datagram`, then `on_batch()` once."""
        self._loop = loop
        self._on_datagram = on_datagram
        self._on_batch = on_batch
        self._stats = stats
        loop.add_reader(self._sock.fileno(), self.drain)

    def drain(self) -> None:
        """Read what is waiting (up to BATCH datagrams), then let the driver act once."""
        if self._closed:
            return
        receive, on_datagram = self._sock.recvfrom, self._on_datagram
        got = 0
        for _ in range(BATCH):
            try:
                data, source = receive(_MAX_DATAGRAM)
            except BlockingIOError:
                break
            except OSError:  # an ICMP error for an earlier send: a peer that is gone
                self._stats["datagram_errors"] += 1
                continue
            got += 1
            on_datagram(join_address(source[0], source[1]), data)
        else:
            if self._loop is not None:
                self._loop.call_soon(self.drain)  # more may wait: after others had a turn
        if got:
            self._on_batch()

    def send(self, address: str, data: bytes) -> None:
        target = self._addresses.get(address)
        if target is None:
            try:
                target = split_address(address)
            except ValueError:
                self._stats["dropped_bad_address"] += 1
                return
            if len(self._addresses) >= 4096:
                self._addresses.clear()
            self._addresses[address] = target
        try:
            self._sock.sendto(data, target)
        except OSError:
            self._stats["datagrams_unsendable"] += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
