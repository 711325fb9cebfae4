"""SURVEY-style discovery over UDP multicast: ask "who is there?", collect candidates.

Theory of operation. Each node holds three UDP sockets:

* a *listener* bound to ``(group, port)``, joined to the group on the configured interface only.
  ``SO_REUSEADDR`` + ``SO_REUSEPORT`` let several processes on one host share the group and port,
  and the kernel gives each of them its own copy of every multicast datagram.
* a *question* socket bound to ``(interface, port)`` (shared like the listener), where QUESTIONs
  sent by unicast arrive: ``unicast_targets`` names hosts to ask that way, for nodes that
  multicast cannot reach; the kernel hands each to one of the processes sharing the port.
* a *unicast* socket bound to ``(interface, 0)``, which sends QUESTIONs to the group (pinned with
  ``IP_MULTICAST_IF``, TTL 1, loop on so nodes on one host hear each other) and receives ANSWERs.
  Questions leave from it so that their source address is where answers should go: a reply to
  the shared listener port would reach only one of the processes that share it.

A node alone asks every ``fast_interval`` while younger than ``fast_period`` (a new node wants
peers quickly), and again for ``fast_period`` after it hears of a node it had not heard before
(the mesh is changing); once stable it backs off, doubling the interval up to ``slow_interval``
(to find nodes whose questions were lost). Each interval is jittered by the injected rng so
nodes started together do not ask in lockstep.

The survey only has to find *one* member: once a node has joined, membership's gossip and
table exchanges bring it the rest. So when the node's membership is given (`live_peers`,
`alive`: what `Node` wires in), discovery quiets down as the node joins:

* **Asking.** A node with live peers asks only in the background, to merge meshes that formed
  apart on one network: every ``mesh_interval`` times the number of nodes it knows (at least
  ``slow_interval``), so that the whole mesh asks about once a ``mesh_interval`` whatever its
  size, and each node hears a fixed number of questions a second. Left alone again, it asks
  at once and fast.
* **Answering.** A question from a node membership holds alive at that endpoint is not
  answered (``answers_withheld``): the asker is in the mesh already, and heard that question
  as a notice of its presence. So a converged mesh sends no answers at all, and a newcomer's
  question is answered by the nodes that do not know it yet. A node with live peers sends its
  answer after a random delay of up to ``answer_spread`` seconds, so that a newcomer's socket
  takes in a mesh's answers one after another instead of dropping most of a burst.
* **Candidates.** Only nodes membership does not hold alive are candidates. A node alone
  passes one on at once and then at most one per ``fast_interval`` (nodes that start together
  must not all dial all); the rest wait. A waiting candidate still unknown ``merge_after``
  seconds after it was heard belongs to another mesh (nodes that started together and joined
  apart, or a mesh that grew elsewhere): one is passed on per review, one that answered this
  node's question always (its answers come to this node alone), one only heard asking with
  probability 1/(live peers) (every node of the mesh heard that question; about one dials).
  A newcomer's question is heard by every member and dialled by none: the newcomer dials one
  of the nodes that answered it, and gossip has made it known before the review.

Nodes that multicast cannot reach (another subnet) are asked by unicast (`unicast_targets`),
and seeds work over TCP: a seed's link handshake answers with its peer list. `poll_now` asks
at once, e.g. after the mesh lost peers. A listener that hears another node's QUESTION answers
with one unicast ANSWER to the question's source address. Both kinds carry the sender's node id
and mesh endpoint, so a question also announces the asker to every listener.

Every datagram also carries the sender's cluster names, sealed for holders of the keys that open
them (`irismesh.discovery.sealed`): a receiver keeps what its keyring opens, so that
`Node.clusters()` lists the clusters of nodes it can open, and those nodes' members. A node's
clusters are fixed for its life, so what it announced is kept while membership holds it alive
(a quiet mesh asks rarely), and otherwise for a few slow intervals after it was last heard.

Datagrams cannot be replayed. Each carries its sender's wall-clock time in milliseconds (strictly
increasing per sender) and ends with a tag, HMAC-SHA256 under the realm key over the whole
datagram; each sealed slot binds the sender's id, endpoint and time as associated data. A
receiver drops a datagram whose time is more than `SurveyConfig.freshness` seconds from its own
clock (``dropped_stale``), and one whose (sender, time) it has accepted before
(``dropped_replay``; a bounded cache per sender). Datagrams of the first format (version 1,
a static realm tag) are dropped and counted (``dropped_old_version``).

Discovery yields candidates only: anything heard may be forged, the mesh's handshake decides who
is a peer and its heartbeats who is alive. Only datagrams whose realm tag verifies give
candidates; one from another realm whose slot opens under one of this node's keys (a holder of a
cluster key listing its clusters) gives its names and is answered, but is no candidate. Bad
datagrams are counted and dropped, never raised. The codec at the top is pure (bytes in,
messages out); the engine below owns sockets and clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import logging
import os
import random
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from irismesh.discovery._common import check_startable, offer
from irismesh.discovery.config import (  # the settings: kept apart, loaded with the node
    MAX_REALM_LEN,
    SurveyConfig,
    realm_key,
    survey_config,
)
from irismesh.discovery.sealed import SLOT_LEN, SLOTS, ClusterSeal
from irismesh.errors import ConfigurationError, ProtocolError

if TYPE_CHECKING:
    from irismesh.security.keyring import Keyring

__all__ = [
    "MAX_DATAGRAM",
    "ReplayCache",
    "SurveyConfig",
    "SurveyDiscovery",
    "SurveyKind",
    "SurveyMessage",
    "decode",
    "encode_answer",
    "encode_question",
    "realm_key",
    "survey_config",
]

_log = logging.getLogger(__name__)

MAGIC = b"IMSV"
VERSION = 2
OLD_VERSION = 1  # a static realm tag and no timestamp: replayable, so refused
MAX_DATAGRAM = 1400  # every datagram of this version is about 1.1 kB: one Ethernet frame
NODE_ID_LEN = 16
MAX_ENDPOINT_LEN = 256
TAG_LEN = 16
_HEADER_LEN = len(MAGIC) + 2
_TAG_DOMAIN = b"irismesh/v2/survey-tag\x00"
_MAX_TIMESTAMP = 2**63 - 1


class SurveyKind(enum.IntEnum):
    QUESTION = 1
    ANSWER = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class SurveyMessage:
    """One decoded datagram: who sent it, where its mesh endpoint listens, when (its wall
    clock, milliseconds since the epoch), its sealed slots, and the tag over all of it."""

    kind: SurveyKind
    node_id: bytes
    endpoint: str
    timestamp_ms: int
    slots: tuple[bytes, ...]
    tag: bytes
    signed: bytes  # the bytes the tag covers: the whole datagram but the tag

    def verify(self, realm: bytes) -> bool:
        """Whether the tag is this datagram's under realm key `realm`."""
        return hmac.compare_digest(self.tag, _tag(realm, self.signed))


def _tag(realm: bytes, signed: bytes) -> bytes:
    return hmac.new(realm, _TAG_DOMAIN + signed, hashlib.sha256).digest()[:TAG_LEN]


def _field_problem(node_id: object, endpoint: object, timestamp_ms: object) -> str | None:
    if not isinstance(node_id, bytes) or len(node_id) != NODE_ID_LEN:
        return f"node id is not {NODE_ID_LEN} bytes"
    if not isinstance(endpoint, str) or len(endpoint) > MAX_ENDPOINT_LEN:
        return f"endpoint is not a string of at most {MAX_ENDPOINT_LEN} characters"
    if not endpoint.startswith("tcp://"):
        return "endpoint does not start with 'tcp://'"
    # Endpoints from the network end up in logs and connect calls: no control characters,
    # no whitespace, nothing that renders differently from what it is.
    if not (endpoint.isascii() and endpoint.isprintable()) or " " in endpoint:
        return "endpoint is not printable ASCII without spaces"
    if type(timestamp_ms) is not int or not 0 <= timestamp_ms <= _MAX_TIMESTAMP:
        return "timestamp is not a non-negative 64-bit integer"
    return None


def _slots_problem(slots: object) -> str | None:
    if not isinstance(slots, list | tuple) or len(slots) != SLOTS:
        return f"not {SLOTS} slots"
    if not all(isinstance(slot, bytes) and len(slot) == SLOT_LEN for slot in slots):
        return f"a slot is not {SLOT_LEN} bytes"
    return None


def _encode(
    kind: SurveyKind,
    node_id: bytes,
    endpoint: str,
    realm: bytes,
    timestamp_ms: int | None,
    slots: Sequence[bytes],
) -> bytes:
    if timestamp_ms is None:
        timestamp_ms = int(time.time() * 1000)
    filled = [*slots, *(os.urandom(SLOT_LEN) for _ in range(SLOTS - len(slots)))]
    problem = (
        _field_problem(node_id, endpoint, timestamp_ms)
        or _slots_problem(filled)
        or (f"realm is longer than {MAX_REALM_LEN} bytes" if len(realm) > MAX_REALM_LEN else None)
    )
    if problem is not None:
        raise ConfigurationError(f"cannot encode a survey {kind.name.lower()}: {problem}")
    body: bytes = msgpack.packb([node_id, endpoint, timestamp_ms, filled], use_bin_type=True)
    signed = MAGIC + bytes((VERSION, kind)) + body
    return signed + _tag(realm, signed)


def encode_question(
    *,
    node_id: bytes,
    endpoint: str,
    realm: bytes = b"",
    timestamp_ms: int | None = None,
    slots: Sequence[bytes] = (),
) -> bytes:
    """Encode "who is there?", announcing the asker's own node id and endpoint; the time is
    now unless given, and missing slots are random."""
    return _encode(SurveyKind.QUESTION, node_id, endpoint, realm, timestamp_ms, slots)


def encode_answer(
    *,
    node_id: bytes,
    endpoint: str,
    realm: bytes = b"",
    timestamp_ms: int | None = None,
    slots: Sequence[bytes] = (),
) -> bytes:
    """Encode the reply to a question: the answering node's id and endpoint."""
    return _encode(SurveyKind.ANSWER, node_id, endpoint, realm, timestamp_ms, slots)


def decode(data: bytes) -> SurveyMessage:
    """Decode one datagram; raise `ProtocolError` (and nothing else) if it is not valid.

    The tag is not checked here (`SurveyMessage.verify` does, under a realm key)."""
    if len(data) > MAX_DATAGRAM:
        raise ProtocolError("oversize", f"{len(data)} bytes")
    if len(data) < _HEADER_LEN:
        raise ProtocolError("short", f"{len(data)} bytes")
    if data[: len(MAGIC)] != MAGIC:
        raise ProtocolError("bad_magic")
    if data[4] == OLD_VERSION:
        raise ProtocolError("old_version", "a survey datagram of the first format")
    if data[4] != VERSION:
        raise ProtocolError("bad_version", str(data[4]))
    if data[5] not in (SurveyKind.QUESTION, SurveyKind.ANSWER):
        raise ProtocolError("bad_kind", str(data[5]))
    if len(data) < _HEADER_LEN + TAG_LEN:
        raise ProtocolError("short", f"{len(data)} bytes")
    signed = data[:-TAG_LEN]
    try:
        body = msgpack.unpackb(
            signed[_HEADER_LEN:],
            raw=False,
            max_bin_len=SLOT_LEN,
            max_str_len=MAX_ENDPOINT_LEN,
            max_array_len=SLOTS,
            max_map_len=0,
            max_ext_len=0,
        )
    # msgpack raises a zoo of types on hostile input (ValueError, TypeError, its own
    # FormatError/StackError/ExtraData, UnicodeDecodeError): translate them all here, once.
    except Exception as exc:
        raise ProtocolError("bad_body", type(exc).__name__) from None
    if not isinstance(body, list) or len(body) != 4:
        raise ProtocolError("bad_body", "not a 4-element array")
    node_id, endpoint, timestamp_ms, slots = body
    problem = _field_problem(node_id, endpoint, timestamp_ms) or _slots_problem(slots)
    if problem is not None:
        raise ProtocolError("bad_body", problem)
    return SurveyMessage(
        kind=SurveyKind(data[5]),
        node_id=node_id,
        endpoint=endpoint,
        timestamp_ms=timestamp_ms,
        slots=tuple(slots),
        tag=data[-TAG_LEN:],
        signed=signed,
    )


# ---------------------------------------------------------------------------------------------
# asyncio engine


_STAT_NAMES = (
    "questions_sent",
    "answers_sent",
    "received",
    "candidates",
    "dropped_malformed",
    "dropped_self",
    "dropped_realm",
    "send_errors",
    "callback_errors",
    "unicast_questions_sent",
    "dropped_stale",
    "dropped_replay",
    "dropped_old_version",
    "announcements",
    "heard_outside_realm",
    "answers_withheld",
    "candidates_passed",
)
MAX_SENDERS = 4096  # senders remembered, for replays and for their announcements
MAX_WAITING = 256  # candidates waiting to be passed on; the oldest is forgotten first
SMALL_MESH = 1  # other live nodes up to which a node still passes candidates on at once
MAX_DELAYED_ANSWERS = 512  # answers waiting for their delay; beyond, answered at once
MAX_TIMES_PER_SENDER = 64  # datagram times remembered per sender within the freshness window


@dataclass(slots=True)
class _Seen:
    times: set[int] = field(default_factory=set)
    floor: int = -1  # times at or below this are refused: forgotten from a full set


class ReplayCache:
    """Which (sender, time) pairs were accepted within the freshness window; bounded.

    Times older than the window never reach it (they are stale). A sender keeps at most
    MAX_TIMES_PER_SENDER times; when more come within the window, the oldest is forgotten and
    everything at or before it is refused from then on. At most MAX_SENDERS senders are kept,
    the least recently heard forgotten first: only datagrams that authenticated reach the
    cache, so only a key holder can push a sender out (and then replay that sender's recent
    datagrams once more)."""

    __slots__ = ("_senders", "_window_ms")

    def __init__(self, window_ms: int) -> None:
        self._window_ms = window_ms
        self._senders: OrderedDict[bytes, _Seen] = OrderedDict()

    def accept(self, sender: bytes, timestamp_ms: int, now_ms: int) -> bool:
        """True (and remembered) if this pair is new; False for a replay."""
        seen = self._senders.get(sender)
        if seen is None:
            seen = self._senders[sender] = _Seen()
            if len(self._senders) > MAX_SENDERS:
                self._senders.popitem(last=False)
        else:
            self._senders.move_to_end(sender)
        if timestamp_ms <= seen.floor or timestamp_ms in seen.times:
            return False
        seen.times.add(timestamp_ms)
        if len(seen.times) > MAX_TIMES_PER_SENDER:
            horizon = now_ms - self._window_ms
            seen.times = {t for t in seen.times if t >= horizon}
            while len(seen.times) > MAX_TIMES_PER_SENDER:
                oldest = min(seen.times)
                seen.times.discard(oldest)
                seen.floor = max(seen.floor, oldest)
        return True


@dataclass(slots=True)
class _Announced:
    endpoint: str
    names: set[str]
    heard_at: float  # time.monotonic()


@dataclass(slots=True)
class _Waiting:
    """A candidate not passed on yet: where it listens, when it was first heard (loop time),
    and whether it answered this node's question."""

    endpoint: str
    heard_at: float
    answered: bool


class _SurveyProtocol(asyncio.DatagramProtocol):
    def __init__(self, owner: SurveyDiscovery, *, via_group: bool) -> None:
        self._owner = owner
        self._via_group = via_group
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self._owner._on_datagram(data, addr, via_group=self._via_group)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors (e.g. an asker that has gone) surface here, long after the send.
        self._owner._count("send_errors")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class SurveyDiscovery:
    """Ask a multicast group who is there; report the other nodes heard as candidates.

    `keyring` and `clusters` (those this node serves) say what its datagrams announce, sealed,
    and what it can open of others' (`clusters_heard`); `clock` is the wall clock, in seconds.
    `live_peers` (how many other nodes membership holds alive) and `alive` (whether it holds
    a node id alive at an endpoint) let the survey quiet down once the node has joined; without
    them every node heard is a candidate and every question is answered.
    """

    def __init__(
        self,
        *,
        node_id: bytes,
        endpoint: str,
        config: SurveyConfig,
        on_candidate: Callable[[bytes, str], None],
        rng: random.Random | None = None,
        keyring: Keyring | None = None,
        clusters: Sequence[str] = (),
        clock: Callable[[], float] = time.time,
        live_peers: Callable[[], int] | None = None,
        alive: Callable[[bytes, str], bool] | None = None,
    ) -> None:
        self._node_id = node_id
        self._live_peers = live_peers
        self._alive = alive
        self._waiting: OrderedDict[bytes, _Waiting] = OrderedDict()
        self._passed_at = -float("inf")  # when a node alone last passed a candidate on
        self._review: asyncio.TimerHandle | None = None
        self._delayed: set[asyncio.TimerHandle] = set()  # answers waiting for their delay
        self._endpoint = endpoint
        self._config = config
        self._on_candidate = on_candidate
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._heard: set[bytes] = set()  # node ids heard so far
        self._news_at = 0.0  # when this node started, or last heard someone new
        self._clusters = tuple(clusters)
        self._seal = ClusterSeal(keyring, self._clusters)
        self._realms = (config.realm, *config.accepted_realms)
        self._last_ms = 0  # this node's datagram times: strictly increasing
        self._turn = 0  # which of this node's sealed slots go next, when not all fit
        self._replays = ReplayCache(int(config.freshness * 1000))
        self._announced: OrderedDict[bytes, _Announced] = OrderedDict()
        self._datagram(SurveyKind.QUESTION)  # validate this node's own fields now
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._group_transport: asyncio.DatagramTransport | None = None
        self._unicast_transport: asyncio.DatagramTransport | None = None
        self._asked_transport: asyncio.DatagramTransport | None = None  # unicast questions
        self._protocols: list[_SurveyProtocol] = []
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._started = False
        self._closed = False

    def use_keyring(self, keyring: Keyring) -> None:
        """Seal and open cluster names with `keyring` from now on (a rotated cluster key: a
        holder of only the new key lists this node's clusters at once)."""
        self._seal = ClusterSeal(keyring, self._clusters)

    @property
    def config(self) -> SurveyConfig:
        """Where this survey asks, how often, and its realm."""
        return self._config

    @property
    def stats(self) -> Mapping[str, int]:
        """A snapshot of the counters."""
        return dict(self._stats)

    def clusters_heard(self, max_age: float | None = None) -> dict[str, dict[bytes, str]]:
        """Cluster name -> {node id: endpoint} of the nodes whose datagrams named it under a
        key this node's keyring opens it with: heard within `max_age` seconds (default: three
        times the slow interval, at least 15 s), or held alive by membership at that
        endpoint (a mesh that has joined asks rarely; a node's clusters are fixed)."""
        if max_age is None:
            max_age = max(15.0, 3 * self._config.slow_interval)
        horizon = time.monotonic() - max_age
        heard: dict[str, dict[bytes, str]] = {}
        for node_id, announced in self._announced.items():
            if announced.heard_at >= horizon or self._known(node_id, announced.endpoint):
                for name in announced.names:
                    heard.setdefault(name, {})[node_id] = announced.endpoint
        return heard

    def _datagram(self, kind: SurveyKind) -> bytes:
        """A fresh datagram of this node: its time now (past its last), its slots this turn."""
        now_ms = max(int(self._clock() * 1000), self._last_ms + 1)
        self._last_ms = now_ms
        slots = self._seal.seal(self._node_id, self._endpoint, now_ms, self._turn)
        self._turn += 1
        return _encode(kind, self._node_id, self._endpoint, self._config.realm, now_ms, slots)

    @property
    def local_addresses(self) -> tuple[tuple[str, int], ...]:
        """The (host, port) each socket is bound to: listener, unicast, question socket."""
        return tuple(
            t.get_extra_info("sockname")
            for t in (self._group_transport, self._unicast_transport, self._asked_transport)
            if t is not None
        )

    async def start(self) -> None:
        """Open both sockets and start asking; raise `ConfigurationError` if they cannot open."""
        check_startable("SurveyDiscovery", closed=self._closed, started=self._started)
        self._started = True
        loop = asyncio.get_running_loop()
        try:
            self._group_transport = await self._open(loop, via_group=True)
            self._unicast_transport = await self._open(loop, via_group=False)
            self._asked_transport = await self._open(loop, via_group=True, asked=True)
        except BaseException:
            await self.close()
            raise
        self._task = loop.create_task(self._poll(), name="irismesh-survey-poll")

    def poll_now(self) -> None:
        """Ask at once (at most once per fast_interval); a no-op before start and after close."""
        self._wake.set()

    async def close(self) -> None:
        """Stop asking and close both sockets; safe to call more than once."""
        self._closed = True
        if self._review is not None:
            self._review.cancel()
            self._review = None
        for handle in self._delayed:
            handle.cancel()
        self._delayed.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # wait(), not await: the task's CancelledError is expected, a caller's must propagate.
            await asyncio.wait([task])
        for transport in (self._group_transport, self._unicast_transport, self._asked_transport):
            if transport is not None:
                transport.close()
        self._group_transport = self._unicast_transport = self._asked_transport = None
        # The socket is released only in connection_lost, a loop iteration after close():
        # wait for it so a caller may rebind the port as soon as close() returns.
        protocols, self._protocols = self._protocols, []
        await asyncio.gather(*(p.lost for p in protocols))

    async def _open(
        self, loop: asyncio.AbstractEventLoop, *, via_group: bool, asked: bool = False
    ) -> asyncio.DatagramTransport:
        sock = _open_socket(self._config, listener=via_group, asked=asked)
        protocol = _SurveyProtocol(self, via_group=via_group)
        try:
            transport, _ = await loop.create_datagram_endpoint(lambda: protocol, sock=sock)
        except BaseException:
            sock.close()
            raise
        self._protocols.append(protocol)
        return transport

    def _joined(self) -> bool:
        """Whether membership holds another node alive (never, without membership given)."""
        return self._live_peers is not None and self._live_peers() > 0

    def _settled(self) -> bool:
        """Whether membership holds more than `SMALL_MESH` other nodes alive. A node in a
        smaller mesh passes candidates on as a node alone does: two nodes started together
        (a gateway's nodes, a restarted pair) find each other first, and the mesh they are
        meant to join may be the one they have not linked to yet; waiting for the review
        would leave them apart for `merge_after` and more."""
        return self._live_peers is not None and self._live_peers() > SMALL_MESH

    def _known(self, node_id: bytes, endpoint: str) -> bool:
        """Whether membership holds `node_id` alive at `endpoint`."""
        return self._alive is not None and self._alive(node_id, endpoint)

    async def _poll(self) -> None:
        self._news_at = time.monotonic()
        cfg = self._config
        interval = cfg.fast_interval
        while True:
            self._wake.clear()
            question = self._datagram(SurveyKind.QUESTION)
            self._send(question, (cfg.group, cfg.port), "questions_sent")
            for target in cfg.unicast_targets:
                question = self._datagram(SurveyKind.QUESTION)
                self._send(question, (target, cfg.port), "unicast_questions_sent")
            asked = time.monotonic()
            joined = self._joined()
            if joined:
                assert self._live_peers is not None
                interval = cfg.joined_interval(self._live_peers())
            else:
                interval = cfg.next_interval(asked - self._news_at, interval)
            due = asked + interval * (1.0 + self._rng.uniform(-cfg.jitter, cfg.jitter))
            while (now := time.monotonic()) < due:
                # A joined node's long wait is looked at every slow interval: left alone, it
                # asks at once, and fast again.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(due - now, cfg.slow_interval)):
                        await self._wake.wait()
                    # Woken by poll_now: a caller calling it in a loop must not flood the group.
                    await asyncio.sleep(max(0.0, asked + cfg.fast_interval - time.monotonic()))
                    break
                if joined and not self._joined():
                    self._news_at = time.monotonic()
                    break

    def _send(self, data: bytes, addr: tuple[str, int], counter: str) -> None:
        if self._unicast_transport is None:
            return
        try:
            self._unicast_transport.sendto(data, addr)
        except OSError:
            self._count("send_errors")
            return
        self._count(counter)

    def _count(self, name: str) -> None:
        self._stats[name] += 1

    def _on_datagram(self, data: bytes, addr: tuple[str | Any, int], *, via_group: bool) -> None:
        self._count("received")
        try:
            message = decode(data)
        except ProtocolError as exc:
            old = exc.reason == "old_version"
            self._count("dropped_old_version" if old else "dropped_malformed")
            return
        if message.node_id == self._node_id:
            self._count("dropped_self")
            return
        # Questions go to the group (or the question port) and answers to the asker's socket;
        # anything else is not this protocol.
        if via_group != (message.kind is SurveyKind.QUESTION):
            self._count("dropped_malformed")
            return
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - message.timestamp_ms) > self._config.freshness * 1000:
            self._count("dropped_stale")
            return
        in_realm = any(message.verify(realm) for realm in self._realms)
        opened = self._seal.open(
            message.node_id, message.endpoint, message.timestamp_ms, message.slots
        )
        if not (in_realm or opened.proven):
            self._count("dropped_realm")
            return
        # Authentic: remembered only now, so forgeries cannot fill the cache.
        if not self._replays.accept(message.node_id, message.timestamp_ms, now_ms):
            self._count("dropped_replay")
            return
        if opened.names:
            self._count("announcements")
            self._remember(message.node_id, message.endpoint, opened.names)
        known = in_realm and self._known(message.node_id, message.endpoint)
        # Only fresh questions from this realm, or from a holder of one of this node's keys,
        # are answered, each once: datagrams of this version differ in size only by their
        # endpoints, so an answer is about as large as its question: no amplification, and no
        # open reflector (a recorded question is a replay, an unkeyed one is not answered).
        # A member of this node's mesh asking needs no answer: membership told it of us.
        if via_group:
            if known:
                self._count("answers_withheld")
            else:
                self._answer((str(addr[0]), int(addr[1])))
        if not in_realm:  # a holder of a key, listing clusters: not of this mesh
            self._count("heard_outside_realm")
            return
        self._count("candidates")
        if known:
            return
        if message.node_id not in self._heard and not self._joined():
            if len(self._heard) >= 4096:
                self._heard.clear()
            self._heard.add(message.node_id)
            # Someone new: the mesh is changing, ask fast again (it may bring others).
            self._news_at = time.monotonic()
            self._wake.set()
        self._offer(message.node_id, message.endpoint, answered=not via_group, now=time.monotonic())

    def _answer(self, addr: tuple[str, int]) -> None:
        """Answer a question from `addr`: at once when alone (a newcomer wants a peer fast),
        after a random delay when in a mesh, whose members all answer a newcomer."""
        spread = self._config.answer_spread
        if not spread or not self._joined() or len(self._delayed) >= MAX_DELAYED_ANSWERS:
            self._send(self._datagram(SurveyKind.ANSWER), addr, "answers_sent")
            return
        loop = asyncio.get_running_loop()

        def send() -> None:
            self._delayed.discard(handle)
            if not self._closed:
                self._send(self._datagram(SurveyKind.ANSWER), addr, "answers_sent")

        handle = loop.call_later(self._rng.uniform(0.0, spread), send)
        self._delayed.add(handle)

    def _offer(self, node_id: bytes, endpoint: str, *, answered: bool, now: float) -> None:
        """A node of this realm that membership does not hold alive: pass it on now, or let it
        wait for a review (see the module's docstring)."""
        if self._live_peers is None:  # no membership to ask: every node heard is a candidate
            self._pass_on(node_id, endpoint)
            return
        if not self._settled() and now - self._passed_at >= self._config.fast_interval:
            self._passed_at = now
            self._waiting.pop(node_id, None)
            self._pass_on(node_id, endpoint)
            return
        waiting = self._waiting.get(node_id)
        if waiting is None or waiting.endpoint != endpoint:
            self._waiting[node_id] = _Waiting(endpoint, now, answered)
            if len(self._waiting) > MAX_WAITING:
                self._waiting.popitem(last=False)
        else:
            waiting.answered |= answered
        self._schedule_review()

    def _schedule_review(self) -> None:
        if self._review is None and self._waiting and not self._closed:
            delay = self._config.merge_after * (1.0 + self._rng.uniform(0.0, self._config.jitter))
            self._review = asyncio.get_running_loop().call_later(delay, self._review_waiting)

    def _review_waiting(self) -> None:
        """Forget the waiting candidates membership has learnt meanwhile (or heard of too long
        ago); pass on one of those still unknown after `merge_after`."""
        self._review = None
        now = time.monotonic()
        merge_after = self._config.merge_after
        ready: list[bytes] = []
        for node_id, waiting in list(self._waiting.items()):
            age = now - waiting.heard_at
            if self._known(node_id, waiting.endpoint) or age > 10 * merge_after:
                del self._waiting[node_id]
            elif age >= merge_after:
                ready.append(node_id)
        if ready:
            node_id = self._rng.choice(ready)
            waiting = self._waiting[node_id]
            live = self._live_peers() if self._live_peers is not None else 0
            # Every node of a mesh heard a question; about one of them should dial its asker.
            if waiting.answered or live <= 1 or self._rng.random() * live < 1.0:
                del self._waiting[node_id]
                self._pass_on(node_id, waiting.endpoint)
        self._schedule_review()

    def _pass_on(self, node_id: bytes, endpoint: str) -> None:
        self._count("candidates_passed")
        offer(self._on_candidate, node_id, endpoint, stats=self._stats, what="survey", log=_log)

    def _remember(self, node_id: bytes, endpoint: str, names: Sequence[str]) -> None:
        announced = self._announced.get(node_id)
        now = time.monotonic()
        if announced is None or announced.endpoint != endpoint:
            self._announced[node_id] = _Announced(endpoint, set(names), now)
            if len(self._announced) > MAX_SENDERS:
                self._announced.popitem(last=False)
            return
        # A node's clusters are fixed for its life; with more slots than one datagram holds,
        # its names come a few at a time.
        self._announced.move_to_end(node_id)
        if len(announced.names) < 256:
            announced.names.update(names)
        announced.heard_at = now


def _open_socket(cfg: SurveyConfig, *, listener: bool, asked: bool = False) -> socket.socket:
    ip, iface = socket.IPPROTO_IP, socket.inet_aton(cfg.interface)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if asked:
            # Unicast questions to this host: bound to the interface's address, never a
            # wildcard. Processes on one host share the port; the kernel gives each question to
            # one of them, which is enough (the asker learns the rest from that one's peers).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((cfg.interface, cfg.port))
        elif listener:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            # Bound to the group, not a wildcard: only this group's datagrams reach the socket.
            sock.bind((cfg.group, cfg.port))
            sock.setsockopt(ip, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(cfg.group) + iface)
        else:
            sock.bind((cfg.interface, 0))
            sock.setsockopt(ip, socket.IP_MULTICAST_IF, iface)
            sock.setsockopt(ip, socket.IP_MULTICAST_TTL, 1)
            sock.setsockopt(ip, socket.IP_MULTICAST_LOOP, 1)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        what = f"listen on group {cfg.group}:{cfg.port}" if listener else "send questions"
        raise ConfigurationError(
            f"survey discovery cannot {what} via interface {cfg.interface}: {exc}; check that "
            "the interface address exists here and no other program holds the port exclusively"
        ) from exc
    return sock
