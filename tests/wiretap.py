"""Recording what crosses 127.0.0.1: a frame-aware TCP proxy, and a capture of the loopback.

`RecordingProxy` sits between a node that dials and the endpoint it should reach: the dialler
is given the proxy's endpoint, and the proxy forwards every byte both ways and keeps them. It
forwards whole frames, of either link transport: irismesh's own (a 4-byte length, then the
frame) or ZMTP (after its 64-byte greeting, which starts with 0xff, a byte no length of ours
starts with). So it can also split what it saw into messages and inject frames between two
frames of a live connection, as a man in the middle would (`Connection.inject`).

`LoopbackCapture` records packets on the `lo` interface with an AF_PACKET socket (root only),
kernel-filtered to the given TCP ports and to UDP, and puts TCP streams back together by
sequence number, so it sees links no proxy was put on (a member's dial-back) and multicast
answers sent to ports nobody chose.

`multicast_sender` and `group_listener` are the plain sockets a test sends surveys with and
hears a survey group on, both pinned to loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import socket
import struct
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from helpers import wait_until

import irismesh
from irismesh._core.links import DialRecord
from irismesh.discovery.survey import SurveyConfig

LOOPBACK = "127.0.0.1"
ZMTP_GREETING = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def multicast_sender(*, blocking: bool = True) -> socket.socket:
    """A socket that sends multicast out of loopback only (TTL 1), and hears unicast answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((LOOPBACK, 0))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(LOOPBACK))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    sock.setblocking(blocking)
    return sock


def group_listener(config: SurveyConfig, *, blocking: bool = True) -> socket.socket:
    """A socket that hears the survey group of `config`, joined on loopback; others may listen
    on the same group and port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.group, config.port))
    membership = socket.inet_aton(config.group) + socket.inet_aton(LOOPBACK)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
    sock.setblocking(blocking)
    return sock


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


# ---------------------------------------------------------------------- the proxy


@dataclass(eq=False)
class Connection:
    """One proxied TCP connection: the bytes each way, and its messages."""

    upstream: bytearray = field(default_factory=bytearray)  # dialler -> listener
    downstream: bytearray = field(default_factory=bytearray)  # listener -> dialler
    frames_up: list[bytes] = field(default_factory=list)  # whole frames, ZMTP's commands too
    writer_up: asyncio.StreamWriter | None = None
    zmtp: bool = False  # ZMTP (a zmq link), not irismesh's own framing

    def messages(self, upstream: bool = True) -> list[bytes]:
        """The bodies of the messages sent one way (ZMTP's commands left out)."""
        data = bytes(self.upstream if upstream else self.downstream)
        if not self.zmtp:
            return stream_frames(data)
        return [body for flags, body in zmtp_frames(data[ZMTP_GREETING:]) if not flags & _COMMAND]

    def inject(self, frame_bodies: Iterable[bytes]) -> None:
        """Send messages to the listener on this live connection, between two frames."""
        assert self.writer_up is not None
        for body in frame_bodies:
            self.writer_up.write(zmtp_frame(body) if self.zmtp else stream_frame(body))


def stream_frames(data: bytes) -> list[bytes]:
    """Each complete frame of irismesh's own framing in `data` (which starts at a frame)."""
    frames, at = [], 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        if at + 4 + size > len(data):
            break
        frames.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    return frames


def stream_frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def zmtp_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(flags, body) of each complete ZMTP 3 frame in `data` (which starts at a frame)."""
    frames, at = [], 0
    while at < len(data):
        flags = data[at]
        if flags & _LONG:
            if at + 9 > len(data):
                break
            size, start = struct.unpack_from("!Q", data, at + 1)[0], at + 9
        else:
            if at + 2 > len(data):
                break
            size, start = data[at + 1], at + 2
        if start + size > len(data):
            break
        frames.append((flags, data[start : start + size]))
        at = start + size
    return frames


def zmtp_frame(body: bytes, more: bool = False) -> bytes:
    flags = _MORE if more else 0
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack("!Q", len(body)) + body
    return bytes([flags, len(body)]) + body


class RecordingProxy:
    """A TCP proxy on 127.0.0.1 to `upstream` that records every byte both ways."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("tcp://").rpartition(":")
        assert host == LOOPBACK, f"the proxy only forwards to {LOOPBACK}, not {upstream}"
        self._upstream = (host, int(port))
        self.connections: list[Connection] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.endpoint = ""

    async def start(self) -> RecordingProxy:
        self._server = await asyncio.start_server(self._accept, LOOPBACK, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"tcp://{LOOPBACK}:{port}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> RecordingProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def finished(self) -> bool:
        """Every connection proxied so far has been closed at both ends."""
        return all(task.done() for task in self._tasks)

    @property
    def captured(self) -> bytes:
        """Every byte seen, both ways, all connections."""
        return b"".join(bytes(c.upstream) + bytes(c.downstream) for c in self.connections)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        conn = Connection(writer_up=up_writer)
        self.connections.append(conn)
        for pump in (
            self._pump(reader, up_writer, conn.upstream, conn.frames_up, conn),
            self._pump(up_reader, writer, conn.downstream, None, None),
        ):
            task = asyncio.get_running_loop().create_task(pump)
            self._tasks.add(task)

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        record: bytearray,
        frames: list[bytes] | None,
        conn: Connection | None,
    ) -> None:
        """Forward whole frames (and ZMTP's greeting as it comes), so injections never split
        one. The dialler's first byte says which framing the connection uses (`conn.zmtp`)."""
        try:
            first = await reader.read(1)
            if not first:
                return
            if first[0] != 0xFF:  # irismesh's own framing: a length, then the frame
                if conn is not None:
                    conn.zmtp = False
                head = first + await reader.readexactly(3)
                while True:
                    frame = head + await reader.readexactly(int.from_bytes(head, "big"))
                    record += frame
                    if frames is not None:
                        frames.append(frame)
                    writer.write(frame)
                    await writer.drain()
                    head = await reader.readexactly(4)
            if conn is not None:
                conn.zmtp = True
            record += first
            writer.write(first)
            while len(record) < ZMTP_GREETING:
                data = await reader.read(ZMTP_GREETING - len(record))
                if not data:
                    return
                record += data
                writer.write(data)
            while True:
                head = await reader.readexactly(2)
                if head[0] & _LONG:
                    rest = await reader.readexactly(7)
                    size = struct.unpack("!Q", head[1:] + rest)[0]
                    head += rest
                else:
                    size = head[1]
                frame = head + await reader.readexactly(size)
                record += frame
                if frames is not None:
                    frames.append(frame)
                writer.write(frame)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def proxied_client(
    member: irismesh.Node, cluster: str, **options: Any
) -> AsyncIterator[tuple[irismesh.Node, RecordingProxy]]:
    """A client seeded with a proxy to `member`, whose requests to `cluster` cross the proxy.

    The member dials every client back and names its own endpoint in that HELLO, so a client
    would also dial it directly, and whichever of the two links came up first would carry the
    requests. On a busy machine the direct one can win every time (the proxy's pumps share the
    test's event loop), so the client is told, before its loop runs, never to dial the member's
    own endpoint. On leaving, the client closes first and the proxy waits for the connection to
    close, so its goodbye is recorded.
    """
    proxy = await RecordingProxy(member.endpoint).start()
    client = irismesh.Node(seeds=[proxy.endpoint], **options)
    try:
        await client.start()  # no discovery: it returns before any message is handled
        core = client._core
        assert core is not None
        core._dials[member.endpoint] = DialRecord(member.endpoint, seed=False, next_at=math.inf)
        await client.wait_for_members(cluster, timeout=10)
        assert [peer.endpoint for peer in client.peers()] == [proxy.endpoint]
    except BaseException:
        await client.close()
        await proxy.close()
        raise
    try:
        yield client, proxy
    finally:
        await client.close()
        await wait_until(lambda: proxy.finished, 5, "the proxied connection to close")
        await proxy.close()


# ---------------------------------------------------------------------- the loopback capture

_ETH_P_ALL = 0x0003
_SO_ATTACH_FILTER = 26
_BPF_LD_H_ABS, _BPF_LD_B_ABS, _BPF_JEQ = 0x28, 0x30, 0x15
_BPF_LDX_MSH, _BPF_LD_H_IND, _BPF_RET = 0xB1, 0x48, 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _bpf(ports: list[int]) -> list[tuple[int, int, int, int]]:
    """IPv4 UDP, or IPv4 TCP from or to one of `ports` (classic BPF, Ethernet framing as on lo).

    Jumps count instructions forward from the next one. Layout: 0-6 checks and the source
    port, n port tests, the destination port, n port tests, drop, accept.
    """
    n = len(ports)
    drop = 8 + 2 * n
    accept = drop + 1
    prog = [
        (_BPF_LD_H_ABS, 0, 0, 12),  # 0: ethertype
        (_BPF_JEQ, 0, drop - 2, 0x0800),  # 1
        (_BPF_LD_B_ABS, 0, 0, 23),  # 2: IP protocol
        (_BPF_JEQ, accept - 4, 0, 17),  # 3: UDP
        (_BPF_JEQ, 0, drop - 5, 6),  # 4: TCP
        (_BPF_LDX_MSH, 0, 0, 14),  # 5: X = IP header length
        (_BPF_LD_H_IND, 0, 0, 14),  # 6: source port
    ]
    for port in ports:
        prog.append((_BPF_JEQ, accept - len(prog) - 1, 0, port))
    prog.append((_BPF_LD_H_IND, 0, 0, 16))  # 7 + n: destination port
    for port in ports:
        prog.append((_BPF_JEQ, accept - len(prog) - 1, 0, port))
    prog.append((_BPF_RET, 0, 0, 0))  # drop
    prog.append((_BPF_RET, 0, 0, 0x40000))  # accept
    assert len(prog) == accept + 1
    assert all(jt < 256 and jf < 256 for _c, jt, jf, _k in prog)
    return prog


@dataclass
class _Segment:
    seq: int
    data: bytes


class LoopbackCapture:
    """Packets on `lo` to or from `tcp_ports`, and every UDP datagram, while running."""

    def __init__(self, tcp_ports: Iterable[int]) -> None:
        self._ports = sorted(set(tcp_ports))
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._tcp: dict[tuple[int, int], list[_Segment]] = {}
        self.udp: list[bytes] = []
        self.packets = 0

    @staticmethod
    def available() -> str | None:
        """None if a capture can run here, else why not."""
        if not hasattr(socket, "AF_PACKET"):
            return "AF_PACKET sockets exist only on Linux"
        if os.geteuid() != 0:
            return "capturing packets on lo needs root (CAP_NET_RAW)"
        return None

    def start(self) -> LoopbackCapture:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        prog = _bpf(self._ports)
        filters = (_SockFilter * len(prog))(*(_SockFilter(*insn) for insn in prog))
        fprog = _SockFprog(len(prog), ctypes.cast(filters, ctypes.POINTER(_SockFilter)))
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, bytes(fprog))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind(("lo", 0))
        sock.settimeout(0.05)
        # Packets that arrived between socket() and the filter taking hold are unfiltered.
        with contextlib.suppress(OSError):
            while True:
                sock.recv(65536, socket.MSG_DONTWAIT)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="loopback-capture", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                packet, addr = self._sock.recvfrom(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if addr[2] == socket.PACKET_OUTGOING:
                continue  # lo shows each packet twice: going out, then coming in
            self.packets += 1
            self._parse(packet)

    def _parse(self, packet: bytes) -> None:
        ip = packet[14:]
        if len(ip) < 20 or ip[0] >> 4 != 4:
            return
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack_from("!H", ip, 2)[0]
        proto, transport = ip[9], ip[ihl:total]
        if proto == 17 and len(transport) >= 8:
            self.udp.append(transport[8:])
        elif proto == 6 and len(transport) >= 20:
            sport, dport, seq = struct.unpack_from("!HHI", transport)
            payload = transport[(transport[12] >> 4) * 4 :]
            if payload:
                self._tcp.setdefault((sport, dport), []).append(_Segment(seq, payload))

    def streams(self) -> dict[tuple[int, int], bytes]:
        """Each TCP direction's payload bytes in sequence order, (src port, dst port) keyed."""
        joined = {}
        for flow, segments in self._tcp.items():
            base = segments[0].seq
            ordered = sorted(segments, key=lambda s: (s.seq - base) % (1 << 32))
            data, end = bytearray(), None
            for segment in ordered:
                offset = (segment.seq - base) % (1 << 32)
                if end is None or offset >= end:
                    data += segment.data
                elif offset + len(segment.data) > end:  # a retransmission reaching further
                    data += segment.data[end - offset :]
                end = max(end or 0, offset + len(segment.data))
            joined[flow] = bytes(data)
        return joined

    @property
    def captured(self) -> bytes:
        return b"".join(self.streams().values()) + b"".join(self.udp)
