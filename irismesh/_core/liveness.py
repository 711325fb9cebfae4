"""A link's own liveness: heartbeats while it carries requests, and what silence means then.

Theory of operation
-------------------
Whether a node is alive is membership's question (`membership`: SWIM, over datagrams); a link
only needs to know whether the requests in flight on it will be answered. So only a *busy* link
(requests in flight, or replies to acknowledge) is watched: the dialler pings it every
`heartbeat_interval` (PING carries the acknowledgements, PONG the member's load; the round trip
is the link's `rtt`), and any frame counts as a sign of life. An idle link sends nothing and
costs nothing (beyond one ping as it opens, for its round trip), so a node's cost does not
grow with the number of peers it could talk to.

A busy link silent for `dead_after` is *suspect*: the balancer avoids it, its requests move to
other members (`migrate`: alive is not the same as useful, TCP may be in retransmission
backoff), and membership is asked to probe the peer at once (`probe_soon`), whose verdict
closes the link if the peer is dead. A link silent for `max_silence` is closed ("silent") and
redialled on demand. Any frame ends the suspicion. A suspect link stays watched (pinged) until
it is heard from, though its requests moved away: otherwise, idle, it would never be asked
again and the balancer would avoid a member that is fine until the link closed as idle. A link
that turns busy starts its watch then, so an idle stretch never counts as silence.

Loop stalls: if this node's own loop stalls (its tick arrives late), the stall is not held
against the peers: every busy link's `last_heard` moves forward by it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from irismesh._core.config import CoreConfig
from irismesh._core.frames import Kind
from irismesh._core.links import InLink, LinkObserver, OutLink
from irismesh._core.outbox import Outbox

_PING, _PONG = int(Kind.PING), int(Kind.PONG)
_HOUSEKEEPING = 1.0  # an idle node still looks at its links this often


class LinkWatch(LinkObserver):
    """Heartbeats and silence of busy dialled links (the engine's table, read only here)."""

    def __init__(
        self,
        *,
        config: CoreConfig,
        stats: Counter[str],
        outbox: Outbox,
        out: dict[int, OutLink],
        migrate: Callable[[OutLink, float], None],
        probe_soon: Callable[[bytes, float], None],
    ) -> None:
        self.config = config
        self._stats = stats
        self._outbox = outbox
        self._out = out
        self._migrate = migrate  # Calls.migrate: requests off a silent link
        self._probe_soon = probe_soon  # membership: is its peer alive?

    def tick_started(self, now: float, late: float) -> None:
        """A tick begins, `late` after it was due: a stall of our own loop, not the peers'."""
        if late > self.config.heartbeat_interval:
            self._stats["loop_stalls"] += 1
            for link in self._out.values():
                if link.busy:
                    link.last_heard += late

    def watch(self, link: OutLink, now: float) -> str | None:
        """One UP dialled link at a tick: ping it if busy; why to close it, if it must close."""
        if not link.outstanding and not link.acks and not link.suspect:
            link.busy = False
            return None
        cfg = self.config
        if not link.busy:  # turning busy: silence counts from now
            link.busy = True
            link.last_heard = max(link.last_heard, now)
            link.last_ping = now - cfg.heartbeat_interval
        silence = now - link.last_heard
        if silence > cfg.max_silence:
            return "silent"
        if silence > cfg.dead_after:
            if not link.suspect:
                link.suspect = True
                self._stats["links_silent"] += 1
                self._probe_soon(link.peer_id, now)
            if link.outstanding:
                self._migrate(link, now)
        if now - link.last_ping >= cfg.heartbeat_interval - 1e-6:  # float ticks
            link.last_ping = now
            acks, link.acks = link.acks[:200], link.acks[200:]
            self._outbox.send_out(link, _PING, [int(now * 1e6), acks])
        return None

    def next_deadline(self, now: float) -> float:
        """When the next tick is due: the next ping of a busy link, else housekeeping."""
        due = now + _HOUSEKEEPING
        interval = self.config.heartbeat_interval
        for link in self._out.values():
            if link.busy or link.outstanding or link.acks:
                due = min(due, link.last_ping + interval)
        return due

    # ----------------------------------------------------------------- frames in

    def on_ping(self, link: InLink, stamp: int, load: int) -> None:
        """PING from a caller: PONG with its time stamp and this member's load."""
        self._outbox.send_in(link, _PONG, [stamp, load])

    def on_pong(self, link: OutLink, env: list[Any], now: float) -> None:
        link.rtt = max(0.0, now - env[0] / 1e6)
        link.peer_load = env[1]

    def link_up(self, link: OutLink, now: float) -> None:
        """One ping as the link opens: its round trip is known before it is ever busy."""
        link.last_ping = now
        self._outbox.send_out(link, _PING, [int(now * 1e6), []])
