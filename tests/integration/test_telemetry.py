"""The node's own telemetry: exact counters, and spooled records that agree with them."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import calls_of_each_outcome, echo_or_boom, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

import irismesh
from irismesh.node import TelemetryConfig
from irismesh.telemetry.spool import SpoolReader


def test_spooled_records_agree_with_the_node_counters(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"

    async def main() -> tuple[dict[str, int], dict[str, int]]:
        config = TelemetryConfig(spool_dir=spool, sample_every=1, gauge_interval=0.2)
        async with irismesh.Node("db", keyring=keys, telemetry=config, name="db-1") as member:
            member.on_request(echo_or_boom)

            async with irismesh.Node(
                keyring=keys, seeds=[member.endpoint], telemetry=config, name="client-1"
            ) as client:
                await calls_of_each_outcome(client, 200)
                assert client.recorder is not None
                assert member.recorder is not None
                client_counts = {
                    f"{k}/{c}/{o}": n for (k, c, o), n in client.recorder.counts.items()
                }
            member_counts = {f"{k}/{c}/{o}": n for (k, c, o), n in member.recorder.counts.items()}
        return client_counts, member_counts

    client_counts, member_counts = asyncio.run(asyncio.wait_for(main(), 30))
    assert client_counts["request/db/ok"] == 200
    assert client_counts["request/db/remote_error"] == 1
    assert client_counts["request/nobody/no_responders"] == 1
    assert member_counts["serve/db/ok"] == 200
    assert member_counts["serve/db/remote_error"] == 1

    records = list(SpoolReader(spool))
    spooled = Counter(
        (r.kind, r.cluster, r.outcome) for r in records if r.kind in ("request", "serve")
    )
    assert spooled[("request", "db", "ok")] == 200  # sample_every=1: every event is a record
    assert spooled[("serve", "db", "ok")] == 200
    assert spooled[("request", "nobody", "no_responders")] == 1
    served = [r for r in records if r.kind == "request" and r.outcome == "ok"]
    assert all(r.latency_us is not None and r.latency_us > 0 for r in served)
    assert {r.peer for r in served} == {r.node for r in records if r.kind == "serve"}
    kinds = Counter(r.kind for r in records)
    assert kinds["membership"] >= 2  # each side saw the other join (and leave at close)
    assert kinds["gauge"] >= 5
    assert not [p for p in spool.iterdir() if not p.name.endswith(".msgpack")], "temp files left"
    # Names: each node's on its gauges and membership records, the peer's on the latter.
    names = {r.node: "db-1" if r.kind == "serve" else "client-1" for r in served}
    names |= {r.peer: "db-1" for r in served}
    for r in records:
        if r.kind in ("gauge", "membership"):
            assert r.node_name == names[r.node]
        if r.kind == "membership":
            assert r.peer_name == names[r.peer]  # type: ignore[index]
        if r.kind in ("request", "serve"):
            assert (r.node_name, r.peer_name) == (None, None)  # per-message records stay short


def test_sampling_keeps_counts_exact_and_records_weighted(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"

    async def main() -> int:
        config = TelemetryConfig(spool_dir=spool, sample_every=10)
        async with irismesh.Node("db", keyring=keys) as member:
            member.on_request(lambda payload: payload)
            async with irismesh.Node(
                keyring=keys, seeds=[member.endpoint], telemetry=config
            ) as client:
                await client.wait_for_members("db", timeout=5)
                for _ in range(5):
                    await asyncio.gather(*(client.request("db", b"x") for _ in range(40)))
                assert client.recorder is not None
                return client.recorder.total("request", "db", "ok")

    exact = asyncio.run(asyncio.wait_for(main(), 30))
    assert exact == 200
    sampled = [r for r in SpoolReader(spool) if r.kind == "request"]
    assert len(sampled) == 20
    assert sum(r.weight for r in sampled) == exact


def test_recorder_percentiles_interpolate_within_a_bucket() -> None:
    from irismesh.telemetry.recorder import Recorder

    recorder = Recorder("n")
    for us in range(1000, 2000):  # all in the bucket [1024, 2048) but the first 24
        recorder.request("db", None, us / 1e6, 0, "ok")
    p50 = recorder.percentile("request", "db", 0.5)
    assert p50 is not None
    assert 1400 < p50 < 1600  # the true median is 1500; the bucket bound would say 2048
    assert recorder.percentile("request", "other", 0.5) is None


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["request", "served", "tally", "drop"]),
            st.sampled_from(["db", "web"]),
            st.sampled_from(["ok", "timeout", "remote_error", "no_responders"]),
            st.integers(0, 5),
        ),
        max_size=60,
    )
)
def test_recorder_counts_agree_with_a_plain_count_of_what_it_was_told(
    events: list[tuple[str, str, str, int]],
) -> None:
    # The recorder keeps only the outcomes other than ok and derives ok from its histograms;
    # "served" goes through the handler runner's inlined recording, as a member's requests do.
    from irismesh._core.events import RequestArrived
    from irismesh.patterns.reqrep import HandlerRunner
    from irismesh.telemetry.recorder import Recorder

    recorder = Recorder("n", sample_every=3)
    recorder.exporter = records = ListSink()
    runner = HandlerRunner(
        lambda token, payload: None,
        lambda token, exc: None,
        lambda: None,
        recorder.serving,
    )
    expected: Counter[tuple[str, str, str]] = Counter()
    for what, cluster, outcome, n in events:
        if what == "request":
            recorder.request(cluster, None, n / 1e3, 10, outcome)
            expected["request", cluster, outcome] += 1
        elif what == "served":
            ok = outcome == "ok"
            runner.handler = echo if ok else fail
            event = RequestArrived(token=(b"p" * 16, 1, b"r", 1), cluster=cluster, payload=b"x")
            runner.run(event)
            expected["serve", cluster, "ok" if ok else "remote_error"] += 1
        elif what == "tally":
            recorder.tally("deliver", cluster, None, 10 * n, outcome, n)
            expected["deliver", cluster, outcome] += n
        else:
            recorder.drop(outcome, n)
            expected["drop", "", outcome] += n
    assert recorder.counts == {key: n for key, n in expected.items() if n}
    assert recorder.total("serve") == sum(n for (k, _c, _o), n in expected.items() if k == "serve")
    # One record in 3 events of each timed series, each standing for 3 (tallies: one each).
    timed: Counter[tuple[str, str]] = Counter()
    for (kind, cluster, _outcome), n in expected.items():
        if kind in ("request", "serve"):
            timed[kind, cluster] += n
    sampled = Counter((r[2], r[4]) for r in records.records if r[2] in ("request", "serve"))
    assert sampled == {key: n // 3 for key, n in timed.items() if n // 3}
    assert all(r[9] == 3 for r in records.records if r[2] in ("request", "serve"))
    # A caller times every request; a member only the runs it samples (one in 3 here).
    for (kind, cluster), n in timed.items():
        histogram = recorder.histograms.get((kind, cluster), [])
        assert sum(histogram) == (n if kind == "request" else n // 3)


class ListSink:
    def __init__(self) -> None:
        self.records: list[Sequence[Any]] = []

    def append(self, record: Sequence[Any]) -> bool:
        self.records.append(record)
        return True


def echo(payload: bytes) -> bytes:
    return payload


def fail(payload: bytes) -> bytes:
    raise ValueError("no")


def test_latencies_past_the_last_bucket_land_in_it() -> None:
    from irismesh.telemetry.recorder import HISTOGRAM_BUCKETS, Recorder

    recorder = Recorder("n")
    recorder.request("db", None, 2.0**45 / 1e6, 0, "ok")  # a year: past 2**39 us
    recorder.request("db", None, 2.0**62 / 1e6, 0, "ok")
    recorder.request("db", None, 0.0, 0, "ok")
    histogram = recorder.histograms["request", "db"]
    assert len(histogram) == HISTOGRAM_BUCKETS
    assert (histogram[0], histogram[-1], sum(histogram)) == (1, 2, 3)
    assert recorder.counts == {("request", "db", "ok"): 3}


def test_publishes_deliveries_misses_and_tunnels_are_recorded(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        member = await irismesh.Node("files", keyring=keys).start()
        caller = await irismesh.Node(keyring=keys, seeds=[member.endpoint]).start()
        try:

            @member.on_tunnel
            async def echo(tunnel: irismesh.Tunnel) -> None:
                async for message in tunnel:
                    await tunnel.send(message)

            sub = member.subscribe("feeds.#", policy="drop_oldest", maxsize=5)
            await caller.wait_for_subscribers("feeds.x", 1, timeout=5)
            for i in range(20):
                await caller.publish(f"feeds.world.{i}", b"x" * 10)
            await wait_until(lambda: sub.received == 20, 5, "every message")
            async with caller.tunnel("files", timeout=5) as tunnel:
                await tunnel.send(b"y" * 1000)
                assert await tunnel.recv() == b"y" * 1000
                await tunnel.send_eof()
                with pytest.raises(irismesh.EndOfStream):
                    await tunnel.recv()
            assert caller.recorder is not None
            assert member.recorder is not None
            caller.flush_telemetry()
            member.flush_telemetry()
            await wait_until(
                lambda: (
                    member.recorder is not None and member.recorder.total("tunnel", "files") == 1
                ),
                5,
                "the member's tunnel record",
            )
            assert caller.recorder.total("publish", "feeds", "ok") == 20
            assert member.recorder.total("deliver", "feeds", "ok") == 20
            # 15 deliveries pushed the oldest out of a buffer of 5: counted as drops.
            assert member.recorder.counts[("drop", "", "messages_missed")] == 15
            assert caller.recorder.total("tunnel", "files", "ok") == 1
        finally:
            await asyncio.gather(caller.close(), member.close())

    asyncio.run(asyncio.wait_for(main(), 30))


def test_stamped_publishes_time_their_delivery_and_keep_counts_exact(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """One publish in `sample_every` carries the publisher's clock: the subscriber times it,
    spools it with its latency, and counts each delivery once (timed or tallied)."""
    spool = tmp_path / "spool"

    async def main() -> None:
        config = TelemetryConfig(spool_dir=spool, sample_every=10, gauge_interval=0.2)
        member = await irismesh.Node(keyring=keys, telemetry=config).start()
        caller = irismesh.Node(keyring=keys, seeds=[member.endpoint], telemetry=config)
        await caller.start()
        try:
            sub = member.subscribe("orders.#", maxsize=1000)
            await caller.wait_for_subscribers("orders.x", 1, timeout=5)
            for i in range(200):
                await caller.publish(f"orders.{i % 7}", b"x" * 10)
            await wait_until(lambda: sub.received == 200, 5, "every message")
            assert member.recorder is not None
            member.flush_telemetry()
            assert member.recorder.total("deliver", "orders", "ok") == 200
            series = member.recorder.series("deliver", "orders")
            timed = sum(series.histogram)
            assert timed == 20  # the publisher stamped one in 10
            assert series.untimed == 180
            p50 = member.recorder.percentile("deliver", "orders", 0.5)
            assert p50 is not None
            assert 0 < p50 < 5e6
        finally:
            await asyncio.gather(caller.close(), member.close())

    asyncio.run(asyncio.wait_for(main(), 30))
    delivered = [r for r in SpoolReader(spool) if r.kind == "deliver"]
    timed = [r for r in delivered if r.latency_us is not None]
    assert len(timed) == 20
    assert all(r.weight == 1 and r.latency_us is not None and r.latency_us > 0 for r in timed)
    assert sum(r.weight for r in delivered) == 200  # timed and tallied, each delivery once


def test_round_trips_are_timed_below_a_millisecond_on_irismesh_s_own_loop(
    keys: irismesh.Keyring,
) -> None:
    """uvloop's clock moves in whole milliseconds, once per turn of the loop: round trips timed
    by it come out as 0 or 1,000 us. They are timed by perf_counter instead."""

    async def main() -> None:
        member = await irismesh.Node("db", keyring=keys, telemetry=False).start()
        member.on_request(echo)
        caller = irismesh.Node(keyring=keys, seeds=[member.endpoint], telemetry=True)
        await caller.start()
        try:
            await caller.wait_for_members("db", timeout=5)
            for _ in range(30):
                assert await caller.request("db", b"x", timeout=5) == b"x"
            assert caller.recorder is not None
            histogram = caller.recorder.histograms["request", "db"]
            assert sum(histogram) == 30
            assert histogram[0] == 0, histogram  # none timed at 0 us: a round trip takes some
            assert sum(histogram[21:]) == 0, histogram  # and none at 2 s or more
        finally:
            await asyncio.gather(caller.close(), member.close())

    irismesh.run(asyncio.wait_for(main(), 30))
