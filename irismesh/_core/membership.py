"""Who is in the mesh: SWIM membership with Lifeguard's refinements, sans I/O.

Theory of operation
-------------------
Every node keeps a table of every other node (`Member`: its record, incarnation and state) and
spends a fixed budget per protocol period, whatever the mesh's size:

- **Probing.** Each period it pings one member, chosen by a shuffled round robin (an incremental
  Fisher-Yates pass over the table, so every member is probed once per N periods and a new
  member lands at a random place in the pass). No ACK within the probe timeout: it asks
  `indirect_probes` other members to ping the target for it (PING_REQ); they relay the ACK or,
  Lifeguard's addition, a NACK saying they heard nothing. No ACK by the end of the period: the
  target is *suspect*.
- **Suspicion.** A suspect is declared dead when its `Suspicion` times out, after a time that
  grows with log N and shrinks as other nodes independently suspect it too. Only the suspect can
  clear it: hearing that it is suspected, it raises its *incarnation* and says ALIVE, which
  overrides any suspicion of a lower incarnation. Deaths are final for that incarnation; a node
  falsely declared dead refutes the same way.
- **Dissemination.** Joins (ALIVE), suspicions, deaths and leaves are piggybacked on the
  datagrams the protocol sends anyway, and pushed to `gossip_nodes` random members every
  gossip interval, each update about λ·log N times (`broadcasts`): an epidemic that reaches all
  nodes in O(log N) periods. Notices (an authority's revocations: signed bytes this module
  does not read) travel the same way: each node hands those it hears to its engine, which
  spreads on only the ones it finds new and trusted, so a notice dies out once every node
  holds it.
- **Anti-entropy.** Now and then a node exchanges its whole table with one random member
  (STATE, push-pull), and tries one member it holds dead: a partition heals when both sides
  hear each other again and the nodes each side declared dead refute it. A node held dead
  that is heard from (any datagram: a probe, gossip) is told of its death at once, and when
  one member held dead comes back every other one held dead is told too (it may be on the
  healed side): those alive refute at once, so both sides are whole again a few round trips
  after the first datagram crosses. A joining node exchanges tables with the node that let
  it in.
- **Local health** (`Awareness`): a node whose probes fail, whose nacks do not come back, or
  that must refute suspicions about itself is likely the slow one; it stretches its own
  timeouts instead of accusing healthy peers.
- **Leaving.** A node that leaves sends DEAD about itself to every member at once. Given
  signed records, a node restarted under the same identity (the same id) outbids the
  incarnation its earlier run left or died at, and its newer record takes it back.

Every datagram is sealed under the mesh key (`gossip`), so nothing here is believed from a node
without it; a datagram counter per sender, checked against a sliding window, drops replays.
Records are also signed by their nodes (`records.record_proven`), given an identity: a record
that would change this node's table (a new member, a higher incarnation) is taken only if its
node's key signed it, so a holder of the mesh key cannot forge another node's record or take
its id; anything else is dropped and counted (`dropped_bad_record_signature`). Only records
that would change the table are checked, and each checked record is remembered (its bytes ->
the verdict, bounded), so gossip repeating a record costs one signature check per node.
Suspicions and deaths are not signed: they are refuted as before, by a signed ALIVE.

A node whose key an authority revoked is *barred* (`bar`, by the engine, in a mesh that
requires grants): it leaves the table as a death, but one it cannot refute: while it stays
barred every datagram it sends is dropped (`dropped_revoked_datagrams`), and every ALIVE record
of it, whatever its incarnation and whoever relays it, is dropped too (`dropped_revoked_alive`),
so it is never probed, gossiped to or routed to again. It is told once that it is dead, and
why (the revocation: gossip no longer reaches it). The bar lifts only when the engine sees it
link with a grant issued after its revocation (`unbar`): a barred node heard with a record it
signed is dialled now and then to give it the chance (`rechecks`).
The state machine takes datagrams and time in (`receive`, `tick`) and leaves datagrams
(`outbox`) and membership events (`events`) for its driver; it has no clock or randomness of
its own.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from random import Random
from typing import Any

from irismesh._core.datagram_out import DatagramOut, push_pull_interval, state_entry
from irismesh._core.gossip import (
    MAX_DATAGRAM,
    DatagramSealer,
    ReplayWindows,
    encode_message,
    open_datagram,
    open_name,
)
from irismesh._core.probes import Prober
from irismesh._core.records import (
    Member,
    MemberChanged,
    MemberDown,
    MemberEvent,
    MemberRecord,
    MembershipConfig,
    MemberState,
    MemberSuspect,
    MemberUp,
    NodeIdentity,
    record_proven,
    record_transcript,
)
from irismesh._core.suspicion import Suspicion, suspicion_bounds
from irismesh.errors import ProtocolError

_ALIVE_STATE, _SUSPECT_STATE = MemberState.ALIVE, MemberState.SUSPECT
_DEAD_STATE, _LEFT_STATE = MemberState.DEAD, MemberState.LEFT

_PING, _PING_REQ, _ACK, _NACK, _ALIVE, _SUSPECT, _DEAD, _STATE, _NOTICE = range(1, 10)
_MAX_NOTICES = 64  # notices heard and not yet taken by the engine
_SMALL_TABLE = 8  # live members up to which a peer learnt on a link is asked for its table
_MAX_VERDICTS = 8192  # records whose signature check is remembered
_RECHECK_BARRED = 5.0  # seconds: a barred node that speaks is dialled at most this often
_MAX_RECHECKS = 16  # barred nodes waiting to be dialled


class Membership:
    """One node's view of the mesh. Not thread-safe; the driver owns it."""

    def __init__(
        self,
        me: MemberRecord,
        *,
        sealer: DatagramSealer,
        rng: Random,
        config: MembershipConfig | None = None,
        stats: Counter[str] | None = None,
        identity: NodeIdentity | None = None,
    ) -> None:
        self.config = config or MembershipConfig()
        self.me = me
        # None: records are neither signed nor checked (simulations of the protocol alone).
        self._identity = identity
        self._verdicts: dict[bytes, bool] = {}
        self._own_proof: tuple[MemberRecord, int, MemberRecord] | None = None
        self.incarnation = 0
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.events: list[MemberEvent] = []
        self._sealer = sealer
        self._out = DatagramOut(
            me.node_id,
            sealer=sealer,
            config=self.config,
            population=lambda: self._live + 1,
            stats=self.stats,
        )
        self._queue = self._out.queue
        self._send, self._send_packed = self._out.send, self._out.send_packed
        self._rng = rng
        self._members: dict[bytes, Member] = {}
        self._live = 0  # members ALIVE or SUSPECT
        self._suspicions: dict[bytes, Suspicion] = {}
        self._prober = Prober(
            self._members,
            config=self.config,
            rng=rng,
            send=self._send,
            suspect=self._suspect_unanswered,
            stats=self.stats,
        )
        self._joins: dict[str, float] = {}  # address -> its retry backoff
        self._next_join = math.inf
        self._settling = 0  # table exchanges still due soon after joining
        self._windows = ReplayWindows(2 * self.config.max_members)
        self._next_gossip = 0.0
        self._next_push_pull = 0.0
        self._next_reconnect = 0.0
        self._told_dead: dict[bytes, float] = {}  # node held dead -> when it was told so
        self._next_reap = 0.0
        self._started = False
        self._sealed_name: bytes | None = None
        self.left = False
        # Notices heard (authorities' revocations, as opaque signed bytes): the engine takes
        # them, and spreads on those it finds new and trusted (`spread_notice`).
        self.notices: list[bytes] = []
        # Node ids whose keys are revoked -> when one was last asked to prove a new grant.
        self._barred: dict[bytes, float] = {}
        # Barred nodes heard with a record they signed, to be dialled (`rechecks_due`).
        self.rechecks: list[MemberRecord] = []

    # ----------------------------------------------------------------- queries

    @property
    def outbox(self) -> list[tuple[str, bytes]]:
        """Datagrams waiting for the driver: (address, datagram) each."""
        return self._out.outbox

    def take_outbox(self) -> list[tuple[str, bytes]]:
        return self._out.take()

    def __len__(self) -> int:
        """Members alive or suspect, this node not counted."""
        return self._live

    def get(self, node_id: bytes) -> Member | None:
        return self._members.get(node_id)

    def members(self) -> Iterator[Member]:
        return iter(self._members.values())

    def rtt(self, node_id: bytes) -> float | None:
        """The round trip of this node's last direct probe of `node_id`, if any."""
        return self._prober.rtt.get(node_id)

    @property
    def health(self) -> int:
        """The local health score: 0 is healthy."""
        return self._prober.awareness.score

    def sealed_name(self) -> bytes:
        """This node's name as its handshakes carry it: sealed under the mesh key."""
        if self._sealed_name is None:
            self._sealed_name = self._out.seal_name(self.me.name)
        return self._sealed_name

    def signed_me(self) -> MemberRecord:
        """This node's record with its proof at the current incarnation (signed once)."""
        signed = self._own_proof
        if signed is not None and signed[0] is self.me and signed[1] == self.incarnation:
            return signed[2]
        me, identity = self.me, self._identity
        if identity is None:
            return me
        signature = identity.sign(record_transcript(me, self.incarnation))
        record = MemberRecord(
            me.node_id, me.endpoint, me.address, me.tags, me.name, identity.public, signature
        )
        self._own_proof = (me, self.incarnation, record)
        return record

    def barred(self, node_id: bytes) -> bool:
        """Whether `node_id` is barred (its key revoked: see the module's docstring)."""
        return node_id in self._barred

    def rekeyed(self) -> None:
        """The mesh key changed (its sealer seals under the new one): seal the name again."""
        self._sealed_name = None

    def open_name(self, sender: bytes, sealed: object) -> str:
        """The name in a peer's handshake record; ProtocolError if it is not one."""
        return open_name(self._sealer, sender, sealed)

    # ----------------------------------------------------------------- inputs

    def join(self, address: str, now: float) -> None:
        """Exchange tables with the node at `address` (a seed, or one a link let in).

        Retried with backoff until some node's table arrives: a lost datagram must not leave
        a node alone.
        """
        self._joins[address] = self.config.probe_interval
        self._next_join = min(self._next_join, now + self.config.probe_interval)
        self._send_state_to(address, reply=True)
        self.stats["joins_sent"] += 1

    def adopt(self, members: Iterable[Member]) -> None:
        """Start from a known table, silently (a simulation of a converged mesh, a snapshot)."""
        for member in members:
            node_id = member.record.node_id
            if node_id == self.me.node_id or node_id in self._members:
                continue
            if node_id in self._barred:
                continue
            self._members[node_id] = member
            if member.state <= _SUSPECT_STATE:
                self._live += 1
                self._prober.add(node_id)

    def learn(self, record: MemberRecord, incarnation: int, now: float) -> None:
        """A node proved itself on a link: take its record as an ALIVE. While this node's
        table is small, a node it did not know is asked for its table too (a push-pull): a
        node that others dialled before it joined (it restarted at an address they knew, or
        they found it first) has otherwise only the records of those that dialled it, until
        the next periodic exchange, and a publisher there reaches none of the others."""
        new = record.node_id not in self._members
        self._on_alive(record, incarnation, now)
        if new and self._live <= _SMALL_TABLE and record.address:
            self._send_state_to(record.address, reply=True)
            self.stats["tables_asked_of_new_peers"] += 1

    def update(self, now: float, *, tags: bytes | None = None, endpoint: str | None = None) -> None:
        """This node's record changed: a new incarnation tells everyone."""
        record = self.me
        self.me = MemberRecord(
            record.node_id,
            record.endpoint if endpoint is None else endpoint,
            record.address,
            record.tags if tags is None else tags,
            record.name,
        )
        self.incarnation += 1
        self._announce_self()

    def bar(self, node_id: bytes, now: float, notice: bytes = b"") -> None:
        """`node_id`'s key is revoked: drop it from the table as a death it cannot refute,
        and tell it so once, with the `notice` that revoked it (gossip no longer reaches it,
        and a node that knows its own grant revoked refuses its own calls at once); its
        datagrams and records are dropped until `unbar`."""
        if node_id == self.me.node_id or node_id in self._barred:
            return
        self._barred[node_id] = now
        member = self._members.pop(node_id, None)
        self._suspicions.pop(node_id, None)
        self._told_dead.pop(node_id, None)
        if member is None:
            return
        self.stats["members_revoked"] += 1
        if member.state > _SUSPECT_STATE:
            return
        self._live -= 1
        self.events.append(MemberDown(record=member.record, reason="dead"))
        dead = encode_message([_DEAD, node_id, member.incarnation, self.me.node_id])
        # Nodes that have not applied the revocation yet hold it dead meanwhile.
        self._queue.queue(node_id, dead)
        told = [dead, encode_message([_NOTICE, notice])] if notice else [dead]
        self._send_packed(member.record.address, told, piggyback=False)

    def unbar(self, node_id: bytes) -> None:
        """`node_id` linked with a grant issued after its revocation: take its records again."""
        self._barred.pop(node_id, None)

    def unbar_all(self) -> None:
        """Grants are no longer required here: revocations bar no one."""
        self._barred.clear()

    def probe_soon(self, node_id: bytes, now: float) -> None:
        """Evidence that `node_id` may be gone (its link broke): probe it next, now if idle."""
        member = self._members.get(node_id)
        if member is not None and member.state <= _SUSPECT_STATE:
            self._prober.probe_soon(node_id, now)

    def leave(self, now: float) -> None:
        """Tell every member, directly, that this node leaves; then stay silent."""
        if self.left:
            return
        self.left = True
        goodbye = encode_message([_DEAD, self.me.node_id, self.incarnation, self.me.node_id])
        for member in self._members.values():
            if member.state <= _SUSPECT_STATE:
                self._send_packed(member.record.address, [goodbye], piggyback=False)
        self._queue.clear()

    def receive(self, source: str, datagram: bytes, now: float) -> None:
        """A datagram arrived from `source` (host:port)."""
        if self.left:
            return
        try:
            sender, counter, messages = open_datagram(self._sealer, datagram, MAX_DATAGRAM)
        except ProtocolError as exc:
            self.stats["dropped_" + exc.reason] += 1
            return
        if sender == self.me.node_id:
            self.stats["dropped_own_datagram"] += 1
            return
        if not self._windows.fresh(sender, counter):
            self.stats["dropped_replay"] += 1
            return
        if self._barred and sender in self._barred:
            self.stats["dropped_revoked_datagrams"] += 1
            for message in messages:  # its refutations, counted as such
                if message[0] == _ALIVE and message[1] == sender:
                    node_id, endpoint, address, tags, name = sender, *message[3:7]
                    record = MemberRecord(
                        node_id, endpoint, address, tags, name, message[7], message[8]
                    )
                    self._barred_alive(record, message[2], now)
            return
        self.stats["datagrams_received"] += 1
        for message in messages:
            self._dispatch(source, sender, message, now)
        member = self._members.get(sender)
        if member is not None and member.state is _DEAD_STATE:
            self._tell_dead(member, now)

    def tick(self, now: float) -> None:
        """Probes, timeouts, gossip, anti-entropy and reaping due by `now`."""
        if self.left:
            return
        cfg = self.config
        if not self._started:
            self._started = True
            jitter = self._rng.random()
            self._prober.next_probe = now + jitter * cfg.probe_interval
            self._next_gossip = now + jitter * cfg.gossip_interval
            self._next_push_pull = now + self._push_pull_interval() * (0.5 + jitter)
            self._next_reconnect = now + cfg.reconnect_interval * (0.5 + jitter)
            self._next_reap = now + 1.0
            self._announce_self()
        self._prober.tick(now)
        if now >= self._next_join:
            self._retry_joins(now)
        if self._suspicions:
            for node_id, suspicion in list(self._suspicions.items()):
                if now >= suspicion.deadline:
                    del self._suspicions[node_id]  # consumed, whatever the verdict
                    self._on_dead(node_id, suspicion.incarnation, self.me.node_id, now)
        if now >= self._next_gossip:
            self._next_gossip = now + cfg.gossip_interval
            if self._queue:
                self._gossip(now)
        if now >= self._next_push_pull:
            if self._settling:
                self._settling -= 1
                self._next_push_pull = now + 2.0
            else:
                interval = self._push_pull_interval()
                self._next_push_pull = now + interval * (0.5 + self._rng.random())
            for target in self._prober.sample(1, exclude=b""):
                self._send_state_to(target.record.address, reply=True)
                self.stats["push_pulls"] += 1
        if now >= self._next_reconnect:
            self._next_reconnect = now + cfg.reconnect_interval * (0.5 + self._rng.random())
            self._reconnect()
        if now >= self._next_reap:
            self._next_reap = now + 1.0
            self._reap(now)

    def next_deadline(self) -> float:
        """When `tick` next has something to do."""
        if self.left:
            return math.inf
        if not self._started:
            return 0.0
        due = min(
            self._prober.next_deadline(),
            self._next_push_pull,
            self._next_reconnect,
            self._next_reap,
        )
        if self._queue:
            due = min(due, self._next_gossip)
        if self._joins:
            due = min(due, self._next_join)
        for suspicion in self._suspicions.values():
            due = min(due, suspicion.deadline)
        return due

    # ----------------------------------------------------------------- messages in

    def _dispatch(self, source: str, sender: bytes, message: list[Any], now: float) -> None:
        kind = message[0]
        if kind == _PING:
            if message[2] != self.me.node_id:  # meant for a node that was here before us
                self.stats["dropped_misdirected_ping"] += 1
                return
            self._send(source, [[_ACK, message[1]]])
        elif kind == _ACK:
            self._prober.on_ack(message[1], sender, now)
        elif kind == _PING_REQ:
            self._prober.on_ping_req(source, message[1], message[2], message[3], now)
        elif kind == _NACK:
            self._prober.on_nack(message[1])
        elif kind == _ALIVE:
            node_id, endpoint, address, tags, name = message[1], *message[3:7]
            record = MemberRecord(node_id, endpoint, address, tags, name, message[7], message[8])
            self._on_alive(record, message[2], now)
        elif kind == _NOTICE:
            if len(self.notices) < _MAX_NOTICES:
                self.notices.append(message[1])
            else:
                self.stats["dropped_notices_overflow"] += 1
        elif kind in (_SUSPECT, _DEAD):
            node_id, incarnation = message[1], message[2]
            if kind == _SUSPECT:
                self._on_suspect(node_id, incarnation, message[3], now)
            else:
                self._on_dead(node_id, incarnation, message[3], now)
            self._correct(source, node_id, incarnation)
        else:  # STATE
            self._merge_state(sender, message[2], now)
            if message[1]:
                self._send_state_to(source, reply=False)
            elif self._joins:  # a table came back: this node has joined
                self._joins.clear()
                self._next_join = math.inf
                # Nodes that joined at about the same time as this one are in no table yet,
                # and news spreads thinly while a mesh is small: exchange tables twice more,
                # with random members, while the mesh settles.
                self._settling = 2
                self._next_push_pull = min(self._next_push_pull, now + 1.0)

    def _on_alive(
        self, record: MemberRecord, incarnation: int, now: float, *, spread: bool = True
    ) -> None:
        node_id = record.node_id
        if node_id == self.me.node_id:
            # An earlier run of this node (its identity kept) said more: outbid it.
            if incarnation > self.incarnation and self._proven(record, incarnation):
                self.incarnation = incarnation + 1
                self._announce_self()
            return
        if node_id in self._barred:  # revoked: no incarnation brings it back
            self._barred_alive(record, incarnation, now)
            return
        member = self._members.get(node_id)
        if member is None:
            if len(self._members) >= self.config.max_members:
                self.stats["dropped_members_overflow"] += 1
                return
            if not self._proven(record, incarnation):
                return
            self._members[node_id] = Member(record, incarnation, _ALIVE_STATE, now)
            self._live += 1
            self._prober.add(node_id)
            self.events.append(MemberUp(record=record))
            if spread:
                self._broadcast_alive(record, incarnation)
            return
        if incarnation <= member.incarnation:
            return
        # A node that left is gone for good, unless records are signed: then a newer record
        # can only come from the node itself, restarted under the same identity.
        if member.state is _LEFT_STATE and self._identity is None:
            return
        if not self._proven(record, incarnation):
            return
        was = member.state
        since = member.since if was is _ALIVE_STATE else now
        self._members[node_id] = Member(record, incarnation, _ALIVE_STATE, since)
        self._suspicions.pop(node_id, None)
        if was is _SUSPECT_STATE:
            self.stats["suspicions_refuted"] += 1
            self.events.append(MemberSuspect(node_id=node_id, suspect=False))
        elif was >= _DEAD_STATE:
            self._live += 1
            self._prober.add(node_id)
            self.stats["members_revived"] += 1
            self.events.append(MemberUp(record=record))
            # One node held dead lives: a partition may have healed, with the others held
            # dead on its side reachable again. Tell each of them now rather than one per
            # reconnect interval: those alive refute at once (whole in a few round trips).
            for other in list(self._members.values()):
                if other.state is _DEAD_STATE:
                    self._tell_dead(other, now)
        if was <= _SUSPECT_STATE and record != member.record:
            self.events.append(MemberChanged(record=record))
        if spread:
            self._broadcast_alive(record, incarnation)

    def _barred_alive(self, record: MemberRecord, incarnation: int, now: float) -> None:
        """A barred node's ALIVE: dropped and counted. It may hold a grant issued since its
        revocation, which only a handshake can show: a record it signed has the engine dial it
        (`rechecks`), at most once per `_RECHECK_BARRED` per node; the handshake refuses it
        again, or admits it and lifts the bar."""
        self.stats["dropped_revoked_alive"] += 1
        node_id = record.node_id
        if now - self._barred[node_id] < _RECHECK_BARRED or len(self.rechecks) >= _MAX_RECHECKS:
            return
        if self._proven(record, incarnation):
            self._barred[node_id] = now
            self.rechecks.append(record)

    def _proven(self, record: MemberRecord, incarnation: int) -> bool:
        """Whether `record` is signed by its node at `incarnation` (always, without an
        identity); a forgery is counted. Verdicts are remembered by the record's bytes."""
        identity = self._identity
        if identity is None:
            return True
        key = record_transcript(record, incarnation) + record.public + record.signature
        ok = self._verdicts.get(key)
        if ok is None:
            ok = record_proven(record, incarnation, identity)
            if len(self._verdicts) >= _MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[key] = ok
            self.stats["record_signatures_checked"] += 1
        if not ok:
            self.stats["dropped_bad_record_signature"] += 1
        return ok

    def _on_suspect(self, node_id: bytes, incarnation: int, by: bytes, now: float) -> None:
        if node_id == self.me.node_id:
            self._refute(incarnation)
            return
        member = self._members.get(node_id)
        if member is None or incarnation < member.incarnation or member.state > _SUSPECT_STATE:
            return
        suspicion = self._suspicions.get(node_id)
        if member.state is _SUSPECT_STATE and suspicion is not None:
            if suspicion.confirm(by):
                self.stats["suspicions_confirmed"] += 1
                self._queue.queue(node_id, encode_message([_SUSPECT, node_id, incarnation, by]))
            return
        self._members[node_id] = Member(member.record, incarnation, _SUSPECT_STATE, now)
        nodes = self._live + 1
        minimum, maximum = suspicion_bounds(
            self.config.suspicion_multiplier,
            self.config.suspicion_max_multiplier,
            nodes,
            self.config.probe_interval,
        )
        # Confirmations can only come from the nodes other than the suspect and the suspecter.
        expected = min(self.config.suspicion_confirmations, max(0, nodes - 2))
        self._suspicions[node_id] = Suspicion(
            incarnation=incarnation,
            start=now,
            minimum=minimum,
            maximum=maximum,
            expected=expected,
            first=by,
        )
        self.stats["members_suspected"] += 1
        self.events.append(MemberSuspect(node_id=node_id, suspect=True))
        self._queue.queue(node_id, encode_message([_SUSPECT, node_id, incarnation, by]))

    def _on_dead(self, node_id: bytes, incarnation: int, by: bytes, now: float) -> None:
        if node_id == self.me.node_id:
            # Declared dead, yet here we are; or an earlier run of this node (its identity
            # kept) left: outbid its departure.
            if by != node_id or (not self.left and self._identity is not None):
                self._refute(incarnation)
            return
        member = self._members.get(node_id)
        if member is None or incarnation < member.incarnation or member.state > _SUSPECT_STATE:
            return
        state = _LEFT_STATE if by == node_id else _DEAD_STATE
        self._members[node_id] = Member(member.record, incarnation, state, now)
        self._live -= 1
        self._suspicions.pop(node_id, None)
        reason = "left" if state is _LEFT_STATE else "dead"
        self.stats["members_" + reason] += 1
        self.events.append(MemberDown(record=member.record, reason=reason))
        self._queue.queue(node_id, encode_message([_DEAD, node_id, incarnation, by]))

    def _refute(self, incarnation: int) -> None:
        if incarnation < self.incarnation:
            return
        self.incarnation = incarnation + 1
        self._prober.awareness.apply(1)
        self.stats["refutations"] += 1
        self._announce_self()

    def _correct(self, source: str, node_id: bytes, incarnation: int) -> None:
        """Answer stale news with fresh news: whoever spoke of an older incarnation of a live
        node (this one included) is sent the current ALIVE at once, so that a refutation that
        gossip happened to miss one suspecter still reaches it before its timeout."""
        if node_id == self.me.node_id:
            if self.left or incarnation >= self.incarnation:
                return
            record, current = self.me, self.incarnation
        else:
            member = self._members.get(node_id)
            if member is None or member.state is not _ALIVE_STATE:
                return
            if incarnation >= member.incarnation:
                return
            record, current = member.record, member.incarnation
        if node_id == self.me.node_id:
            record = self.signed_me()
        alive = [_ALIVE, node_id, current, record.endpoint, record.address, record.tags]
        self._send(source, [[*alive, record.name, record.public, record.signature]])
        self.stats["corrections_sent"] += 1

    def _merge_state(self, sender: bytes, entries: list[list[Any]], now: float) -> None:
        for node_id, incarnation, state, endpoint, address, tags, name, public, sig in entries:
            if state == 0:
                # The partner's table is not spread again (a node spreads its own news), except
                # the partner itself when it is new here: it is joining through this node.
                record = MemberRecord(node_id, endpoint, address, tags, name, public, sig)
                joining = node_id == sender and node_id not in self._members
                self._on_alive(record, incarnation, now, spread=joining)
            elif state == 3:
                self._on_dead(node_id, incarnation, node_id, now)
            elif node_id not in self._members and node_id != self.me.node_id:
                continue  # a node we never saw alive: nothing to suspect
            else:
                # Another node's verdict of death is only a suspicion here: it can be refuted.
                self._on_suspect(node_id, incarnation, sender, now)

    # ----------------------------------------------------------------- probing

    def _suspect_unanswered(self, member: Member, now: float) -> None:
        """A probe went unanswered, directly and indirectly: suspect the member, and tell it,
        so that it can refute at once if it lives."""
        first = member.state is _ALIVE_STATE
        node_id, incarnation = member.record.node_id, member.incarnation
        self._on_suspect(node_id, incarnation, self.me.node_id, now)
        if first:
            message = encode_message([_SUSPECT, node_id, incarnation, self.me.node_id])
            self._send_packed(member.record.address, [message], piggyback=False)

    # ----------------------------------------------------------------- spreading

    def spread_notice(self, notice: bytes) -> None:
        """Gossip a notice as the other updates are (piggybacked, each sent about
        λ·log N times). Whether one is worth spreading is the engine's to say."""
        self._queue.queue(b"notice:" + notice[-16:], encode_message([_NOTICE, notice]))

    def _announce_self(self) -> None:
        self._broadcast_alive(self.signed_me(), self.incarnation)

    def _broadcast_alive(self, record: MemberRecord, incarnation: int) -> None:
        message = [_ALIVE, record.node_id, incarnation, record.endpoint, record.address]
        proof = [record.tags, record.name, record.public, record.signature]
        self._queue.queue(record.node_id, encode_message([*message, *proof]))

    def _gossip(self, now: float) -> None:
        dead_since = now - self.config.gossip_to_dead
        targets = self._prober.sample(self.config.gossip_nodes, exclude=b"", dead_since=dead_since)
        for member in targets:
            if not self._queue:
                break
            self._send_packed(member.record.address, [], piggyback=True)

    def _push_pull_interval(self) -> float:
        return push_pull_interval(self.config.push_pull_interval, self._live + 1)

    def _send_state_to(self, address: str, *, reply: bool) -> None:
        me = state_entry(self.signed_me(), self.incarnation, 0)
        table = (state_entry(m.record, m.incarnation, int(m.state)) for m in self._members.values())
        self._out.send_state(address, itertools.chain((me,), table), reply=reply)

    def _retry_joins(self, now: float) -> None:
        self._next_join = math.inf
        for address, backoff in list(self._joins.items()):
            backoff = min(2 * backoff, 5.0)
            self._joins[address] = backoff
            self._next_join = min(self._next_join, now + backoff)
            self._send_state_to(address, reply=True)
            self.stats["joins_retried"] += 1

    def _reconnect(self) -> None:
        """Tell one member held dead that it is: if it lives (a partition healed, a long
        stall ended), it refutes at once, and the refutation revives it here and spreads.
        (Not a table exchange with every revived member: after a false death, every node
        would exchange tables with that one node at once.)"""
        dead = [m for m in self._members.values() if m.state is _DEAD_STATE]
        if dead:
            member = self._rng.choice(dead)
            record = member.record
            notice = [_DEAD, record.node_id, member.incarnation, self.me.node_id]
            self._send_packed(record.address, [encode_message(notice)], piggyback=False)
            self.stats["reconnects"] += 1

    def _tell_dead(self, member: Member, now: float) -> None:
        """A node held dead spoke (a partition healed, a stall ended) without having heard of
        its death: tell it now, as `_reconnect` does, so that it refutes at once and its
        refutation revives it here and spreads. Across a healed partition every datagram that
        crosses it (a reconnect, then the probes and gossip of the nodes it revived) revives
        its sender this way, instead of each node waiting for a reconnect to pick it. At most
        once a probe interval per node; costs nothing while no dead node speaks."""
        node_id = member.record.node_id
        told = self._told_dead.get(node_id)
        if told is not None and now - told < self.config.probe_interval:
            return
        self._told_dead[node_id] = now
        notice = [_DEAD, node_id, member.incarnation, self.me.node_id]
        self._send_packed(member.record.address, [encode_message(notice)], piggyback=False)
        self.stats["deaths_told"] += 1

    def _reap(self, now: float) -> None:
        cfg = self.config
        gone = [
            node_id
            for node_id, m in self._members.items()
            if (m.state is _DEAD_STATE and now - m.since > cfg.dead_keep)
            or (m.state is _LEFT_STATE and now - m.since > cfg.left_keep)
        ]
        if self._told_dead:
            self._told_dead = {
                node_id: told
                for node_id, told in self._told_dead.items()
                if now - told < cfg.probe_interval
            }
        for node_id in gone:
            del self._members[node_id]
            self._windows.forget(node_id)
            self._prober.rtt.pop(node_id, None)


__all__ = ["Membership"]
