"""A node's telemetry plumbing: what `irismesh.Node` records, spools and exports.

Theory of operation
-------------------
`NodeTelemetry` owns the node's `Recorder` (exact counters and histograms) and wires it up:

- Calls. The node times its own requests through the recorder's `Series` (on the caller's hot
  path, inline in the node); a call refused before it left is recorded here (`refused`), with
  the outcome its error means (`outcome`). A handler's run is timed by the handler runner.
- Messages and tunnels. The node's publish/subscribe tallies messages and hands them over in
  bulk (`record_message`, per topic scope); a tunnel is recorded as it ends (`record_tunnel`).
- Membership. PeerUp, PeerDown and PeerSuspect events become membership records (`listen`),
  with the peer's name; every record made outside the hot path carries the node's own. So do
  this node's outlier ejections (MemberEjected, MemberReadmitted), naming the cluster.
- Gauges and drops, every `gauge_interval` and as the node closes: requests in flight,
  handlers running, peers, reply-cache entries, RSS; and the core's drop counters, as deltas.
- With a spool (`TelemetryConfig`), `start` attaches a `SpoolWriter` and an exporter
  (`export.exporter_for`), and runs the telemetry loop: gauges, a spool flush off the event
  loop, an export of the interval's records over the mesh. `close` ends the loop, exports what
  is left with the goodbyes, and closes the spool with a last round of gauges.

What the node itself provides (its clock, the gauges only it knows, its publish) is handed to
`start` as callables, so this module knows the core and nothing above it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from irismesh._core.engine import MeshCore
from irismesh._core.events import (
    Listen,
    MemberEjected,
    MemberReadmitted,
    PeerDown,
    PeerSuspect,
    PeerUp,
)
from irismesh.errors import Closed, NoResponders, Overloaded, PayloadTooLarge, RequestTimeout
from irismesh.telemetry.recorder import Recorder
from irismesh.telemetry.schema import Kind, MembershipEvent, Outcome

if TYPE_CHECKING:
    from irismesh.patterns.tunnel import Tunnel
    from irismesh.telemetry.export import Publish, TopicExporter

OK, REMOTE_ERROR, DROPPED = str(Outcome.OK), str(Outcome.REMOTE_ERROR), str(Outcome.DROPPED)
REQUEST_KIND, BROADCAST_KIND = str(Kind.REQUEST), str(Kind.BROADCAST)
SURVEY_KIND, TUNNEL_KIND = str(Kind.SURVEY), str(Kind.TUNNEL)
DELIVER_KIND = str(Kind.DELIVER)


@dataclass(frozen=True, slots=True, kw_only=True)
class TelemetryConfig:
    """Where and how a node spools its telemetry records (see irismesh.telemetry)."""

    spool_dir: str | os.PathLike[str]
    # One per-message record in this many, per (kind, cluster); counters are exact whatever it
    # is. At 1 in 10 the records cost 2-3% of request/reply throughput (bench/telemetry_cost.py)
    # and a node serving 30k requests/s spools ~400 KB/s; at 1 in 100, a tenth of each.
    sample_every: int = 100
    gauge_interval: float = 2.0  # seconds between gauge records and spool flushes
    max_file_age: float = 5.0  # a spool file is completed (renamed) at least this often


def outcome(error: BaseException) -> str:
    """The telemetry outcome of a call that failed with `error`."""
    if isinstance(error, RequestTimeout):
        return str(Outcome.TIMEOUT)
    if isinstance(error, NoResponders):
        return str(Outcome.NO_RESPONDERS)
    if isinstance(error, Closed):
        return str(Outcome.CLOSED)
    if isinstance(error, PayloadTooLarge):
        return str(Outcome.TOO_LARGE)
    if isinstance(error, Overloaded):
        return str(Outcome.OVERLOADED)
    return str(Outcome.DROPPED)


class NodeTelemetry:
    """One node's recorder, spool, exporter and telemetry loop."""

    def __init__(
        self, node_id: bytes, spool: TelemetryConfig | None, max_payload: int, *, name: str = ""
    ) -> None:
        self.node_id = node_id
        self.recorder = Recorder(node_id.hex(), name=name)
        self.max_payload = max_payload  # an exported chunk is one message
        self._spool = spool
        self._core: MeshCore | None = None
        self._clock: Callable[[], float] = lambda: 0.0
        self._gauges: Callable[[], dict[str, float]] = dict
        self._flush_tally: Callable[[], None] = lambda: None
        self._task: asyncio.Task[None] | None = None
        self._exporter: TopicExporter | None = None
        self._reported_drops: dict[str, int] = {}

    # ----------------------------------------------------------------- lifecycle

    def start(
        self,
        core: MeshCore,
        *,
        clock: Callable[[], float],
        gauges: Callable[[], dict[str, float]],
        flush_tally: Callable[[], None],
        publish: Publish,
    ) -> None:
        """The node started: record against its core; with a spool, start the loop."""
        self._core = core
        self._clock = clock
        self._gauges = gauges
        self._flush_tally = flush_tally
        config = self._spool
        if config is None:
            return
        # Imported by a node with a spool only: the others leave them unloaded.
        from irismesh.telemetry.export import exporter_for
        from irismesh.telemetry.spool import SpoolWriter

        recorder = self.recorder
        recorder.writer = SpoolWriter(
            config.spool_dir, self.node_id.hex(), max_age=config.max_file_age
        )
        recorder.set_sampling(config.sample_every)
        self._exporter = exporter_for(self)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(config.gauge_interval, publish))

    async def stop(self, publish: Publish) -> None:
        """The node is closing: end the loop; the last records leave with the goodbyes."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._exporter is not None and self._core is not None:
            await self._exporter.export(publish)  # never waits: see export

    async def close(self) -> None:
        """The node has closed: a last round of gauges, and the spool completed."""
        writer = self.recorder.writer
        if writer is not None:
            self.record_gauges()
            await asyncio.get_running_loop().run_in_executor(None, writer.close)

    async def _loop(self, interval: float, publish: Publish) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            self.record_gauges()
            writer = self.recorder.writer
            if writer is not None:
                await loop.run_in_executor(None, writer.flush)
            if self._exporter is not None:
                await self._exporter.export(publish)

    # ----------------------------------------------------------------- for the exporter

    def has_subscribers(self, topic: str) -> bool:
        core = self._core
        return core is not None and bool(core.subscribers(topic))

    def can_send(self, topic: str) -> bool:
        core = self._core
        return core is not None and not core.blocked_subscribers(topic)

    # ----------------------------------------------------------------- recording

    def listen(self, on: Listen) -> None:
        """Register for the events that become membership records."""
        on(PeerSuspect, self._on_suspect)
        on(PeerUp, self._on_membership)
        on(PeerDown, self._on_membership)
        on(MemberEjected, self._on_rotation)
        on(MemberReadmitted, self._on_rotation)

    def _on_suspect(self, event: PeerSuspect) -> None:
        state = MembershipEvent.SUSPECT if event.suspect else MembershipEvent.ALIVE
        core = self._core
        member = core.membership.get(event.node_id) if core is not None else None
        self.recorder.membership(state, event.node_id, member.record.name if member else "")

    def _on_membership(self, event: PeerUp | PeerDown) -> None:
        if isinstance(event, PeerUp):
            membership = MembershipEvent.JOIN
        elif event.reason == "left":
            membership = MembershipEvent.LEAVE
        else:
            membership = MembershipEvent.DEAD
        self.recorder.membership(membership, event.node_id, event.name)

    def _on_rotation(self, event: MemberEjected | MemberReadmitted) -> None:
        """This node took a member out of a cluster's rotation, or back in: a membership
        record that names the cluster."""
        core = self._core
        member = core.membership.get(event.node_id) if core is not None else None
        name = member.record.name if member else ""
        if isinstance(event, MemberEjected):
            change = MembershipEvent.EJECTED
        else:
            change = MembershipEvent.READMITTED
        self.recorder.membership(change, event.node_id, name, event.cluster)

    def refused(self, cluster: str, size: int, error: BaseException, kind: str) -> None:
        """A call that never left: no member, closed, too large, ..."""
        self.recorder.request(cluster, None, 0.0, size, outcome(error), kind)

    def hedge_delay(self, cluster: str) -> float | None:
        """The cluster's measured p95 round trip in seconds (a power-of-two bound), if any."""
        p95 = self.recorder.percentile(REQUEST_KIND, cluster, 0.95)
        return p95 / 1e6 if p95 else None

    def record_message(
        self, kind: str, topic: str, peer: bytes | None, count: int, size: int, missed: int
    ) -> None:
        """Messages published or delivered, tallied by the node's publish/subscribe."""
        # By topic scope (the first segment): topics are unbounded, clusters of records not.
        scope = topic.partition(".")[0]
        self.recorder.tally(kind, scope, peer, size, OK, count)
        if missed:
            self.recorder.drop("messages_missed", missed)

    def record_delivery(self, topic: str, publisher: bytes, latency: float, size: int) -> None:
        """One delivered message its publisher stamped: `latency` seconds from the publisher's
        clock to this node's (across hosts, their skew is in it), by topic scope."""
        self.recorder.timed(DELIVER_KIND, topic.partition(".")[0], publisher, latency, size)

    def record_tunnel(self, tunnel: Tunnel) -> None:
        """A tunnel ended: its lifetime, the bytes both ways, and whether it ended cleanly."""
        seconds = self._clock() - tunnel.opened_at
        result = OK if tunnel.ended_cleanly else DROPPED
        size = tunnel.bytes_sent + tunnel.bytes_received
        peer = bytes.fromhex(tunnel.peer)
        self.recorder.request(tunnel.cluster, peer, seconds, size, result, TUNNEL_KIND)

    def record_gauges(self) -> None:
        """Gauges, and the core's drops since the last time, as records."""
        self._flush_tally()
        core = self._core
        if core is None:
            return
        recorder = self.recorder
        for name, count in core.stats.items():
            if name.startswith("dropped_") or name == "replies_unroutable":
                delta = count - self._reported_drops.get(name, 0)
                if delta:
                    self._reported_drops[name] = count
                    recorder.drop(name.removeprefix("dropped_"), delta)
        gauges = self._gauges()
        gauges["rss_bytes"] = rss_bytes()
        recorder.gauges(gauges)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


__all__ = ["NodeTelemetry", "TelemetryConfig", "outcome"]
