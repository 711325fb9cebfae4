"""SWIM's failure detector: one probe per period, indirect probes, and relays for others.

Each period (stretched by the local health multiplier, `Awareness`) the `Prober` pings one
member, taken from the *probe ring*: an incremental Fisher-Yates pass over the members live when
the pass began, so each is probed once per N periods, in an order no one can predict, and a
member that joins mid-pass is appended and lands at a random place in what is left of it.

    PING target --ACK within probe_timeout--> done (health improves)
         |
         +--no ACK--> PING_REQ to k members --any relayed ACK by the period's end--> done
                             |
                             +--none--> the target is suspect (health worsens by the NACKs
                                        that did not come: Lifeguard's hint that we are slow)

A node asked to probe for another (`on_ping_req`) pings the target under a sequence number of
its own and relays the ACK, or a NACK when the probe timeout passes without one. Members whose
link just failed (`probe_soon`) jump the queue. The prober decides nothing about suspicion
itself: a failed probe is handed to `suspect`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from random import Random
from typing import Any

from irismesh._core.plain import Plain
from irismesh._core.records import Member, MembershipConfig, MemberState
from irismesh._core.suspicion import Awareness

_PING, _PING_REQ, _ACK, _NACK = 1, 2, 3, 4
_SUSPECT_STATE, _DEAD_STATE = MemberState.SUSPECT, MemberState.DEAD
_MAX_RELAYS = 1024

Send = Callable[[str, list[list[Any]]], None]
SuspectCallback = Callable[[Member, float], None]


class _Probe(Plain):
    target: bytes
    seq: int
    sent_at: float
    timeout_at: float
    end_at: float
    acked: bool = False
    indirect: bool = False
    expected_nacks: int = 0
    nacks: int = 0

    def __init__(
        self, target: bytes, seq: int, sent_at: float, timeout_at: float, end_at: float
    ) -> None:
        self.target, self.seq, self.sent_at = target, seq, sent_at
        self.timeout_at, self.end_at = timeout_at, end_at


class _Relay(Plain):
    """A PING_REQ this node carries out for another."""

    requester: str
    their_seq: int
    deadline: float

    def __init__(self, requester: str, their_seq: int, deadline: float) -> None:
        self.requester, self.their_seq, self.deadline = requester, their_seq, deadline


class Prober:
    """Probes one member per period; hands a member that fails to `suspect`."""

    def __init__(
        self,
        members: dict[bytes, Member],
        *,
        config: MembershipConfig,
        rng: Random,
        send: Send,
        suspect: SuspectCallback,
        stats: Counter[str],
    ) -> None:
        self._members = members  # the membership's table, shared
        self._config = config
        self._rng = rng
        self._send = send
        self._suspect = suspect
        self._stats = stats
        self.awareness = Awareness(config.awareness_limit)
        self._ring: list[bytes] = []  # the probe pass: ring[:_ring_at] done this pass
        self._ring_at = 0
        self._urgent: list[bytes] = []
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._seq = 0
        self.next_probe = 0.0
        self.rtt: dict[bytes, float] = {}  # member -> round trip of its last direct probe

    # ----------------------------------------------------------------- the ring

    def add(self, node_id: bytes) -> None:
        """A member became live: it joins the current pass."""
        self._ring.append(node_id)

    def sample(
        self, count: int, *, exclude: bytes, dead_since: float | None = None
    ) -> list[Member]:
        """Up to `count` random live members (and, with `dead_since`, members dead since then).

        Drawn from the ring, which lists every member live during this pass: O(count), whatever
        the size of the mesh.
        """
        ring, members = self._ring, self._members
        picked: list[Member] = []
        if not ring:
            return picked
        for _ in range(4 * count):
            member = members.get(ring[self._rng.randrange(len(ring))])
            if member is None or member.record.node_id == exclude or member in picked:
                continue
            if member.state <= _SUSPECT_STATE or (
                dead_since is not None and member.state is _DEAD_STATE and member.since > dead_since
            ):
                picked.append(member)
                if len(picked) >= count:
                    break
        return picked

    def probe_soon(self, node_id: bytes, now: float) -> None:
        if node_id in self._urgent:
            return
        self._urgent.append(node_id)
        if self._probe is None:
            self.next_probe = min(self.next_probe, now)

    # ----------------------------------------------------------------- time

    def tick(self, now: float) -> None:
        probe = self._probe
        if probe is not None:
            # Late by more than a probe timeout: this node's own loop stalled, and the driver
            # has just read what arrived meanwhile. A probe it could not run on time proves
            # nothing about the target: give the indirect probes their time, or let it go.
            slack = self._config.probe_timeout
            if not probe.acked and not probe.indirect and now >= probe.timeout_at:
                if now - probe.timeout_at > slack:
                    probe.end_at = max(probe.end_at, now + probe.end_at - probe.timeout_at)
                    self._stats["probes_late"] += 1
                self._probe_indirectly(probe)
            elif now >= probe.end_at and now - probe.end_at > slack and not probe.acked:
                self._probe = None
                self._stats["probes_late"] += 1
            if self._probe is not None and now >= probe.end_at:
                self._finish(probe, now)
        if self._probe is None and now >= self.next_probe:
            self._start(now)
        if self._relays:
            for seq, relay in list(self._relays.items()):
                if now >= relay.deadline:
                    del self._relays[seq]
                    self._send(relay.requester, [[_NACK, relay.their_seq]])

    def next_deadline(self) -> float:
        probe = self._probe
        if probe is None:
            due = self.next_probe
        else:  # the next probe waits for this one to end
            due = probe.end_at if probe.indirect or probe.acked else probe.timeout_at
        for relay in self._relays.values():
            due = min(due, relay.deadline)
        return due

    # ----------------------------------------------------------------- messages in

    def on_ack(self, seq: int, sender: bytes, now: float) -> None:
        probe = self._probe
        if probe is not None and probe.seq == seq:
            if not probe.acked:
                probe.acked = True
                self.awareness.apply(-1)
                if sender == probe.target:  # direct, not relayed: a round trip to it
                    self.rtt[sender] = now - probe.sent_at
            return
        relay = self._relays.pop(seq, None)
        if relay is not None:
            self._send(relay.requester, [[_ACK, relay.their_seq]])

    def on_nack(self, seq: int) -> None:
        probe = self._probe
        if probe is not None and probe.seq == seq:
            probe.nacks += 1

    def on_ping_req(
        self, requester: str, their_seq: int, target: bytes, address: str, now: float
    ) -> None:
        if len(self._relays) >= _MAX_RELAYS:
            self._stats["dropped_relay_overflow"] += 1
            return
        seq = self._next_seq()
        self._relays[seq] = _Relay(requester, their_seq, now + self._config.probe_timeout)
        self._send(address, [[_PING, seq, target]])

    # ----------------------------------------------------------------- probing

    def _start(self, now: float) -> None:
        cfg = self._config
        self.next_probe = now + self.awareness.scale(cfg.probe_interval)
        target = self._next_target()
        if target is None:
            return
        seq = self._next_seq()
        timeout_at = now + self.awareness.scale(cfg.probe_timeout)
        self._probe = _Probe(target.record.node_id, seq, now, timeout_at, self.next_probe)
        self._stats["probes"] += 1
        self._send(target.record.address, [[_PING, seq, target.record.node_id]])

    def _next_target(self) -> Member | None:
        members = self._members
        while self._urgent:
            member = members.get(self._urgent.pop(0))
            if member is not None and member.state <= _SUSPECT_STATE:
                return member
        ring, rng = self._ring, self._rng
        for _ in range(2):
            while self._ring_at < len(ring):
                at = self._ring_at
                pick = rng.randrange(at, len(ring))
                ring[at], ring[pick] = ring[pick], ring[at]
                self._ring_at = at + 1
                member = members.get(ring[at])
                if member is not None and member.state <= _SUSPECT_STATE:
                    return member
            # A pass is over: the next one covers the members live now.
            ring = [m.record.node_id for m in members.values() if m.state <= _SUSPECT_STATE]
            self._ring, self._ring_at = ring, 0
        return None

    def _probe_indirectly(self, probe: _Probe) -> None:
        probe.indirect = True
        target = self._members.get(probe.target)
        if target is None:
            return
        helpers = self.sample(self._config.indirect_probes, exclude=probe.target)
        for helper in helpers:
            request = [_PING_REQ, probe.seq, probe.target, target.record.address]
            self._send(helper.record.address, [request])
        probe.expected_nacks = len(helpers)
        self._stats["indirect_probes"] += len(helpers)

    def _finish(self, probe: _Probe, now: float) -> None:
        self._probe = None
        if probe.acked:
            return
        if probe.expected_nacks:
            self.awareness.apply(max(0, probe.expected_nacks - probe.nacks))
        else:
            self.awareness.apply(1)
        self._stats["probes_failed"] += 1
        member = self._members.get(probe.target)
        if member is not None and member.state <= _SUSPECT_STATE:
            self._suspect(member, now)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
