"""Synthetic telemetry: a plausible mesh's records, for tests, benchmarks and the demo report.

The mesh: `clients` client nodes call clusters `db` (three members, one of them four times
slower, so a latency-aware balancer sends it less), `cache` (two members) and publish on topic
`feeds.news` (two subscribers); cluster `idle` has members but nobody calls it. Every call gives
a caller-side record (request, or publish) and a member-side one (serve, or deliver); about 1%
of requests time out, 0.5% fail in the handler, and `no_responders` appears for cluster `gone`,
which has no member at all. Membership records (join at the start, a suspect/alive flap, one
db member dead half way) and gauges every 5 s per node complete the picture.

With `sample_every=k`, successful calls are recorded one in k with weight k (failures are
always recorded with weight 1), as a node sampling at 1/k would. A fraction `late` of records
carries a `ts` up to `late_by` seconds earlier than its neighbours, as records from a node
whose spool was flushed late. Generation is vectorised with numpy in chunks; records come out
as `Record` tuples grouped by chunk, in no particular node order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np

from irismesh.telemetry.schema import Record
from irismesh.telemetry.spool import SpoolWriter

__all__ = ["CLUSTERS", "MeshShape", "generate", "write_spool"]

CLUSTERS: Final = ("db", "cache", "feeds.news", "idle", "gone")
_CHUNK: Final = 50_000


class MeshShape:
    """Node ids and roles of the synthetic mesh (deterministic for a seed)."""

    def __init__(self, *, clients: int = 4, seed: int = 0) -> None:
        rng = np.random.default_rng(seed + 1_000_003)

        def ids(n: int) -> list[str]:
            return [bytes(rng.integers(0, 256, 16, dtype=np.uint8)).hex() for _ in range(n)]

        self.clients = ids(clients)
        self.members = {"db": ids(3), "cache": ids(2), "feeds.news": ids(2), "idle": ids(2)}
        # Mean service time per member, microseconds: db's third member is slow.
        self.service_us = {"db": [400.0, 450.0, 1800.0], "cache": [80.0, 90.0]}
        # Shares a latency-aware balancer would give: inversely proportional to latency.
        self.shares = {
            name: np.array([1 / t for t in times]) / sum(1 / t for t in times)
            for name, times in self.service_us.items()
        }

    @property
    def nodes(self) -> list[str]:
        return self.clients + [m for ms in self.members.values() for m in ms]


def generate(
    calls: int,
    *,
    seed: int = 0,
    start: float = 1_700_000_000.0,
    duration: float = 600.0,
    clients: int = 4,
    sample_every: int = 1,
    late: float = 0.0,
    late_by: float = 300.0,
) -> Iterator[list[Record]]:
    """Chunks of records for `calls` calls (about 2 records a call) spread over `duration` s."""
    rng = np.random.default_rng(seed)
    shape = MeshShape(clients=clients, seed=seed)
    yield _membership_and_gauges(shape, rng, start, duration)
    done = 0
    while done < calls:
        n = min(_CHUNK, calls - done)
        t0 = start + duration * done / calls
        t1 = start + duration * (done + n) / calls
        yield _calls(shape, rng, n, t0, t1, sample_every, late, late_by)
        done += n


def _calls(
    shape: MeshShape,
    rng: np.random.Generator,
    n: int,
    t0: float,
    t1: float,
    sample_every: int,
    late: float,
    late_by: float,
) -> list[Record]:
    ts = np.sort(rng.uniform(t0, t1, n))
    if late > 0:
        shift = rng.uniform(0.0, late_by, n) * (rng.random(n) < late)
        ts = ts - shift
    client = rng.integers(0, len(shape.clients), n)
    target = rng.choice(4, n, p=[0.55, 0.3, 0.14, 0.01])  # db, cache, feeds.news, gone
    size = rng.integers(16, 2048, n)
    roll = rng.random(n)
    keep = rng.integers(0, sample_every, n) == 0 if sample_every > 1 else np.ones(n, dtype=bool)
    pick = rng.random(n)
    noise = rng.lognormal(0.0, 0.35, n)
    out: list[Record] = []
    append = out.append
    for i in range(n):
        node = shape.clients[client[i]]
        t = float(ts[i])
        sz = int(size[i])
        what = target[i]
        if what == 3:  # "gone": no member, known at once
            append(Record(t, node, "request", "reqrep", "gone", None, 20, sz, "no_responders", 1))
            continue
        if what == 2:  # publish, delivered to both subscribers
            if not keep[i]:
                continue
            w = sample_every
            append(Record(t, node, "publish", "pubsub", "feeds.news", None, None, sz, "ok", w))
            for sub in shape.members["feeds.news"]:
                lat = int(150 * noise[i])
                append(
                    Record(
                        t + lat / 1e6,
                        sub,
                        "deliver",
                        "pubsub",
                        "feeds.news",
                        node,
                        lat,
                        sz,
                        "ok",
                        w,
                    )
                )
            continue
        cluster = "db" if what == 0 else "cache"
        shares = shape.shares[cluster]
        k = int(np.searchsorted(np.cumsum(shares), pick[i] * 0.999999))
        member = shape.members[cluster][k]
        service = int(shape.service_us[cluster][k] * noise[i])
        rtt = service + 120 + int(40 * noise[i])
        if roll[i] < 0.01:
            append(
                Record(t, node, "request", "reqrep", cluster, member, 1_000_000, sz, "timeout", 1)
            )
        elif roll[i] < 0.015:
            append(
                Record(t, node, "request", "reqrep", cluster, member, rtt, sz, "remote_error", 1)
            )
            append(
                Record(t, member, "serve", "reqrep", cluster, node, service, sz, "remote_error", 1)
            )
        elif keep[i]:
            w = sample_every
            append(Record(t, node, "request", "reqrep", cluster, member, rtt, sz, "ok", w))
            append(Record(t, member, "serve", "reqrep", cluster, node, service, sz, "ok", w))
    return out


def _membership_and_gauges(
    shape: MeshShape, rng: np.random.Generator, start: float, duration: float
) -> list[Record]:
    out: list[Record] = []
    observers = shape.clients
    for cluster, members in shape.members.items():
        if cluster == "feeds.news":
            continue  # a topic's subscribers are not cluster members
        for member in members:
            for observer in observers:
                t = start + float(rng.uniform(0, 2))
                out.append(Record(t, observer, "membership", "", cluster, member, name="join"))
    flap = shape.members["cache"][1]
    dead = shape.members["db"][2]
    for observer in observers:
        t = start + duration * 0.3 + float(rng.uniform(0, 1))
        out.append(Record(t, observer, "membership", "", "cache", flap, name="suspect"))
        out.append(Record(t + 1.5, observer, "membership", "", "cache", flap, name="alive"))
        t = start + duration * 0.5 + float(rng.uniform(0, 1))
        out.append(Record(t, observer, "membership", "", "db", dead, name="dead"))
    for node in shape.nodes:
        for t in np.arange(start, start + duration, 5.0):
            inflight = float(rng.integers(0, 64))
            out.append(
                Record(float(t), node, "gauge", "", None, None, name="in_flight", value=inflight)
            )
            out.append(Record(float(t), node, "gauge", "", None, None, name="peers", value=12.0))
    return out


def write_spool(
    directory: str | os.PathLike[str],
    chunks: Iterator[list[Record]],
    *,
    max_bytes: int = 4 * 1024 * 1024,
    on_chunk: Callable[[int], Any] | None = None,
) -> int:
    """Write records through one SpoolWriter per node, as the nodes would; records written."""
    writers: dict[str, SpoolWriter] = {}
    total = 0
    Path(directory).mkdir(parents=True, exist_ok=True)
    try:
        for chunk in chunks:
            for record in chunk:
                writer = writers.get(record.node)
                if writer is None:
                    writer = writers[record.node] = SpoolWriter(
                        directory, record.node, max_bytes=max_bytes, capacity=1 << 30
                    )
                writer.append(record)
            for writer in writers.values():
                writer.flush()
            total += len(chunk)
            if on_chunk is not None:
                on_chunk(total)
    finally:
        for writer in writers.values():
            writer.close()
    return total
