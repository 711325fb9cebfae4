"""Liveness: heartbeats, suspicion, indirect probes, and the peer lists nodes gossip.

Theory of operation
-------------------
Heartbeats. The dialler pings every `heartbeat_interval` (PING carries the caller's reply
acknowledgements too), the listener answers PONG with its load (the replies it still holds);
the round trip is the link's `rtt`. Any frame counts as a sign of life (the engine notes
`last_heard`).

Suspicion. A dialled link silent for `suspect_after` is *suspect* (PeerSuspect): this node asks
`indirect_probes` other peers whether they hear it (PROBE), SWIM's indirect probe over the
links the peers already watch, and each answers how long ago it last heard the suspect
(PROBE_ACK). A fresh word that it was heard lately *vouches* for it: it stays alive past
`dead_after` (our own link may be lossy, as TCP retransmits), for at most
`max_vouched_silence`, while its requests in flight move to other members (`migrate`). Without
such word the suspect is dead at `dead_after` ("silent"), and a vouched one that stays silent
too long is "unreachable"; either way `watch` tells the engine to close the link. Any frame
from a suspect refutes the suspicion (`heard`).

A link a peer dialled to us that stays silent for three times `dead_after` is forgotten.

Loop stalls. If this node's own loop stalls (its tick arrives late), the stall is not held
against the peers: every link's `last_heard` moves forward by the stall.

Peer lists. A node sends its peer list on every new link, both ways, and every
`gossip_interval` (jittered) to one random peer; a node dials every peer it learns of.

This module is the whole failure detector; the engine calls it from `tick` and frame dispatch,
and acts on what it decides (closing and forgetting links).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from random import Random
from typing import Any

from irismesh._core.config import CoreConfig
from irismesh._core.events import PeerSuspect
from irismesh._core.frames import MAX_PEERS_PER_FRAME, Kind
from irismesh._core.links import InLink, LinkObserver, OutLink
from irismesh._core.outbox import Outbox

_PING, _PONG = int(Kind.PING), int(Kind.PONG)
_PROBE, _PROBE_ACK = int(Kind.PROBE), int(Kind.PROBE_ACK)
_PEERS = int(Kind.PEERS)


class Liveness(LinkObserver):
    """Heartbeats, suspicion and gossip over the engine's link table (read only here)."""

    def __init__(
        self,
        *,
        node_id: bytes,
        config: CoreConfig,
        rng: Random,
        stats: Counter[str],
        outbox: Outbox,
        out: dict[int, OutLink],
        inbound: dict[bytes, InLink],
        peers: dict[bytes, OutLink],
        in_by_peer: dict[bytes, InLink],
        add_candidate: Callable[[str, float], None],
        migrate: Callable[[OutLink, float], None],
    ) -> None:
        self.config = config
        self._node_id = node_id
        self._rng = rng
        self._stats = stats
        self._outbox = outbox
        # The engine's tables: dialled links, links peers dialled, UP links and inbound
        # links by node id.
        self._out = out
        self._in = inbound
        self._peers = peers
        self._in_by_peer = in_by_peer
        self._add_candidate = add_candidate
        self._migrate = migrate  # Calls.migrate: requests off a vouched-for, silent link
        self._last_tick: float | None = None
        self._next_gossip = 0.0

    # ----------------------------------------------------------------- the engine's tick

    def tick_started(self, now: float) -> None:
        """A tick begins: if it came late (our loop stalled), the stall is not the peers'."""
        cfg = self.config
        if self._last_tick is not None:
            stall = now - self._last_tick - cfg.heartbeat_interval
            if stall > cfg.heartbeat_interval:
                self._stats["loop_stalls"] += 1
                for link in self._out.values():
                    link.last_heard += stall
                for inlink in self._in.values():
                    inlink.last_heard += stall
        self._last_tick = now

    def watch(self, link: OutLink, now: float) -> str | None:
        """One UP dialled link at a tick: suspect it, probe, ping; the reason it is dead, if."""
        cfg = self.config
        silence = now - link.last_heard
        if silence > cfg.suspect_after:
            dead = self._suspect(link, silence, now)
            if dead is not None:
                return dead
        if now - link.last_ping >= cfg.heartbeat_interval - 1e-6:  # float ticks
            link.last_ping = now
            acks, link.acks = link.acks[:200], link.acks[200:]
            self._outbox.send_out(link, _PING, [int(now * 1e6), acks])
            if link.outstanding == 0 and now - link.last_sample > 1.0:
                link.latency *= 0.5  # let an idle member that was slow be probed again
                link.last_sample = now
        return None

    def inbound_dead(self, link: InLink, now: float) -> bool:
        """Whether a link a peer dialled has been silent long enough to forget."""
        return now - link.last_heard > 3 * self.config.dead_after

    def gossip(self, now: float) -> None:
        """Every gossip_interval or so, the peer list to one random peer."""
        if now >= self._next_gossip and self._peers:
            self._next_gossip = now + self.config.gossip_interval * (0.5 + self._rng.random())
            target = self._rng.choice(list(self._peers.values()))
            self._outbox.send_out(target, _PEERS, self._peer_list())

    def _suspect(self, link: OutLink, silence: float, now: float) -> str | None:
        """A silent peer: ask others whether they hear it; why it is dead, if it now is."""
        cfg = self.config
        if not link.suspect:
            link.suspect = True
            self._stats["peers_suspected"] += 1
            self._outbox.events.append(PeerSuspect(node_id=link.peer_id, suspect=True))
            self._probe(link, now)
        elif now - link.probed_at >= cfg.heartbeat_interval - 1e-6:
            self._probe(link, now)
        if silence <= cfg.dead_after:
            return None
        vouched = now - link.vouched_at <= cfg.dead_after - cfg.suspect_after
        if vouched and silence <= cfg.max_vouched_silence:
            if link.outstanding:
                self._migrate(link, now)
            return None
        return "unreachable" if vouched else "silent"

    def _probe(self, link: OutLink, now: float) -> None:
        helpers = [p for p in self._peers.values() if p is not link and not p.suspect]
        link.probed_at = now
        if not helpers:
            return
        link.probe_token += 1
        count = min(self.config.indirect_probes, len(helpers))
        for helper in self._rng.sample(helpers, count):
            self._outbox.send_out(helper, _PROBE, [link.peer_id, link.probe_token])
        self._stats["probes_sent"] += count

    # ----------------------------------------------------------------- frames in

    def heard(self, link: OutLink) -> None:
        """A frame from a suspect: the suspicion is refuted."""
        link.suspect = False
        self._stats["suspicions_refuted"] += 1
        self._outbox.events.append(PeerSuspect(node_id=link.peer_id, suspect=False))

    def on_ping(self, link: InLink, stamp: int, load: int) -> None:
        """PING from a caller: PONG with its time stamp and this member's load."""
        self._outbox.send_in(link, _PONG, [stamp, load])

    def on_pong(self, link: OutLink, env: list[Any], now: float) -> None:
        link.rtt = max(0.0, now - env[0] / 1e6)
        link.peer_load = env[1]

    def on_probe(self, link: InLink, env: list[Any], now: float) -> None:
        """Does this node hear `target`? How long ago, in ms (-1: not at all)."""
        target, token = env
        heard = -1.0
        out = self._peers.get(target)
        if out is not None and not out.suspect:
            heard = now - out.last_heard
        inlink = self._in_by_peer.get(target)
        if inlink is not None and (heard < 0 or now - inlink.last_heard < heard):
            heard = now - inlink.last_heard
        self._outbox.send_in(
            link, _PROBE_ACK, [target, token, int(heard * 1000) if heard >= 0 else -1]
        )

    def on_probe_ack(self, env: list[Any], now: float) -> None:
        target, token, heard_ms = env
        link = self._peers.get(target)
        if (
            link is not None
            and link.suspect
            and link.probe_token - 3 < token <= link.probe_token
            # Fresh word only: heard within a heartbeat and a half (a healthy peer hears the
            # suspect every heartbeat), and after we last did ourselves.
            and 0 <= heard_ms <= 1500 * self.config.heartbeat_interval
            and now - heard_ms / 1000 > link.last_heard
        ):
            link.vouched_at = now
            self._stats["probes_vouched"] += 1

    def on_peers(self, env: list[Any], now: float) -> None:
        """A peer list: dial the peers this node has no link to."""
        for entry in env:
            peer_id, endpoint = entry
            if peer_id != self._node_id and peer_id not in self._peers:
                self._add_candidate(endpoint, now)

    # ----------------------------------------------------------------- new links

    def link_up(self, link: OutLink, now: float) -> None:
        link.last_ping = now
        self._outbox.send_out(link, _PEERS, self._peer_list())

    def inbound_up(self, link: InLink, now: float) -> None:
        self._outbox.send_in(link, _PEERS, self._peer_list())

    def _peer_list(self) -> list[list[Any]]:
        peers = [[p.peer_id, p.endpoint] for p in self._peers.values()]
        if len(peers) > MAX_PEERS_PER_FRAME:
            peers = self._rng.sample(peers, MAX_PEERS_PER_FRAME)
        return peers
