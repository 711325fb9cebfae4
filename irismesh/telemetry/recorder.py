"""What a node records about itself: exact counters and histograms, sampled records.

Recording sits on the message hot path, so it costs a dict update or two per message:

- `counts`: exact event counts per (kind, cluster, outcome), never sampled;
- `histograms`: exact latency histograms per (kind, cluster) in power-of-two microsecond
  buckets (bucket b holds latencies in [2**(b-1), 2**b) us), never sampled;
- per-message records, one in `sample_every` (weight = sample_every, so Spark's counts stay
  estimates of the true totals), handed to a `SpoolWriter` whose bounded buffer drops and
  counts records when full: recording never blocks messaging. An `exporter` (any `RecordSink`,
  in practice `irismesh.telemetry.export.TopicExporter`) gets the very same records, so that
  they can also be published to the mesh; either sink alone turns record-making on.

Membership changes and gauges are rare and always recorded. The node flushes the writer to
disk off the event loop (see `Node`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from irismesh.telemetry.schema import Kind, MembershipEvent, Outcome, Pattern
from irismesh.telemetry.spool import SpoolWriter

if TYPE_CHECKING:
    from irismesh._core.events import RequestArrived

_REQUEST, _SERVE = str(Kind.REQUEST), str(Kind.SERVE)
_REQREP = str(Pattern.REQREP)
_DROP = str(Kind.DROP)
_OK, _REMOTE_ERROR = str(Outcome.OK), str(Outcome.REMOTE_ERROR)
_PATTERNS = {
    str(Kind.BROADCAST): str(Pattern.BROADCAST),
    str(Kind.SURVEY): str(Pattern.SURVEY),
    str(Kind.PUBLISH): str(Pattern.PUBSUB),
    str(Kind.DELIVER): str(Pattern.PUBSUB),
    str(Kind.TUNNEL): str(Pattern.TUNNEL),
}
HISTOGRAM_BUCKETS = 40  # 2**39 us is about six days


class RecordSink(Protocol):
    """Where sampled records go: `append` buffers one record (a tuple in FIELDS order) and
    returns False, having counted it, when it had to drop it. It must never block."""

    def append(self, record: Sequence[Any]) -> bool: ...


class _Series:
    """Exact counts by outcome and the latency histogram of one (kind, cluster).

    Every event of a timed series lands in its histogram, so `counts` keeps only the outcomes
    other than ok (one dict update saved per event on the hot path): ok is what the histogram
    holds beyond them. Drops are counted, not timed (`timed` False: `counts` holds them all).
    """

    __slots__ = ("counts", "histogram", "since", "timed")

    def __init__(self, timed: bool = True) -> None:
        self.counts: dict[str, int] = {}
        self.histogram = [0] * HISTOGRAM_BUCKETS
        self.since = 0  # events since the last sampled record
        self.timed = timed

    def outcomes(self) -> dict[str, int]:
        """Exact counts by outcome, ok included (outcomes that never happened left out)."""
        counts = {outcome: n for outcome, n in self.counts.items() if n}
        if not self.timed:
            return counts
        ok = sum(self.histogram) - sum(counts.values())
        return {_OK: ok, **counts} if ok else counts


class Recorder:
    """One node's telemetry; `writer` and `exporter` None keep counters and histograms only."""

    __slots__ = (
        "_clock",
        "_every",
        "_exporter",
        "_sampling",
        "_series",
        "_serving",
        "_writer",
        "node",
    )

    def __init__(
        self,
        node: str,
        writer: SpoolWriter | None = None,
        *,
        sample_every: int = 10,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if sample_every < 1:
            raise ValueError("sample_every must be at least 1")
        self.node = node
        self._writer = writer
        self._exporter: RecordSink | None = None  # a second sink for the same records
        self._sampling = writer is not None  # whether records are made at all
        # One lookup per event on the hot path: (kind, cluster) -> its series, and for the
        # member side (`served`), cluster -> its SERVE series.
        self._series: dict[tuple[str, str], _Series] = {}
        self._serving: dict[str, _Series] = {}
        self._every = sample_every
        self._clock = clock

    @property
    def writer(self) -> SpoolWriter | None:
        return self._writer

    @writer.setter
    def writer(self, writer: SpoolWriter | None) -> None:
        self._writer = writer
        self._sampling = writer is not None or self._exporter is not None

    @property
    def exporter(self) -> RecordSink | None:
        return self._exporter

    @exporter.setter
    def exporter(self, exporter: RecordSink | None) -> None:
        self._exporter = exporter
        self._sampling = self._writer is not None or exporter is not None

    def set_sampling(self, sample_every: int) -> None:
        if sample_every < 1:
            raise ValueError("sample_every must be at least 1")
        self._every = sample_every

    def request(
        self,
        cluster: str,
        peer: bytes | None,
        latency: float,
        size: int,
        outcome: str,
        kind: str = _REQUEST,
    ) -> None:
        """Caller side: one request (or broadcast, survey) ended `latency` s after it was sent.

        The hot path of recording (the member's `serve` comes here too): a dict lookup, two
        increments and, one time in `sample_every`, a record.
        """
        series = self._series.get((kind, cluster))
        if series is None:
            series = self._new_series(kind, cluster)
        if outcome != _OK:  # ok is what the histogram holds beyond the others (see _Series)
            counts = series.counts
            counts[outcome] = counts.get(outcome, 0) + 1
        us = int(latency * 1e6)
        bucket = us.bit_length()
        series.histogram[bucket if bucket < HISTOGRAM_BUCKETS else HISTOGRAM_BUCKETS - 1] += 1
        if self._sampling:
            since = series.since = series.since + 1  # one record in `sample_every` per series
            if since >= self._every:
                series.since = 0
                self._sample(kind, cluster, peer, us, size, outcome)

    def _sample(
        self,
        kind: str,
        cluster: str,
        peer: bytes | None,
        us: int,
        size: int,
        outcome: str,
        weight: int = 0,
    ) -> None:
        """One record standing for `weight` events (0: one in `sample_every`)."""
        record = (
            self._clock(),
            self.node,
            kind,
            _PATTERNS.get(kind, _REQREP),
            cluster,
            peer.hex() if peer else None,
            us,
            size,
            outcome,
            weight or self._every,
            None,
            None,
        )
        if self._writer is not None:
            self._writer.append(record)
        if self._exporter is not None:
            self._exporter.append(record)

    def served(self, event: RequestArrived, latency: float, size: int, ok: bool) -> None:
        """Member side, as the handler runner reports it (its `served` callback).

        `request(..., kind=SERVE)` inlined, with its series found by cluster alone: the
        member's hot path.
        """
        cluster = event.cluster
        series = self._serving.get(cluster)
        if series is None:
            series = self._serving[cluster] = self._new_series(_SERVE, cluster)
        if not ok:
            counts = series.counts
            counts[_REMOTE_ERROR] = counts.get(_REMOTE_ERROR, 0) + 1
        us = int(latency * 1e6)
        bucket = us.bit_length()
        series.histogram[bucket if bucket < HISTOGRAM_BUCKETS else HISTOGRAM_BUCKETS - 1] += 1
        if self._sampling:
            since = series.since = series.since + 1
            if since >= self._every:
                series.since = 0
                outcome = _OK if ok else _REMOTE_ERROR
                self._sample(_SERVE, cluster, event.token[0], us, size, outcome)

    def serve(self, cluster: str, peer: bytes, latency: float, size: int, outcome: str) -> None:
        """Member side: one handler run ended (`latency` seconds of service time)."""
        self.request(cluster, peer, latency, size, outcome, _SERVE)

    def tally(
        self, kind: str, cluster: str, peer: bytes | None, size: int, outcome: str, count: int
    ) -> None:
        """`count` events of no latency at once (publishes, deliveries), `size` bytes in all.

        Exact counts as ever; one record of weight `count` stands for them all, with their mean
        size, so Spark's weighted counts stay exact.
        """
        series = self._series.get((kind, cluster))
        if series is None:
            series = self._new_series(kind, cluster)
        if outcome != _OK:
            counts = series.counts
            counts[outcome] = counts.get(outcome, 0) + count
        series.histogram[0] += count
        if count and self._sampling:
            self._sample(kind, cluster, peer, 0, size // count, outcome, weight=count)

    def membership(self, event: MembershipEvent, peer: bytes) -> None:
        self._event(str(Kind.MEMBERSHIP), "", None, peer.hex(), str(event), None)

    def drop(self, reason: str, count: int = 1) -> None:
        counts = (self._series.get((_DROP, "")) or self._new_series(_DROP, "", timed=False)).counts
        counts[reason] = counts.get(reason, 0) + count
        self._event(str(Kind.DROP), "", None, None, reason, None, weight=count)

    def gauges(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._event(str(Kind.GAUGE), "", None, None, name, float(value))

    def _event(
        self,
        kind: str,
        pattern: str,
        cluster: str | None,
        peer: str | None,
        name: str | None,
        value: float | None,
        weight: int = 1,
    ) -> None:
        writer, exporter = self._writer, self._exporter
        if writer is not None or exporter is not None:
            head = (self._clock(), self.node, kind, pattern, cluster, peer)
            record = (*head, None, None, str(Outcome.NONE), weight, name, value)
            if writer is not None:
                writer.append(record)
            if exporter is not None:
                exporter.append(record)

    def _new_series(self, kind: str, cluster: str, *, timed: bool = True) -> _Series:
        series = self._series.get((kind, cluster))
        if series is None:
            series = self._series[(kind, cluster)] = _Series(timed)
        return series

    @property
    def counts(self) -> dict[tuple[str, str, str], int]:
        """Exact counts by (kind, cluster, outcome)."""
        return {
            (kind, cluster, outcome): n
            for (kind, cluster), series in self._series.items()
            for outcome, n in series.outcomes().items()
        }

    @property
    def histograms(self) -> dict[tuple[str, str], list[int]]:
        """Latency histograms by (kind, cluster), power-of-two microsecond buckets."""
        return {key: series.histogram for key, series in self._series.items() if key[0] != _DROP}

    def total(self, kind: str, cluster: str | None = None, outcome: str | None = None) -> int:
        """Exact count of events of `kind`, optionally of one cluster and outcome."""
        return sum(
            n
            for (k, c, o), n in self.counts.items()
            if k == kind and (cluster is None or c == cluster) and (outcome is None or o == outcome)
        )

    def percentile(self, kind: str, cluster: str, q: float) -> float | None:
        """Quantile `q` in us, interpolated within its power-of-two bucket; None without data."""
        histogram = self.histograms.get((kind, cluster))
        if not histogram or not (total := sum(histogram)):
            return None
        rank = q * total
        seen = 0
        for bucket, n in enumerate(histogram):
            if n and seen + n >= rank:
                low = float(1 << (bucket - 1)) if bucket else 0.0
                return low + (float(1 << bucket) - low) * (rank - seen) / n
            seen += n
        return float(2 ** (HISTOGRAM_BUCKETS - 1))
