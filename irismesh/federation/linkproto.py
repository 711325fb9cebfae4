"""The inter-mesh link protocol, without I/O: handshake, sealing, sequencing, acks, replay.

Theory of operation
-------------------
Two gateways of different meshes talk over one *link*. The dialler sends HELLO, the listener
answers WELCOME; both are unsealed msgpack, each carrying the sender's gateway id, mesh name, a
fresh nonce, an ephemeral X25519 public key, its stream state and what it exports, and a MAC
under the *link key* (a keyring of its own, scope ``federation`` or ``*``) over everything said
so far: WELCOME's MAC covers HELLO too, so it is fresh. A HELLO or WELCOME whose MAC fails
under every accepted key is dropped and counted (`dropped_bad_proof`), never answered: a
gateway with another link key learns nothing and cannot link. Both ends then derive one
AES-256-GCM key per direction with HKDF from the link key and the X25519 secret (salted with
both nonces), so a recorded link stays closed even if the link key leaks later. Every later
frame is sealed, its 13-byte header as associated data and a per-session counter as nonce;
a counter that does not grow is a replay, dropped and counted.

What flows in sealed frames:

- *reliable items* (published messages crossing meshes) carry a stream sequence number. The
  sender keeps every item until the other end acknowledges it (acks ride on every frame, and
  on a heartbeat), at most `buffer` items: beyond that, a new item is dropped and counted
  (`dropped_buffer_full`), never silently. Each frame says two things of the other stream:
  how far it was received (nothing up to there is sent again) and how far the application is
  done with it (`consumed`; what the sender may forget), so a receiver that reads slowly
  holds the sender back by the window instead of piling items up. The receiver delivers
  items in sequence order and drops what it already has (`duplicates`) or what comes after a
  gap (`out_of_order`); the sender goes back to the oldest item the receiver does not have
  when acks stop progressing. A stream
  outlives sessions: each end names its stream (a random id per process) in its handshake
  with how far it got in the other's, so after an outage or a reconnection the sender replays
  exactly what was not acknowledged, in order. At most `window` items are in flight at once.
- *plain items* (requests and replies) are sent once, only while the link is up: a request
  across a broken link is the caller's to resend elsewhere, as a request to a dead member is.

A gateway may also show *who* it is in its HELLO or WELCOME (its identity, its grant and a
signature over the transcript), and require far gateways to: see `fargrants`.

A link is up from a valid handshake until `dead_after` seconds pass with nothing received;
each end sends a heartbeat after `heartbeat` seconds of sending nothing. The dialler says
HELLO again every `retry` seconds while down.
"""

from __future__ import annotations

import hmac
import os
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from irismesh._core.rights import PeerGrant
from irismesh.errors import ConfigurationError, ProtocolError
from irismesh.federation.fargrants import (
    EXPORT_TOPIC,
    IMPORT_CLUSTER,
    IMPORT_TOPIC,
    FarGrants,
    FarVerdicts,
    Signer,
    check_far,
    granted_exports,
    no_grant,
)
from irismesh.federation.linkwire import (
    HEADER,
    HELLO,
    HELLO_DOMAIN,
    HELLO_SIGN_DOMAIN,
    LINK_SCOPE,
    MAGIC,
    MAX_FRAME,
    REHELLO,
    SEALED,
    VERSION,
    WELCOME,
    WELCOME_DOMAIN,
    WELCOME_SIGN_DOMAIN,
    Exports,
    Hello,
    Item,
    Session,
    agree,
    handshake_body,
    link_secrets,
    mac,
    open_hello,
    pack,
    said_fields,
    shown_fields,
    unpack,
)

# What crosses a link (`linkwire`) is named here too, as it always was.
__all__ = [
    "HEADER",
    "HELLO",
    "LINK_SCOPE",
    "MAGIC",
    "MAX_FRAME",
    "REHELLO",
    "SEALED",
    "VERSION",
    "WELCOME",
    "Exports",
    "Hello",
    "Item",
    "LinkConfig",
    "LinkEnd",
    "ServeRequest",
    "link_secrets",
    "open_hello",
]

_MAX_BATCH_ITEMS = 512
_MAX_BATCH_BYTES = 256 * 1024
_ACK_MARK = 0.05  # seconds between the marks of when acks came (`LinkEnd._ack_marks`)

# (cluster, payload, timeout, done): a request served in-process, `done(reply, error)` once.
# (cluster, payload, timeout, done, the caller's trace context)
ServeRequest = Callable[
    [str, bytes, float, Callable[[bytes | None, BaseException | None], None], bytes], None
]


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkConfig:
    """Timing and bounds of one link end (seconds, items)."""

    buffer: int = 100_000  # reliable items kept until acknowledged; beyond: dropped, counted
    window: int = 4096  # reliable items in flight before an ack
    heartbeat: float = 0.25
    dead_after: float = 1.5
    retry: float = 0.5
    resend_after: float = 1.0  # acks not progressing this long: send again from the oldest
    # A peer that dialled in and has been silent this long is forgotten with what it had
    # buffered (a gateway that restarts comes back as a new peer): counted, not kept forever.
    forget_after: float = 600.0
    # What the peer acknowledged stays here this long (at most `keep_acked_items` of it), to
    # send again should the peer turn out to have died: an importing gateway acknowledges a
    # message once its node has it, and one SIGKILLed a moment later takes with it what its
    # node had not yet written to the subscribers (`unacknowledged(now=...)`).
    keep_acked: float = 2.0
    keep_acked_items: int = 4096

    def __post_init__(self) -> None:
        if self.buffer < 1 or self.window < 1:
            raise ConfigurationError("link buffer and window must be at least 1")
        if self.keep_acked < 0 or self.keep_acked_items < 0:
            raise ConfigurationError("keep_acked and keep_acked_items must not be negative")
        if not 0 < self.heartbeat < self.dead_after < self.forget_after:
            raise ConfigurationError("want 0 < heartbeat < dead_after < forget_after")


@dataclass(slots=True)
class _Pending:
    private: X25519PrivateKey
    nonce: bytes
    raw_said: bytes
    sent_at: float
    shown: bool  # this HELLO showed our identity (so the WELCOME must show the far one's)


@dataclass(slots=True)
class LinkEnd:
    """This gateway's end of the link to one peer gateway (see the module's docstring).

    Reliable items go in with `send`, plain ones with `send_plain`; `outgoing(now)` gives the
    frames to send; `receive(frame, now)` gives the items that arrived, in order.
    """

    gateway_id: bytes
    mesh: str
    secrets: tuple[bytes, ...]  # accepted link keys, primary first
    exports: Exports
    dialler: bool
    config: LinkConfig = field(default_factory=LinkConfig)
    random_bytes: Callable[[int], bytes] = os.urandom
    stats: Counter[str] = field(default_factory=Counter)
    peer_id: bytes = b""
    peer_mesh: str = ""
    peer_exports: Exports = field(default_factory=Exports)
    stream: bytes = b""
    # Outbound stream: items base_seq.. in `_buf[_head:]`, the next to transmit at `_cursor`.
    _buf: list[Item] = field(default_factory=list)
    _head: int = 0
    _base_seq: int = 1
    _next_seq: int = 1
    _cursor: int = 1
    _progress_at: float = 0.0
    # When acks moved the stream on: (time, the first sequence number that ack covered), one
    # entry per _ACK_MARK seconds at most, none older than `keep_acked`.
    _ack_marks: deque[tuple[float, int]] = field(default_factory=deque)
    # Inbound stream.
    _peer_stream: bytes = b""
    _received: int = 0  # the last reliable item received in order
    _consumed: int = 0  # the last one the application is done with (acknowledged)
    _peer_received: int = 0  # the last of ours the peer has (sent again only beyond it)
    _ack_due: bool = False
    # False: the application says when it is done with each reliable item (`consumed`), and
    # only then is it acknowledged, so a slow reader holds the sender back by its window.
    auto_consume: bool = True
    # Not None: the reliable items the peer acknowledged are appended here, for the
    # application to take (a gateway tells its mesh's other gateways what was delivered).
    acked_items: list[Item] | None = None
    _plain: deque[Item] = field(default_factory=deque)
    _session: Session | None = None
    _session_secret: bytes = b""  # the link key the session's handshake proved
    _pending: _Pending | None = None
    last_in: float = 0.0  # when it last heard its peer (its driver adds its own loop stalls)
    _last_out: float = 0.0
    _seen_hellos: dict[bytes, None] = field(default_factory=dict)
    up: bool = False
    # Set on an in-process link (`locallink`): the far gateway's `serve_request`, which a
    # request is handed to directly instead of as an item.
    serve_request: ServeRequest | None = None
    # And the far gateway's `relay_target`: its node, for an importing gateway's node to relay
    # a cluster's requests to (`Node.relay_requests`), or None where it cannot.
    relay_target: Callable[[str], Any] | None = None
    # The gateway's identity and its grant's token, shown in a HELLO when `far_grants` is set
    # and in a WELCOME to a HELLO that showed one.
    identity: Signer | None = None
    grant_token: Callable[[], bytes] = no_grant
    # Set: the far gateway must show a grant these verdicts admit (the gateway's switch).
    far_grants: FarGrants | None = None
    peer_public: bytes = b""  # the far gateway's identity, if it showed one
    peer_grant: PeerGrant | None = None  # its grant as admitted; None: not checked
    _far: FarVerdicts = field(default_factory=FarVerdicts)

    def __post_init__(self) -> None:
        if not self.secrets:
            raise ConfigurationError("a link needs at least one link key")
        self.stream = self.random_bytes(8)

    # ------------------------------------------------------------- state

    @property
    def buffered(self) -> int:
        """Reliable items sent or waiting that the peer has not acknowledged."""
        return self._next_seq - self._base_seq

    def _said(self, nonce: bytes, public: bytes, *, shown: bool = False) -> list[Any]:
        acked = [self._peer_stream, self._consumed]
        said = [
            VERSION,
            self.gateway_id,
            self.mesh,
            nonce,
            public,
            self.stream,
            acked,
            self.exports.wire(),
        ]
        if shown:
            assert self.identity is not None
            said += [self.identity.public, self.grant_token()]
        return said

    def _established(
        self,
        key: bytes,
        nonces: bytes,
        peer: tuple[bytes, str, bytes, tuple[bytes, int], Exports],
        now: float,
        far: tuple[bytes, PeerGrant | None] = (b"", None),
    ) -> None:
        peer_id, peer_mesh, peer_stream, acked, exports = peer
        self.peer_public, self.peer_grant = far
        self._far.reset(far[1])
        if far[1] is not None:  # what it exports beyond its grant is not taken from it
            exports = granted_exports(far[1], exports, self.stats)
        self._session = Session(key, nonces, dialler=self.dialler)
        self.peer_id, self.peer_mesh, self.peer_exports = peer_id, peer_mesh, exports
        if peer_stream != self._peer_stream:  # a new peer process: its stream starts afresh
            self._peer_stream, self._received, self._consumed = peer_stream, 0, 0
        if acked[0] == self.stream:
            self._acknowledge(acked[1], acked[1], now)
        self._cursor = self._base_seq  # replay everything not acknowledged, in order
        self._peer_received = self._base_seq - 1
        self._progress_at = now
        self.last_in = self._last_out = now
        self._ack_due = True
        self.up = True
        self.stats["sessions"] += 1

    def use_secrets(self, secrets: tuple[bytes, ...]) -> bool:
        """Accept these link keys from now on (a rotated link keyring, primary first). A
        session under a key no longer accepted ends (True; counted `rekeyed`): a dialler says
        HELLO again under the new primary, with what was not acknowledged kept for replay."""
        if not secrets:
            raise ConfigurationError("a link needs at least one link key")
        used = self._session_secret
        if self.up and used not in secrets:
            self.secrets = secrets
            self.down()
            self.stats["rekeyed"] += 1
            return True
        if self.up and not self.dialler:
            secrets = (used, *[s for s in secrets if s != used])
        self.secrets = secrets
        return False

    def down(self) -> None:
        """Forget the session (dead peer or closing): reliable items stay buffered."""
        if self.up:
            self.stats["downs"] += 1
        self.up = False
        self._session = None
        self._plain.clear()

    # ------------------------------------------------------------- handshake

    def hello(self, now: float) -> bytes:
        """A dialler's HELLO (a new session attempt)."""
        private = X25519PrivateKey.generate()
        nonce = self.random_bytes(16)
        shown = self.far_grants is not None and self.identity is not None
        public = private.public_key().public_bytes_raw()
        raw_said = pack(self._said(nonce, public, shown=shown))
        self._pending = _Pending(private, nonce, raw_said, now, shown)
        body: list[bytes] = [raw_said, mac(self.secrets[0], HELLO_DOMAIN, raw_said)]
        if shown:
            assert self.identity is not None
            body.append(self.identity.sign(HELLO_SIGN_DOMAIN + raw_said))
        self._last_out = now
        return HEADER.pack(MAGIC, VERSION, HELLO, 0) + pack(body)

    def hello_due(self, now: float) -> bool:
        if not self.dialler or self.up:
            return False
        return self._pending is None or now - self._pending.sent_at >= self.config.retry

    def accept(self, hello: Hello, now: float) -> bytes:
        """A listener's WELCOME to a checked HELLO; the link is up."""
        if hello.nonce in self._seen_hellos:
            raise ProtocolError("replay")
        self._seen_hellos[hello.nonce] = None
        if len(self._seen_hellos) > 1024:
            del self._seen_hellos[next(iter(self._seen_hellos))]
        # Refused, a HELLO changes nothing: a session up stays up (its grant was checked, and
        # goes on being checked), so a HELLO with another gateway's id cannot end it.
        far = check_far(self.far_grants, hello.shown)
        if self.far_grants is not None and self.peer_public and far[0] != self.peer_public:
            # A gateway id is random per process and its identity stays: another key under
            # it is another gateway, which must not take over this one's stream.
            raise ProtocolError("identity_changed", "a gateway id linked under another identity")
        private = X25519PrivateKey.generate()
        shared = agree(private, hello.public)
        nonce = self.random_bytes(16)
        shown = hello.shown is not None and self.identity is not None
        raw_said = pack(self._said(nonce, private.public_key().public_bytes_raw(), shown=shown))
        body = [raw_said, mac(hello.secret, WELCOME_DOMAIN, hello.raw_said, raw_said)]
        if shown:
            assert self.identity is not None
            body.append(self.identity.sign(WELCOME_SIGN_DOMAIN + hello.raw_said + raw_said))
        peer = (hello.gateway_id, hello.mesh, hello.stream, hello.acked, hello.exports)
        self.secrets = (hello.secret, *[s for s in self.secrets if s != hello.secret])
        self._session_secret = hello.secret
        self._established(hello.secret + shared, nonce + hello.nonce, peer, now, far)
        return HEADER.pack(MAGIC, VERSION, WELCOME, 0) + pack(body)

    def _on_welcome(self, frame: bytes, now: float) -> None:
        pending = self._pending
        if pending is None or self.up:
            raise ProtocolError("unexpected_welcome")
        body = handshake_body(frame)
        raw_said, proof = body[0], body[1]
        secret = self.secrets[0]
        if not hmac.compare_digest(mac(secret, WELCOME_DOMAIN, pending.raw_said, raw_said), proof):
            raise ProtocolError("bad_proof")
        said = unpack(raw_said)
        gid, mesh, nonce, public, stream, acked, exports = said_fields(said)
        shown = shown_fields(said, body, WELCOME_SIGN_DOMAIN + pending.raw_said + raw_said)
        if shown is not None and not pending.shown:
            raise ProtocolError("bad_handshake", "a WELCOME showed an identity unasked")
        far = check_far(self.far_grants, shown)
        shared = agree(pending.private, public)
        self._pending = None
        self._session_secret = secret
        self._established(
            secret + shared, nonce + pending.nonce, (gid, mesh, stream, acked, exports), now, far
        )

    # ------------------------------------------------------------- sending

    def send(self, item: Item) -> bool:
        """Queue a reliable item; False (counted) when the buffer is full."""
        if self._next_seq - self._base_seq >= self.config.buffer:
            self.stats["dropped_buffer_full"] += 1
            return False
        self._buf.append(item)
        self._next_seq += 1
        return True

    def send_plain(self, item: Item) -> bool:
        """Queue an item sent once while the link is up; False when it is down."""
        if not self.up:
            return False
        self._plain.append(item)
        return True

    def outgoing(self, now: float) -> list[bytes]:
        """Frames to send now: items, acks, heartbeats, a HELLO; retransmissions when due."""
        if not self.up:
            return [self.hello(now)] if self.hello_due(now) else []
        cfg = self.config
        resume = max(self._base_seq, self._peer_received + 1)
        if (
            self._cursor > resume and now - self._progress_at >= cfg.resend_after
        ):  # acks stopped: send again from the oldest the peer does not have
            self.stats["resends"] += self._cursor - resume
            self._cursor = resume
            self._progress_at = now
        frames: list[bytes] = []
        limit = min(self._next_seq, self._base_seq + cfg.window)
        while self._cursor < limit or self._plain:
            batch: list[list[Any]] = []
            size = 0
            while (
                self._cursor < limit and len(batch) < _MAX_BATCH_ITEMS and size < _MAX_BATCH_BYTES
            ):
                item = self._buf[self._head + self._cursor - self._base_seq]
                batch.append([self._cursor, item])
                size += _approx_size(item)
                self._cursor += 1
            plain: list[Item] = []
            while self._plain and len(plain) < _MAX_BATCH_ITEMS and size < _MAX_BATCH_BYTES:
                item = self._plain.popleft()
                plain.append(item)
                last = item[-1] if item else b""  # _approx_size inlined: per request, per reply
                size += 64 + len(last) if type(last) is bytes else 64
            frames.append(self._seal([self._consumed, batch, plain, self._received], now))
        if not frames and (self._ack_due or now - self._last_out >= cfg.heartbeat):
            frames.append(self._seal([self._consumed, [], [], self._received], now))
        return frames

    def _seal(self, body: list[Any], now: float) -> bytes:
        session = self._session
        assert session is not None
        session.out_counter += 1
        header = HEADER.pack(MAGIC, VERSION, SEALED, session.out_counter)
        self._ack_due = False
        self._last_out = now
        return header + session.outbound.seal(header, session.out_counter, pack(body))

    # ------------------------------------------------------------- receiving

    def receive(self, frame: bytes, now: float) -> list[Item]:
        """The items a frame brings, in order: reliable ones first, then plain ones.

        A bad frame raises ProtocolError with its reason (counted here as `dropped_<reason>`)."""
        try:
            return self._receive(frame, now)
        except ProtocolError as exc:
            self.stats["dropped_" + exc.reason] += 1
            raise

    def _receive(self, frame: bytes, now: float) -> list[Item]:
        if len(frame) < HEADER.size or len(frame) > MAX_FRAME:
            raise ProtocolError("malformed")
        magic, version, kind, counter = HEADER.unpack_from(frame)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError("malformed")
        if kind == WELCOME:
            self._on_welcome(frame, now)
            return []
        if kind != SEALED:
            raise ProtocolError("malformed")
        session = self._session
        if session is None:
            raise ProtocolError("no_session")
        if counter <= session.in_counter:
            raise ProtocolError("replay")
        header = frame[: HEADER.size]
        body = unpack(session.inbound.open(header, counter, frame[HEADER.size :]))
        session.in_counter = counter
        self.last_in = now
        if not (
            isinstance(body, list)
            and len(body) == 4
            and type(body[0]) is int
            and isinstance(body[1], list)
            and isinstance(body[2], list)
            and type(body[3]) is int
        ):
            raise ProtocolError("malformed")
        ack, reliable, plain, received = body
        self._acknowledge(ack, received, now)
        out: list[Item] = []
        for entry in reliable:
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int):
                raise ProtocolError("malformed")
            seq, item = entry
            if seq <= self._received:
                self.stats["duplicates"] += 1
            elif seq == self._received + 1 and isinstance(item, list):
                self._received = seq
                if self.auto_consume:
                    self._consumed = seq
                out.append(item)
            else:
                self.stats["out_of_order"] += 1
            self._ack_due = True
        for item in plain:
            if isinstance(item, list):
                out.append(item)
        return out

    def consumed(self, count: int = 1) -> None:
        """The application is done with the next `count` reliable items it was given
        (`auto_consume=False`): they are acknowledged with the next frame."""
        self._consumed = min(self._received, self._consumed + count)
        self._ack_due = True

    def _acknowledge(self, ack: int, received: int, now: float) -> None:
        if self._base_seq <= received + 1 <= self._next_seq and received > self._peer_received:
            self._peer_received = received
            self._progress_at = now
        if ack < self._base_seq or ack >= self._next_seq:
            return
        drop = ack - self._base_seq + 1
        if self.acked_items is not None:
            self.acked_items.extend(self._buf[self._head : self._head + drop])
        marks = self._ack_marks
        if not marks or now - marks[-1][0] >= _ACK_MARK:
            marks.append((now, self._base_seq))
            while marks and now - marks[0][0] > self.config.keep_acked:
                marks.popleft()
        self._head += drop
        self._base_seq = ack + 1
        self._cursor = max(self._cursor, self._base_seq)
        self._progress_at = now
        keep = self.config.keep_acked_items
        if self._head > keep + 4096 and self._head * 2 > len(self._buf):
            del self._buf[: self._head - keep]
            self._head = keep

    def unacknowledged(self, since: int = 0, now: float | None = None) -> tuple[list[Item], int]:
        """The reliable items the peer has not acknowledged, from sequence number `since` on
        (the oldest first), and the sequence number the next one sent will have. Given `now`,
        also those it acknowledged within `keep_acked` seconds before (as many as are kept)."""
        first = self._base_seq
        if now is not None:
            held_from = self._base_seq - self._head
            for at, seq in self._ack_marks:
                if now - at <= self.config.keep_acked:
                    first = max(seq, held_from)
                    break
        start = self._head + max(first, since) - self._base_seq
        return self._buf[start : self._head + self._next_seq - self._base_seq], self._next_seq

    def silent_for(self, now: float) -> float:
        """Seconds since this end last heard its peer (or came to be)."""
        return now - self.last_in

    def forget(self) -> None:
        """Drop what is buffered for a peer that is not coming back (counted)."""
        self.stats["dropped_forgotten"] += self.buffered
        self._buf.clear()
        self._ack_marks.clear()
        self._head = 0
        self._base_seq = self._cursor = self._next_seq

    def tick(self, now: float) -> bool:
        """Liveness: True if the link just went down (nothing heard for `dead_after`, or the
        far gateway's grant no longer holds: expired or revoked, counted `closed_grant`)."""
        if not self.up:
            return False
        far, grant = self.far_grants, self.peer_grant
        if far is not None and grant is not None and not far.holds(self.peer_public, grant):
            self.stats["closed_grant"] += 1
        elif now - self.last_in < self.config.dead_after:
            return False
        self.down()
        return True

    # ------------------------------------------------------------- the far grant

    def far_may_import_cluster(self, cluster: str) -> bool:
        """Whether the far gateway's grant lets it import `cluster` (so its calls to it are
        answered); True where its grant is not checked."""
        return self._far.allows(IMPORT_CLUSTER, cluster)

    def far_may_import_topic(self, topic: str) -> bool:
        """Whether the far gateway's grant lets it import messages on `topic` (so they are
        sent to it)."""
        return self._far.allows(IMPORT_TOPIC, topic)

    def far_may_export_topic(self, topic: str) -> bool:
        """Whether the far gateway's grant lets it export messages on `topic` (so they are
        taken from it)."""
        return self._far.allows(EXPORT_TOPIC, topic)


def _approx_size(item: Item) -> int:
    """About an item's size on the wire: its payload (the last field) and a little more."""
    last = item[-1] if item else b""
    return 64 + (len(last) if type(last) is bytes else 0)
