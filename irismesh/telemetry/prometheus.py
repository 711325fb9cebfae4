"""Live metrics in the Prometheus text exposition format, read from what a node already counts.

Theory of operation
-------------------
A node keeps exact counters and latency histograms whether or not anyone looks (`Recorder`,
`Node.stats`). This module adds nothing to the hot path: `NodeCollector` is a
`prometheus_client` collector that, at scrape time, walks those counters and yields metric
families. A node nobody scrapes pays nothing; a scrape costs one walk over its series and
counters, a few hundred samples.

The collector must run on the node's own event loop (`telemetry.metrics_endpoint` serves it
there): the node's dicts and counters are only ever touched from its loop, so reading them
there sees one consistent state and needs no lock or copy. Every sample carries the `node`
label (the node's name), which keeps apart the nodes of a process that share an endpoint.

Histograms. A `Series` counts latencies in power-of-two microsecond buckets: bucket b holds
the integer microseconds below 2**b. So the count of events faster than 2**b us is exact, and
the Prometheus `le` bounds are those powers of two in seconds: 32 us (2**5, everything faster
folds into it) to 16.8 s (2**24), twenty bounds covering 50 us to 10 s, each twice the last,
then +Inf. `histogram_quantile` interpolates within a bucket, so a quantile is good to within
one bucket, a factor of two. The node keeps no running sum of latencies (it would cost the hot
path an addition per event), so histograms have `_bucket` and `_count` samples and no `_sum`.

Labels stay bounded: clusters and topic scopes (a topic's first segment) are what the node's
recorder keys its series by; past `MAX_LABEL_VALUES` of one kind the rest fold into "_other".
Topics themselves never become labels.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

from irismesh._core.records import MemberState
from irismesh.telemetry.recorder import HISTOGRAM_BUCKETS, Series
from irismesh.telemetry.schema import Kind

if TYPE_CHECKING:
    from irismesh.node import Node

MAX_LABEL_VALUES = 200  # clusters or topic scopes per node before the rest fold into "_other"
OTHER = "_other"
FIRST_BOUND, LAST_BOUND = 5, 24  # le bounds: 2**5 us (32 us) to 2**24 us (16.8 s)
LE_BOUNDS = tuple(f"{(1 << b) / 1e6:.6g}" for b in range(FIRST_BOUND, LAST_BOUND + 1))

# Node.stats entries that are levels, not counts (besides the admission's, below).
GAUGES = frozenset(
    {
        "reply_cache_entries",
        "tunnels_open",
        "memory_paths",
        "memory_messages",
        "memory_payload_bytes",
        "memory_jobs_pending",
        "memory_jobs_dead",
        "members_ejected_now",
        "data_keys_held",
    }
)
# Node.stats entries named `<prefix><reason>`: one family with a `reason` label each.
REASON_FAMILIES = (
    ("dropped_", "dropped", "frames and datagrams the node dropped, by reason"),
    ("data_dropped_", "data_dropped", "replicated data messages dropped, by reason"),
    ("peers_down_", "peers_down", "peers membership lost, by reason (dead, left)"),
    ("links_down_", "links_down", "links that closed, by reason"),
    ("dials_failed_", "dial_failures", "dials that failed, by reason"),
    (
        "ejections_",
        "ejections",
        "members this node took out of a cluster's rotation, by reason (errors, success_rate, "
        "latency)",
    ),
)
# Node.stats entries the families of their own below already export (dials_failed: the sum
# of the dial_failures family).
_COVERED = frozenset(
    {
        "messages_published",
        "messages_delivered",
        "messages_unmatched",
        "dials_failed",
        "requests_pending",
        "handlers_running",
        "handler_limit",
        "requests_waiting",
    }
)
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")

_REQUEST, _SERVE = str(Kind.REQUEST), str(Kind.SERVE)
_PUBLISH, _DELIVER = str(Kind.PUBLISH), str(Kind.DELIVER)
_CALLS = {  # caller-side kinds besides requests: family stem, what it is
    str(Kind.BROADCAST): ("broadcasts", "broadcasts sent"),
    str(Kind.SURVEY): ("surveys", "surveys sent"),
    str(Kind.TUNNEL): ("tunnels", "tunnels ended"),
}
_STATES = {
    MemberState.ALIVE: "alive",
    MemberState.SUSPECT: "suspect",
    MemberState.DEAD: "dead",
    MemberState.LEFT: "left",
}
_MEMBER_STATES = tuple(_STATES.values())


class StatsSource(Protocol):
    """Anything with counters to export beside a node's (a gateway: `Gateway.stats`)."""

    @property
    def stats(self) -> Mapping[str, int]: ...


class NodeCollector:
    """What one node counts, as Prometheus metric families (read at scrape time)."""

    def __init__(
        self, node: Node, extra: Iterable[tuple[str, StatsSource]] = (), *, label: str = ""
    ) -> None:
        self.node = node
        self.label = label or node.name  # the `node` label on every sample
        # (family prefix, source): e.g. ("gateway", gateway) exports irismesh_gateway_*.
        self.extra = list(extra)

    def collect(self) -> Iterator[Metric]:
        node = self.node
        name = self.label
        node.flush_telemetry()  # publishes and deliveries tallied since the last flush
        stats = dict(node.stats)
        recorder = node.recorder
        series = recorder.all_series() if recorder is not None else []
        yield from _calls(name, series)
        yield from _messages(name, series, stats)
        yield from _admission(name, stats)
        yield from _membership(name, node)
        yield from _stats(name, "", stats)
        for prefix, source in self.extra:
            yield from _stats(name, prefix + "_", dict(source.stats))


# ----------------------------------------------------------------- families


def _by_kind(series: Iterable[Series], kind: str) -> dict[str, list[Series]]:
    """The series of one kind by cluster (or topic scope): past MAX_LABEL_VALUES, the rest
    fold into OTHER (the recorder's series keep their order, so the fold is stable)."""
    grouped: dict[str, list[Series]] = {}
    for one in series:
        if one.kind == kind:
            key = one.cluster
            if key not in grouped and len(grouped) >= MAX_LABEL_VALUES:
                key = OTHER
            grouped.setdefault(key, []).append(one)
    return grouped


def _gauge(metric: str, doc: str, node: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(metric, doc, labels=["node"])
    family.add_metric([node], value)
    return family


def _buckets(series: list[Series]) -> list[tuple[str, float]]:
    """Cumulative `le` buckets in seconds of the series' power-of-two histograms, summed."""
    counts = [0] * HISTOGRAM_BUCKETS
    for one in series:
        for bucket, n in enumerate(one.buckets()):
            counts[bucket] += n
    cumulative: list[tuple[str, float]] = []
    seen = sum(counts[: FIRST_BOUND + 1])
    cumulative.append((LE_BOUNDS[0], float(seen)))
    for bucket in range(FIRST_BOUND + 1, LAST_BOUND + 1):
        seen += counts[bucket]
        cumulative.append((LE_BOUNDS[bucket - FIRST_BOUND], float(seen)))
    cumulative.append(("+Inf", float(sum(counts))))
    return cumulative


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _observe(family: HistogramMetricFamily, values: list[str], series: list[Series]) -> None:
    """One labelled histogram: its buckets and `_count` (there is no `_sum`; see above)."""
    buckets = _buckets(series)
    family.add_metric(values, buckets, None)
    labels = dict(zip(family._labelnames, values, strict=True))
    family.samples.append(Sample(family.name + "_count", labels, buckets[-1][1]))


def _outcomes(series: list[Series]) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in series:
        for outcome, n in one.outcomes().items():
            total[outcome] = total.get(outcome, 0) + n
    return total


def _calls(node: str, series: list[Series]) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "irismesh_requests",
        "Requests by cluster: side caller (sent and ended) or member (handler runs of requests, "
        "broadcasts and surveys), by outcome",
        labels=["node", "cluster", "side", "outcome"],
    )
    caller = _histogram(
        "irismesh_request_duration_seconds",
        "Caller side: each request's round trip, whatever its outcome",
        ["node", "cluster"],
    )
    member = _histogram(
        "irismesh_handler_duration_seconds",
        "Member side: handler service time, one run in the recorder's sample_every timed",
        ["node", "cluster"],
    )
    for kind, side, histogram in ((_REQUEST, "caller", caller), (_SERVE, "member", member)):
        for cluster, group in _by_kind(series, kind).items():
            for outcome, n in _outcomes(group).items():
                requests.add_metric([node, cluster, side, outcome], n)
            _observe(histogram, [node, cluster], group)
    yield requests
    yield caller
    yield member
    for kind, (stem, doc) in _CALLS.items():
        counts = CounterMetricFamily(
            f"irismesh_{stem}", f"{doc.capitalize()} by cluster and outcome",
            labels=["node", "cluster", "outcome"],
        )  # fmt: skip
        durations = _histogram(
            f"irismesh_{stem.removesuffix('s')}_duration_seconds",
            f"How long {doc} took, by cluster",
            ["node", "cluster"],
        )
        for cluster, group in _by_kind(series, kind).items():
            for outcome, n in _outcomes(group).items():
                counts.add_metric([node, cluster, outcome], n)
            _observe(durations, [node, cluster], group)
        yield counts
        yield durations


def _messages(node: str, series: list[Series], stats: Mapping[str, int]) -> Iterator[Metric]:
    for kind, stem, doc in (
        (_PUBLISH, "published", "Messages this node published"),
        (_DELIVER, "delivered", "Messages delivered to this node's subscriptions"),
    ):
        family = CounterMetricFamily(
            f"irismesh_messages_{stem}", f"{doc}, by topic scope (a topic's first segment)",
            labels=["node", "scope"],
        )  # fmt: skip
        for scope, group in _by_kind(series, kind).items():
            family.add_metric([node, scope], sum(_outcomes(group).values()))
        yield family
    latency = _histogram(
        "irismesh_message_deliver_latency_seconds",
        "From the publisher's clock to this node's delivery (stamped messages, a sample), by "
        "topic scope",
        ["node", "scope"],
    )
    for scope, group in _by_kind(series, _DELIVER).items():
        _observe(latency, [node, scope], group)
    yield latency
    dropped = CounterMetricFamily(
        "irismesh_messages_dropped",
        "Messages lost: missed (dropped by a subscription's policy or lost on the way), "
        "unmatched (arrived for no subscription)",
        labels=["node", "reason"],
    )
    drops = next((s for s in series if s.kind == str(Kind.DROP)), None)
    missed = drops.counts.get("messages_missed", 0) if drops is not None else 0
    dropped.add_metric([node, "missed"], missed)
    dropped.add_metric([node, "unmatched"], stats.get("messages_unmatched", 0))
    yield dropped


def _admission(node: str, stats: Mapping[str, int]) -> Iterator[Metric]:
    levels = (
        ("irismesh_requests_in_flight", "requests_pending", "Requests sent, not yet answered"),
        ("irismesh_handlers_running", "handlers_running", "Handlers running now"),
        ("irismesh_admission_limit", "handler_limit", "Handlers admission lets run at once"),
        ("irismesh_admission_queue_length", "requests_waiting", "Requests waiting to run"),
    )
    for metric, key, doc in levels:
        if key in stats:
            yield _gauge(metric, doc, node, stats[key])
    shed = CounterMetricFamily(
        "irismesh_requests_shed",
        "Requests turned away before they ran (the caller sees Overloaded), by reason",
        labels=["node", "reason"],
    )
    for key, n in stats.items():
        reason = key.removeprefix("requests_shed_")
        if reason != key and not _BY_PRIORITY.search(reason):
            shed.add_metric([node, _safe(reason)], n)
    yield shed


# requests_shed_<reason>_<priority> splits a reason's count by priority (priority.label): left
# out, as sum() over the family would count those requests twice.
_BY_PRIORITY = re.compile(r"_(low|normal|high|p-?[0-9]+)$")


def _membership(node: str, mesh: Node) -> Iterator[Metric]:
    members = GaugeMetricFamily(
        "irismesh_members", "Peers membership holds, by state", labels=["node", "state"]
    )
    counts = dict.fromkeys(_MEMBER_STATES, 0)
    # The node's own view, read on its loop: membership is the core's (no copy, no lock).
    core = mesh._core
    if core is None:
        yield members
        return
    for member in core.membership.members():
        state = _STATES.get(member.state, str(member.state))
        counts[state] = counts.get(state, 0) + 1
    for state, n in counts.items():
        members.add_metric([node, state], n)
    yield members
    yield _gauge(
        "irismesh_membership_health",
        "Lifeguard's local health score: 0 is healthy, higher stretches probe timeouts",
        node,
        core.membership.health,
    )


def _stats(node: str, prefix: str, stats: Mapping[str, int]) -> Iterator[Metric]:
    """Every counter of `stats`: irismesh_<prefix><name>_total (a gauge without _total), the
    reason families as one family with a `reason` label each."""
    reasons: dict[str, CounterMetricFamily] = {}
    for key in sorted(stats):
        value = stats[key]
        if not prefix and (key in _COVERED or key.startswith("requests_shed_")):
            continue
        family_for = next(
            ((stem, doc, key[len(p) :]) for p, stem, doc in REASON_FAMILIES if key.startswith(p)),
            None,
        )
        if family_for is not None:
            stem, doc, reason = family_for
            metric = f"irismesh_{prefix}{stem}"
            family = reasons.get(metric)
            if family is None:
                family = reasons[metric] = CounterMetricFamily(
                    metric, doc.capitalize(), labels=["node", "reason"]
                )
            family.add_metric([node, _safe(reason)], value)
            continue
        metric = f"irismesh_{prefix}{_safe(key)}"
        if key in GAUGES or (prefix and key in _EXTRA_GAUGES):
            yield _gauge(metric, f"{key} (stats)", node, value)
        else:
            family = CounterMetricFamily(metric, f"{key} (stats)", labels=["node"])
            family.add_metric([node], value)
            yield family
    yield from reasons.values()


_EXTRA_GAUGES = frozenset(
    {
        "link_buffered",
        "links_up",
        "imports",
        "republish_queue",
        "requests_in_flight",
        "standby_held",
        "forwarding",
        "fellows",
    }
)


def _safe(name: str) -> str:
    return _UNSAFE.sub("_", name)


__all__ = ["LE_BOUNDS", "NodeCollector", "StatsSource"]
