"""What a node records about itself: exact counters and histograms, sampled records.

Recording sits on the message hot path, so it costs a few list and attribute updates per
message (see `Series` for the inlined form the hot paths use):

- `counts`: exact event counts per (kind, cluster, outcome), never sampled;
- `histograms`: exact latency histograms per (kind, cluster) in power-of-two microsecond
  buckets (bucket b holds latencies in [2**(b-1), 2**b) us), never sampled;
- per-message records, one in `sample_every` (weight = sample_every, so Spark's counts stay
  estimates of the true totals), handed to a `SpoolWriter` whose bounded buffer drops and
  counts records when full: recording never blocks messaging. An `exporter` (any `RecordSink`,
  in practice `irismesh.telemetry.export.TopicExporter`) gets the very same records, so that
  they can also be published to the mesh; either sink alone turns record-making on.

Membership changes and gauges are rare and always recorded; they carry the node's `name` (and
a membership record its peer's), which per-message records leave out to stay short. The node
flushes the writer to disk off the event loop (see `Node`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from irismesh.telemetry.schema import Kind, MembershipEvent, Outcome, Pattern

if TYPE_CHECKING:
    from irismesh.telemetry.spool import SpoolWriter

_REQUEST, _SERVE = str(Kind.REQUEST), str(Kind.SERVE)
_REQREP = str(Pattern.REQREP)
_DROP = str(Kind.DROP)
_OK = str(Outcome.OK)
_PATTERNS = {
    str(Kind.BROADCAST): str(Pattern.BROADCAST),
    str(Kind.SURVEY): str(Pattern.SURVEY),
    str(Kind.PUBLISH): str(Pattern.PUBSUB),
    str(Kind.DELIVER): str(Pattern.PUBSUB),
    str(Kind.TUNNEL): str(Pattern.TUNNEL),
}
HISTOGRAM_BUCKETS = 40  # 2**39 us is about six days
_SLOTS = 66  # a histogram's slots: one for each bit length of an int below 2**65
_ns = time.perf_counter_ns


class RecordSink(Protocol):
    """Where sampled records go: `append` buffers one record (a tuple in FIELDS order) and
    returns False, having counted it, when it had to drop it. It must never block."""

    def append(self, record: Sequence[Any]) -> bool: ...


class Series:
    """Exact counts by outcome and the latency histogram of one (kind, cluster); the hot path's
    handle on them, held by the caller (`Recorder.series`, `.requests`, `.serving`).

    An event is timed (it lands in `histogram`) or not (it adds to `untimed`); `counts` keeps
    only the outcomes other than ok, timed or not, and ok is the rest (one dict update saved per
    event on the hot path): an untimed handler run counts as ok from its start until it
    fails, if it does. Drops are counted, never timed (`timed` False).

    `histogram` has a slot for every bit length an int of up to 64 bits can have, so that
    `histogram[us.bit_length()] += 1` needs no bound check; reading folds the slots past
    HISTOGRAM_BUCKETS into the last bucket. `countdown` counts the events left until the next
    sampled one (every `sample_every`-th), which makes a record if the recorder has a sink.

    The caller's side times every event: a reply's round trip costs no clock read (the node
    reads its loop's clock once per batch of events). Its hot path, `Node._on_events`, inlines
    `observe` for ok:

        us = int(seconds * 1e6)
        series.histogram[us.bit_length()] += 1
        n = series.countdown - 1
        if n:
            series.countdown = n
        else:
            series.sample(peer, us, size, "ok")

    The member's side (`HandlerRunner`) times only the sampled handler runs (`start`, then
    `finish`) and counts the others as they start (`untimed`): timing every run takes two
    clock reads per request, which cost about 3% of request/reply throughput on the machine
    `bench/telemetry_cost.py` measured. So a SERVE histogram is a uniform one-in-`sample_every`
    sample of service times, while its counts stay exact.
    """

    __slots__ = (
        "cluster",
        "countdown",
        "counts",
        "histogram",
        "kind",
        "pattern",
        "recorder",
        "untimed",
    )

    def __init__(self, recorder: Recorder, kind: str, cluster: str) -> None:
        self.recorder = recorder
        self.kind = kind
        self.cluster = cluster
        self.pattern = _PATTERNS.get(kind, _REQREP)
        self.counts: dict[str, int] = {}
        self.histogram = [0] * _SLOTS
        self.untimed = 0  # events counted but not timed
        self.countdown = recorder._every

    @property
    def timed(self) -> bool:
        return self.kind != _DROP

    def observe(self, peer: bytes | None, us: int, size: int, outcome: str) -> None:
        """One event that took `us` microseconds and carried `size` bytes."""
        self._add(us, outcome)
        n = self.countdown - 1
        if n:
            self.countdown = n
        else:
            self.sample(peer, us, size, outcome)

    def sample(self, peer: bytes | None, us: int, size: int, outcome: str) -> None:
        """The countdown ran out: one record standing for `sample_every` events."""
        recorder = self.recorder
        self.countdown = recorder._every
        if recorder._sampling:
            recorder._sample(self, peer, us, size, outcome, recorder._every)

    def start(self) -> int:
        """Member side: the countdown ran out, so this handler run is timed; its start (ns).
        (A run that is not timed adds to `untimed` as it starts.)"""
        self.countdown = self.recorder._every
        return _ns()

    def finish(self, peer: bytes | None, started: int, size: int, outcome: str) -> None:
        """Member side: a timed handler run ended (`started` from `start`); or, `started` 0,
        an untimed run ended other than ok."""
        if not started:
            counts = self.counts
            counts[outcome] = counts.get(outcome, 0) + 1
            return
        us = (_ns() - started) // 1000
        self._add(us, outcome)
        recorder = self.recorder
        if recorder._sampling:
            recorder._sample(self, peer, us, size, outcome, recorder._every)

    def _add(self, us: int, outcome: str) -> None:
        if outcome != _OK:
            counts = self.counts
            counts[outcome] = counts.get(outcome, 0) + 1
        bucket = us.bit_length()
        self.histogram[bucket if bucket < _SLOTS else _SLOTS - 1] += 1

    def buckets(self) -> list[int]:
        """The histogram in HISTOGRAM_BUCKETS power-of-two microsecond buckets."""
        histogram = self.histogram
        return [*histogram[: HISTOGRAM_BUCKETS - 1], sum(histogram[HISTOGRAM_BUCKETS - 1 :])]

    def outcomes(self) -> dict[str, int]:
        """Exact counts by outcome, ok included (outcomes that never happened left out)."""
        counts = {outcome: n for outcome, n in self.counts.items() if n}
        if not self.timed:
            return counts
        ok = sum(self.histogram) + self.untimed - sum(counts.values())
        return {_OK: ok, **counts} if ok else counts


class _ByCluster(dict[str, Series]):
    """cluster -> the Series of one kind, made on first use: one dict subscript per event."""

    def __init__(self, recorder: Recorder, kind: str) -> None:
        super().__init__()
        self._recorder = recorder
        self._kind = kind

    def __missing__(self, cluster: str) -> Series:
        series = self[cluster] = self._recorder.series(self._kind, cluster)
        return series


class Recorder:
    """One node's telemetry; `writer` and `exporter` None keep counters and histograms only."""

    __slots__ = (
        "_clock",
        "_every",
        "_exporter",
        "_sampling",
        "_series",
        "_writer",
        "name",
        "node",
        "requests",
        "serving",
    )

    def __init__(
        self,
        node: str,
        writer: SpoolWriter | None = None,
        *,
        sample_every: int = 100,
        clock: Callable[[], float] = time.time,
        name: str = "",
    ) -> None:
        if sample_every < 1:
            raise ValueError("sample_every must be at least 1")
        self.node = node
        self.name = name  # the node's name for people ("": none)
        self._writer = writer
        self._exporter: RecordSink | None = None  # a second sink for the same records
        self._sampling = writer is not None  # whether records are made at all
        self._every = sample_every
        self._clock = clock
        self._series: dict[tuple[str, str], Series] = {}
        # The hot paths' lookups by cluster alone: a caller's requests, a member's service.
        self.requests = _ByCluster(self, _REQUEST)
        self.serving = _ByCluster(self, _SERVE)

    @property
    def writer(self) -> SpoolWriter | None:
        return self._writer

    @writer.setter
    def writer(self, writer: SpoolWriter | None) -> None:
        self._writer = writer
        self._sinks_changed()

    @property
    def exporter(self) -> RecordSink | None:
        return self._exporter

    @exporter.setter
    def exporter(self, exporter: RecordSink | None) -> None:
        self._exporter = exporter
        self._sinks_changed()

    @property
    def sample_every(self) -> int:
        """One event in this many is timed (member side) and makes a record."""
        return self._every

    def set_sampling(self, sample_every: int) -> None:
        if sample_every < 1:
            raise ValueError("sample_every must be at least 1")
        self._every = sample_every
        for series in self._series.values():
            series.countdown = sample_every

    def _sinks_changed(self) -> None:
        self._sampling = self._writer is not None or self._exporter is not None

    def series(self, kind: str, cluster: str) -> Series:
        """The Series of (kind, cluster), made on first use."""
        series = self._series.get((kind, cluster))
        if series is None:
            series = self._series[(kind, cluster)] = Series(self, kind, cluster)
        return series

    def request(
        self,
        cluster: str,
        peer: bytes | None,
        latency: float,
        size: int,
        outcome: str,
        kind: str = _REQUEST,
    ) -> None:
        """Caller side: one request (or broadcast, survey, tunnel) ended `latency` s after it
        was sent. (A node's replies take the inlined path of `Series`.)"""
        self.series(kind, cluster).observe(peer, int(latency * 1e6), size, outcome)

    def serve(self, cluster: str, peer: bytes, latency: float, size: int, outcome: str) -> None:
        """Member side: one handler run ended, timed (`latency` seconds of service time). (A
        node's own handler runs go through `Series.start` and `finish` instead.)"""
        self.serving[cluster].observe(peer, int(latency * 1e6), size, outcome)

    def _sample(
        self,
        series: Series,
        peer: bytes | None,
        us: int | None,
        size: int,
        outcome: str,
        weight: int,
    ) -> None:
        """One record standing for `weight` events of `series` (`us` None: not timed)."""
        record = (
            self._clock(),
            self.node,
            series.kind,
            series.pattern,
            series.cluster,
            peer.hex() if peer else None,
            us,
            size,
            outcome,
            weight,
            None,
            None,
            None,
            None,
        )
        if self._writer is not None:
            self._writer.append(record)
        if self._exporter is not None:
            self._exporter.append(record)

    def tally(
        self, kind: str, cluster: str, peer: bytes | None, size: int, outcome: str, count: int
    ) -> None:
        """`count` events that carry no latency at once (publishes, deliveries), `size` bytes
        in all.

        Exact counts as ever, untimed (a latency of 0 would drag every percentile down); one
        record of weight `count` and no latency stands for them all, with their mean size, so
        Spark's weighted counts stay exact.
        """
        series = self.series(kind, cluster)
        if outcome != _OK:
            counts = series.counts
            counts[outcome] = counts.get(outcome, 0) + count
        series.untimed += count
        if count and self._sampling:
            self._sample(series, peer, None, size // count, outcome, count)

    def timed(self, kind: str, cluster: str, peer: bytes | None, latency: float, size: int) -> None:
        """One successful event that took `latency` seconds, sampled already by its source (a
        delivery whose publisher stamped it): timed, and recorded with weight 1."""
        series = self.series(kind, cluster)
        us = max(0, int(latency * 1e6))  # clocks of two hosts can disagree
        series._add(us, _OK)
        if self._sampling:
            self._sample(series, peer, us, size, _OK, 1)

    def membership(
        self, event: MembershipEvent, peer: bytes, peer_name: str = "", cluster: str | None = None
    ) -> None:
        membership = str(Kind.MEMBERSHIP)
        self._event(membership, "", cluster, peer.hex(), str(event), None, peer_name=peer_name)

    def drop(self, reason: str, count: int = 1) -> None:
        counts = self.series(_DROP, "").counts
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
        peer_name: str = "",
    ) -> None:
        writer, exporter = self._writer, self._exporter
        if writer is not None or exporter is not None:
            head = (self._clock(), self.node, kind, pattern, cluster, peer)
            names = (self.name or None, peer_name or None)
            record = (*head, None, None, str(Outcome.NONE), weight, name, value, *names)
            if writer is not None:
                writer.append(record)
            if exporter is not None:
                exporter.append(record)

    def all_series(self) -> list[Series]:
        """Every Series so far, in the order they were made."""
        return list(self._series.values())

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
        return {key: series.buckets() for key, series in self._series.items() if series.timed}

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
