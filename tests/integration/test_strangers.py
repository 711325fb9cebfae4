"""Strangers on the TCP links: connections that have not proven the mesh key.

Each mechanism alone, against a member whose other defences are out of the way: the deadline
(the bounds not reached), and a HELLO that came while the loop stalled past it; the bound per
address (the deadline far off); the room made when descriptors run out (both far off); what a
stranger may buffer; and zmq's deadline on a gateway's link listener. Members that
hold connections by the thousand run in a process of their own (tests/held_member.py), with a
descriptor limit of 1,024; the connections are this process's, each opened again when the
member closes it, until the test is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import pytest
from helpers import ROOT, deadline, end_child, wait_until

import irismesh
from irismesh._core.config import CoreConfig
from irismesh._core.frames import BodyCodec, Kind, encode_header
from irismesh._core.gossip import MAX_ADDRESS, MAX_NAME, MAX_TAGS, seal_name
from irismesh._core.records import MemberRecord, record_transcript
from irismesh._stream import HELLO_LIMIT, framed
from irismesh.security.identity import Identity
from irismesh.security.keyring import Keyring
from irismesh.security.linksecurity import KeyedLinkSecurity

MEMBER = [sys.executable, str(ROOT / "tests" / "held_member.py")]
HELD = 1100  # connections held against a member whose descriptor limit is 1,024


@pytest.fixture(autouse=True)
def descriptors() -> Iterator[None]:
    """Room in this process for the connections it holds (its own limit, raised meanwhile if
    need be)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * HELD
    if soft >= want:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"this process may open {hard} descriptors, the test needs {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@asynccontextmanager
async def held_member(keyfile: Path, stderr: Path, *options: str) -> AsyncIterator[tuple[str, int]]:
    """A member in a process of its own, with a descriptor limit of 1,024: its endpoint, pid."""
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    env.pop("IRISMESH_KEYS", None)
    with stderr.open("w") as errors:
        proc = await asyncio.create_subprocess_exec(
            *MEMBER,
            *options,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
            env=env,
        )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        ready, endpoint, pid = line.split()
        assert ready == "READY", line
        yield endpoint, int(pid)
    finally:
        await end_child(proc, 10)


def rss(pid: int) -> int:
    """Bytes of the process's resident memory."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def member_stats(client: irismesh.Node) -> dict[str, int]:
    stats: dict[str, int] = json.loads(await client.request("db", b"stats", timeout=5))
    return stats


class Holder:
    """Connections to one endpoint, each sending `opening` and then nothing, each opened again
    (after `again` seconds) when the member closes it, until `stop`."""

    def __init__(self, endpoint: str, opening: bytes = b"", again: float = 1.0) -> None:
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        self.host, self.port = host, int(port)
        self.opening = opening
        self.again = again
        self.counts: Counter[str] = Counter()  # opened, closed (by the member), unconnected
        self.open = 0  # held now
        self.closed_after: list[float] = []  # how long each was open (the first round only)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, n: int) -> None:
        self._tasks += [asyncio.create_task(self._hold()) for _ in range(n)]

    async def _hold(self) -> None:
        loop = asyncio.get_running_loop()
        first = True
        while not self._stop.is_set():
            # Timed from before the connect: the member cannot accept before it began, and the
            # connect's completion may reach this loop late (a busy loop opening many).
            opened = loop.time()
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.counts["unconnected"] += 1
                await self._pause()
                continue
            self.counts["opened"] += 1
            self.open += 1
            try:
                if self.opening:
                    writer.write(self.opening)
                stop = asyncio.create_task(self._stop.wait())
                read = asyncio.create_task(reader.read())
                await asyncio.wait([stop, read], return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                read.cancel()
                if not self._stop.is_set():
                    self.counts["closed"] += 1
                    if first and len(self.closed_after) < 10_000:
                        self.closed_after.append(loop.time() - opened)
            except OSError:
                self.counts["closed"] += 1
            finally:
                self.open -= 1
                writer.close()
            first = False
            await self._pause()

    async def _pause(self) -> None:
        """Wait `again` seconds before opening anew, or until `stop`."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self.again)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Caller:
    """Requests one after another from a node that joined before, counting failures."""

    def __init__(self, node: irismesh.Node) -> None:
        self.node = node
        self.counts: Counter[str] = Counter()
        self._task = asyncio.create_task(self._call())

    async def _call(self) -> None:
        while True:
            try:
                assert await self.node.request("db", b"x", timeout=5) == b"db:x"
                self.counts["ok"] += 1
            except irismesh.MeshError:
                self.counts["failed"] += 1
            await asyncio.sleep(0.01)

    async def stop(self) -> Counter[str]:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.counts


async def join_within(keys: irismesh.Keyring, endpoint: str, seconds: float) -> float:
    """A new client with the key joins through `endpoint` and gets a reply: how long it took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    async with irismesh.Node(keyring=keys, seeds=[endpoint], transport="tcp") as newcomer:
        await newcomer.wait_for_members("db", timeout=seconds)
        assert await newcomer.request("db", b"new", timeout=seconds) == b"db:new"
    took = loop.time() - began
    assert took < seconds
    return took


def test_a_hello_at_every_limit_is_well_within_what_a_stranger_may_send() -> None:
    """The largest HELLO irismesh sends (every field of its record at its limit, its identity
    and signatures) fits three times over in `HELLO_LIMIT`; a stranger may send nothing
    longer."""
    keys = Keyring.generate([f"cluster-{i:02d}" for i in range(64)])
    security = KeyedLinkSecurity(keys)
    kx = security.begin().public
    host = "h" * (MAX_ADDRESS - 6)
    endpoint = f"tcp://{host}"[:250] + ":65535"
    name = os.urandom(8 + 4 * MAX_NAME + 16)  # a sealed name of 64 four-byte characters
    record = [(1 << 63) - 1, f"{host}:65535", os.urandom(MAX_TAGS), name, os.urandom(64)]
    caps = {"kx": kx, "rec": record, "proof": os.urandom(32), "prio": 1, "run": 1}
    caps |= {"id": os.urandom(32), "sig": os.urandom(64)}  # its identity and signature
    body = BodyCodec(1 << 20).pack([os.urandom(16), os.urandom(16), endpoint, caps])
    hello = encode_header(Kind.HELLO, 0, 0) + body
    assert len(hello) < 2304
    assert 3 * len(hello) < HELLO_LIMIT


@deadline(60)
async def test_silent_and_half_sent_connections_are_closed_at_the_hello_deadline_and_counted(
    keys: irismesh.Keyring,
) -> None:
    config = CoreConfig(hello_timeout=1.0)
    async with (
        irismesh.Node("db", keyring=keys, config=config, transport="tcp") as member,
        irismesh.Node(keyring=keys, seeds=[member.endpoint], transport="tcp") as client,
    ):
        member.on_request(lambda payload: b"db:" + payload)
        await client.wait_for_members("db", timeout=5)
        caller = Caller(client)
        silent = Holder(member.endpoint, again=60)
        half_frame = Holder(member.endpoint, framed(b"h" * 1000)[:500], again=60)
        half_length = Holder(member.endpoint, b"\x00\x00", again=60)
        for holder in (silent, half_frame, half_length):
            holder.start(20)
        try:
            await wait_until(
                lambda: sum(h.counts["closed"] for h in (silent, half_frame, half_length)) == 60,
                5,
                "every connection to be closed",
            )
            for holder in (silent, half_frame, half_length):
                assert holder.counts["opened"] == 20
                # Never early; typically at the deadline. Each connection is timed from the
                # stranger's side, from before its connect, so a loaded machine's connect,
                # accept and loop delays add to a few.
                closed = sorted(holder.closed_after)
                assert closed[0] >= 0.9, closed
                assert closed[len(closed) // 2] < 1.5, closed
                assert closed[-1] < 3.0, closed
            assert member.stats["dropped_stranger_timeout"] == 60
            assert member.stats["strangers_connected"] == 0
            # The client's own connection proved the key long before: it stays.
            assert member.stats.get("links_in_closed", 0) == 0
            assert await client.request("db", b"after") == b"db:after"
        finally:
            for holder in (silent, half_frame, half_length):
                await holder.stop()
            calls = await caller.stop()
        assert calls["failed"] == 0
        assert calls["ok"] > 10


def a_hello(keys: irismesh.Keyring) -> bytes:
    """A HELLO proving `keys`' mesh key, as a dialler sends it."""
    security = KeyedLinkSecurity(keys)
    identity = Identity.generate()
    node_id, nonce, kx = identity.node_id, os.urandom(16), security.begin().public
    endpoint = "tcp://127.0.0.1:9"
    name = seal_name(security.datagram_sealer(node_id), node_id, 1, "dialler")
    signed = record_transcript(MemberRecord(node_id, endpoint, "127.0.0.1:9", b"", "dialler"), 0)
    record = [0, "127.0.0.1:9", b"", name, identity.sign(signed)]
    codec = BodyCodec(1 << 20)
    said = [node_id, nonce, endpoint, kx, record]
    caps = {"kx": kx, "rec": record, "proof": security.mesh_proof(b"hello", codec.pack(said))}
    caps |= {
        "id": identity.public,
        "sig": identity.sign(b"hello" + codec.pack([*said, identity.public])),
    }
    return encode_header(Kind.HELLO, 0, 0) + codec.pack([node_id, nonce, endpoint, caps])


def stall_then_send(sock: socket.socket, before: float, data: bytes, after: float) -> None:
    """Hold the event loop (this is no coroutine), sending `data` in the middle."""
    time.sleep(before)
    sock.sendall(data)
    time.sleep(after)


@deadline(60)
async def test_a_hello_that_came_while_the_loop_stalled_past_the_deadline_is_read_first(
    keys: irismesh.Keyring,
) -> None:
    """A member whose loop stalls past a connection's deadline reads the HELLO that came
    meanwhile before it judges the connection (uvloop runs due timers before it reads)."""
    config = CoreConfig(hello_timeout=1.0)
    async with irismesh.Node("db", keyring=keys, config=config, transport="tcp") as member:
        host, _, port = member.endpoint.removeprefix("tcp://").rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            await wait_until(lambda: member.stats.get("strangers_connected") == 1, 5, "accept")
            # The stall is an I/O callback's, the hardest case: with uvloop, the timers
            # that fell due meanwhile run before the loop reads again.
            loop = asyncio.get_running_loop()
            wake, woken = socket.socketpair()
            stalled = asyncio.Event()

            def on_wake() -> None:
                loop.remove_reader(woken.fileno())
                stall_then_send(sock, 1.2, framed(a_hello(keys)), 0.3)
                stalled.set()

            with wake, woken:
                loop.add_reader(woken.fileno(), on_wake)
                wake.send(b"!")
                await asyncio.wait_for(stalled.wait(), 5)
            await wait_until(lambda: member.stats["strangers_connected"] == 0, 5, "proof")
            assert member.stats.get("dropped_stranger_timeout", 0) == 0
            size = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
            assert sock.recv(size, socket.MSG_WAITALL)[2] == Kind.WELCOME


@contextlib.asynccontextmanager
async def flooded(client: irismesh.Node, endpoint: str) -> AsyncIterator[None]:
    """HELD connections held open to the member at `endpoint` while `client` keeps calling it;
    at the end, every one of the client's calls has succeeded."""
    caller = Caller(client)
    holder = Holder(endpoint)
    holder.start(HELD)
    try:
        await wait_until(lambda: holder.counts["opened"] >= HELD, 20, "all to connect")
        yield
    finally:
        await holder.stop()
        calls = await caller.stop()
    assert calls["failed"] == 0
    assert calls["ok"] > 0


@deadline(60)
async def test_idle_connections_beyond_the_descriptor_limit_lock_no_peer_out(
    keyfile: Path, keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """1,100 connections held (each opened again once the member closes it) against a member
    whose descriptor limit is 1,024, its deadline far off: the bound on strangers from one
    address closes the oldest, and a client with the key joins as ever."""
    async with (
        held_member(keyfile, tmp_path / "member.err", "--hello-timeout", "60") as (
            endpoint,
            _pid,
        ),
        irismesh.Node(keyring=keys, seeds=[endpoint], transport="tcp") as client,
    ):
        await client.wait_for_members("db", timeout=10)
        async with flooded(client, endpoint):
            await join_within(keys, endpoint, 5)
            stats = await member_stats(client)
            per_address = CoreConfig().max_strangers_per_address
            assert stats["strangers_connected"] <= per_address
            assert stats["dropped_stranger_evicted"] >= HELD - per_address
            assert stats.get("accept_out_of_descriptors", 0) == 0
    assert "Traceback" not in (tmp_path / "member.err").read_text()


@deadline(60)
async def test_a_member_out_of_descriptors_closes_strangers_to_let_peers_in(
    keyfile: Path, keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """As above, with the bounds on strangers above the descriptor limit: accepting runs out
    of descriptors, counts it, warns once, and closes the oldest stranger to make room."""
    options = ["--hello-timeout", "60", "--max-strangers", "4096"]
    options += ["--max-strangers-per-address", "4096"]
    async with (
        held_member(keyfile, tmp_path / "member.err", *options) as (endpoint, _pid),
        irismesh.Node(keyring=keys, seeds=[endpoint], transport="tcp") as client,
    ):
        await client.wait_for_members("db", timeout=10)
        async with flooded(client, endpoint):
            # Connected is not yet accepted: the member takes the kernel's backlog at its
            # own pace (a busy machine slows it), and is full when accepting runs out.
            stats = await member_stats(client)
            deadline = time.monotonic() + 20
            while not stats.get("accept_out_of_descriptors") and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                stats = await member_stats(client)
            assert stats.get("accept_out_of_descriptors", 0) >= 1, stats
            assert stats["strangers_connected"] > 900  # it held what it could
            await join_within(keys, endpoint, 5)
            stats = await member_stats(client)
            assert stats["accept_out_of_descriptors"] >= 1
            assert stats["dropped_stranger_evicted"] >= 1
    errors = (tmp_path / "member.err").read_text()
    assert "Traceback" not in errors
    assert 1 <= errors.count("out of file descriptors") <= 2, errors


@deadline(60)
async def test_strangers_holding_frames_cut_short_fill_no_memory(
    keyfile: Path, keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """200 connections each send the length of the largest frame a stranger may send and all
    but its last byte, and 100 more the length of the largest frame a member takes (256 MiB
    here) and a megabyte of it: the first are held (the deadline and bounds far off), the
    others refused at their length, and the member's memory grows by less than 20 MB."""
    options = ["--hello-timeout", "60", "--max-payload", str(256 << 20)]
    options += ["--max-strangers-per-address", "4096"]
    async with (
        held_member(keyfile, tmp_path / "member.err", *options) as (endpoint, pid),
        irismesh.Node(keyring=keys, seeds=[endpoint], transport="tcp") as client,
    ):
        await client.wait_for_members("db", timeout=10)
        await member_stats(client)
        before = rss(pid)
        cut = HELLO_LIMIT.to_bytes(4, "big") + b"h" * (HELLO_LIMIT - 1)
        holder = Holder(endpoint, cut, again=60)
        large = (256 << 20).to_bytes(4, "big") + b"p" * (1 << 20)
        refused = Holder(endpoint, large, again=60)
        try:
            holder.start(200)
            refused.start(100)
            await wait_until(lambda: holder.open == 200, 10, "200 held")
            await wait_until(lambda: refused.counts["closed"] == 100, 10, "100 refused")
            stats = await member_stats(client)
            assert stats["strangers_connected"] == 200
            assert stats["dropped_stranger_oversize"] == 100
            grown = rss(pid) - before
            assert grown < 20 << 20, f"grew {grown / 1e6:.1f} MB"
        finally:
            await holder.stop()
            await refused.stop()


@deadline(60)
async def test_a_gateways_link_listener_closes_connections_that_never_finish_zmqs_greeting() -> (
    None
):
    """zmq keeps a gateway's link connections: it closes those that send nothing, or half of
    zmq's greeting, within 2 s, and the link between two gateways comes up meanwhile."""
    mesh_keys, link_keys = irismesh.Keyring.generate(), irismesh.Keyring.generate()
    far_keys = irismesh.Keyring.generate()
    fast = irismesh.federation.LinkConfig(heartbeat=0.1, dead_after=0.6, retry=0.2)
    async with irismesh.Gateway(
        "a",
        keyring=mesh_keys,
        link_keyring=link_keys,
        listen="tcp://127.0.0.1:0",
        link_config=fast,
        bind="tcp://127.0.0.1:0",
    ) as listener:
        silent = Holder(listener.endpoint, again=60)
        half_greeting = Holder(listener.endpoint, b"\xff" + bytes(8), again=60)
        silent.start(20)
        half_greeting.start(20)
        try:
            async with irismesh.Gateway(
                "b",
                keyring=far_keys,
                link_keyring=link_keys,
                peers=(listener.endpoint,),
                link_config=fast,
                bind="tcp://127.0.0.1:0",
            ):
                await wait_until(lambda: listener.stats["links_up"] == 1, 5, "the link")
                await wait_until(
                    lambda: silent.counts["closed"] + half_greeting.counts["closed"] == 40,
                    5,
                    "the strangers to be closed",
                )
                for holder in (silent, half_greeting):
                    assert all(after < 3.0 for after in holder.closed_after)
                assert listener.stats["links_up"] == 1
        finally:
            await silent.stop()
            await half_greeting.stop()
