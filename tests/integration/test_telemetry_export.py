"""Telemetry exported over the mesh and collected into one spool directory.

Nodes run with telemetry on 127.0.0.1; `attach_exporter` hooks each one's exporter to its
recorder, and a loop here calls `export` as the node's telemetry loop does (once node.py calls
it itself, attach_exporter returns the node's own exporter and the two loops share it). A
collector node writes what they publish; the files it writes must read back, with the spool
reader and Spark's decoder, as the very records the nodes spooled locally.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import msgpack
import pytest
from helpers import deadline, echo_or_boom, run_with_deadline, wait_until

import irismesh
from irismesh import CoreConfig
from irismesh.errors import Closed, SlowConsumer
from irismesh.node import TelemetryConfig
from irismesh.patterns.pubsub import Message
from irismesh.telemetry.export import (
    EXPORT_DROP,
    Collector,
    TopicExporter,
    attach_exporter,
    topic_for,
)
from irismesh.telemetry.recorder import Recorder
from irismesh.telemetry.schema import Record
from irismesh.telemetry.spool import (
    SpoolReader,
    SpoolWriter,
    complete_files,
    decode_spool,
    pack_header,
    read_spool_file,
)

NODE = "ab" * 16


def run(coro: Awaitable[None], timeout: float = 20) -> None:
    run_with_deadline(coro, timeout)


def record(i: int, node: str = NODE, kind: str = "request") -> Record:
    return Record(1.7e9 + i, node, kind, "reqrep", "db", "cd" * 16, 100 + i, 10, "ok", 1)


class Sent:
    """A fake `publish` that keeps what it was given and says one node got it."""

    def __init__(self, reached: int = 1) -> None:
        self.payloads: list[bytes] = []
        self.reached = reached

    async def __call__(self, topic: str, payload: bytes, *, timeout: float) -> int:
        assert topic == topic_for(NODE)
        assert timeout > 0
        self.payloads.append(payload)
        return self.reached


def raising(error: BaseException) -> Callable[..., Awaitable[int]]:
    async def publish(topic: str, payload: bytes, *, timeout: float) -> int:
        raise error

    return publish


# ----------------------------------------------------------------- the whole path, real mesh


@deadline(20)
async def test_the_collector_spools_every_node_s_records_as_the_nodes_spool_them(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    out = tmp_path / "collected"

    def config(name: str) -> TelemetryConfig:
        return TelemetryConfig(spool_dir=tmp_path / name, sample_every=1, gauge_interval=0.2)

    db1 = await irismesh.Node("db", keyring=keys, telemetry=config("db1")).start()
    seeds = [db1.endpoint]
    db2 = await irismesh.Node("db", keyring=keys, seeds=seeds, telemetry=config("db2")).start()
    client = await irismesh.Node(keyring=keys, seeds=seeds, telemetry=config("client")).start()
    collecting = await irismesh.Node(keyring=keys, seeds=seeds, telemetry=False).start()
    nodes = [db1, db2, client]
    for member in (db1, db2):
        member.on_request(echo_or_boom)

    exporters = [attach_exporter(node) for node in nodes]
    assert [attach_exporter(node) for node in nodes] == exporters  # one per node
    exporting = True

    async def export_loop(node: irismesh.Node, exporter: TopicExporter) -> None:
        while exporting:  # as Node._telemetry_loop does, every gauge interval
            await asyncio.sleep(0.1)
            await exporter.export(node.publish)

    loops = [asyncio.create_task(export_loop(n, e)) for n, e in zip(nodes, exporters, strict=True)]
    collector = Collector(collecting, out, max_age=0.3, flush_interval=0.1)
    try:
        async with collector:
            for node in nodes:  # records are exported from when a node sees the interest
                await node.wait_for_subscribers(topic_for(node.node_id.hex()), timeout=5)
            await client.wait_for_members("db", 2, timeout=5)
            await asyncio.gather(*(client.request("db", b"%d" % i) for i in range(150)))
            with pytest.raises(irismesh.RemoteError):
                await client.request("db", b"boom")
            ids = {node.node_id.hex() for node in nodes}
            await wait_until(
                lambda: ids <= {o for o, n in collector.records.items() if n}, 5, "all nodes"
            )
            exporting = False
            await asyncio.gather(*loops)
            for node, exporter in zip(nodes, exporters, strict=True):
                await exporter.export(node.publish)  # what is left since the last one
            sent = {e.node: e.messages for e in exporters}
            await wait_until(
                lambda: all(collector.messages_from.get(o, 0) >= n for o, n in sent.items()),
                5,
                "the collector to receive every message published",
            )
        stats = collector.stats()
        for exporter in exporters:
            assert (exporter.dropped, exporter.errors) == (0, 0), exporter
            assert exporter.exported > 0
        # The exact counters say what the records must add up to (sample_every=1).
        assert client.recorder is not None
        assert client.recorder.total("request", "db", "ok") == 150
    finally:
        exporting = False
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await asyncio.gather(*(n.close() for n in [*nodes, collecting]))

    assert stats.nodes.keys() == ids
    assert (stats.corrupt, stats.rejected, stats.missed, stats.dropped) == (0, 0, 0, 0)
    files = complete_files(out)
    assert stats.files == len(files) >= 3
    assert not [p for p in out.iterdir() if p not in files], "temporary files left"
    collected: dict[str, list[Record]] = {}
    for path in files:  # named and headed by their origin node, as local files are
        node_id, _, seq = path.name.removesuffix(".msgpack").rpartition("-")
        assert node_id in ids
        assert len(seq) == 8
        assert decode_spool(path.read_bytes()).node == node_id
        records, corrupt = read_spool_file(path)
        assert corrupt == 0
        assert {r.node for r in records} == {node_id}
        collected.setdefault(node_id, []).extend(records)
    assert sum(map(len, collected.values())) == stats.records == sum(stats.nodes.values())

    calls = ("request", "serve")
    for name, node in zip(("db1", "db2", "client"), nodes, strict=True):
        node_id = node.node_id.hex()
        local = list(SpoolReader(tmp_path / name))
        mine = Counter(collected[node_id])
        # Every request and serve record, identical to the local one (ts included) ...
        assert +Counter({r: n for r, n in mine.items() if r.kind in calls}) == Counter(
            r for r in local if r.kind in calls
        )
        # ... and nothing that the node did not spool itself (gauges and membership
        # records made before the interest was seen, or after the last export, are
        # only local).
        assert not mine - Counter(local)
    everything = [r for records in collected.values() for r in records]
    kinds = Counter((r.kind, r.outcome) for r in everything)
    assert kinds[("request", "ok")] == 150
    assert kinds[("serve", "ok")] == 150
    assert kinds[("request", "remote_error")] == kinds[("serve", "remote_error")] == 1
    assert kinds[("gauge", "")] > 0

    pytest.importorskip("pyarrow")
    from irismesh.spark_telemetry.decode import decode_to_table

    decoded = [decode_to_table(path.read_bytes()) for path in files]
    assert sum(d.corrupt for d in decoded) == 0
    assert sum(d.table.num_rows for d in decoded) == len(everything)


@deadline(20)
async def test_a_slow_collector_makes_exporters_drop_and_count_never_wait(
    keys: irismesh.Keyring,
) -> None:
    # The subscriber grants 4 messages of credit and never reads: after 4, the publisher
    # would have to wait. The exporter must drop and count instead, at once.
    slow = await irismesh.Node(keyring=keys, config=CoreConfig(pubsub_window=4)).start()
    node = await irismesh.Node(keyring=keys, seeds=[slow.endpoint]).start()
    other = await irismesh.Node(keyring=keys, seeds=[slow.endpoint], telemetry=False).start()
    try:
        exporter = attach_exporter(node, chunk_bytes=4096, timeout=2.0)
        stuck = slow.subscribe("_mesh.telemetry.*", policy="block", maxsize=1)
        app = other.subscribe("app.#")
        await node.wait_for_subscribers(exporter.topic, timeout=5)
        await node.wait_for_subscribers("app.x", timeout=5)
        for i in range(3000):
            exporter.append(record(i, node.node_id.hex()))
        total = exporter.buffered  # and the node's own membership records
        started = time.monotonic()
        exported = await exporter.export(node.publish)
        took = time.monotonic() - started
        # Waiting for credit would take the whole 2 s timeout: well under it means no wait.
        assert took < 1.5, f"export waited {took:.2f} s for a slow subscriber"
        assert exporter.messages == 4  # the credit it had
        assert exported + exporter.dropped == total
        assert exporter.dropped > 0
        assert exporter.errors == 0
        assert node.recorder is not None  # the loss is in the node's own telemetry
        assert node.recorder.total("drop", "", EXPORT_DROP) == exporter.dropped
        assert exporter.buffered == 1  # the drop record itself, for the next export
        # The application's publishes were never held behind the exporter (held, this
        # would raise SlowConsumer after its timeout).
        assert await node.publish("app.x", b"still flowing", timeout=1) == 1
        assert (await app.get(timeout=2)).payload == b"still flowing"
        # What the exporter did send arrives, and stays unread, holding the credit.
        await wait_until(lambda: stuck.qsize() >= 1, 5, "the exported messages to arrive")
    finally:
        await asyncio.gather(node.close(), slow.close(), other.close())


def test_a_node_with_telemetry_exports_by_itself_and_sends_the_rest_as_it_leaves(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """The node.py hook: the telemetry loop exports, and close() sends the last records."""
    config = TelemetryConfig(spool_dir=tmp_path / "local", sample_every=1, gauge_interval=0.2)

    hooked = True

    async def main() -> None:
        nonlocal hooked
        member = await irismesh.Node("db", keyring=keys, telemetry=config).start()
        seeds = [member.endpoint]
        client = await irismesh.Node(keyring=keys, seeds=seeds, telemetry=config).start()
        collecting = await irismesh.Node(keyring=keys, seeds=seeds, telemetry=False).start()
        try:
            if member.recorder is None or member.recorder.exporter is None:
                hooked = False
                return
            member.on_request(lambda payload: payload)
            async with Collector(collecting, tmp_path / "out", flush_interval=0.1) as collector:
                for node in (member, client):
                    await node.wait_for_subscribers(topic_for(node.node_id.hex()), timeout=5)
                await client.wait_for_members("db", timeout=5)
                for _ in range(50):
                    await client.request("db", b"x")
                await client.close()  # at once: no gauge interval has to pass
                await member.close()
                sent = sum(e.messages for e in (member.recorder.exporter, client.recorder.exporter)
                           if isinstance(e, TopicExporter))  # fmt: skip
                await wait_until(lambda: collector.messages >= sent, 5, "the last messages")
        finally:
            await asyncio.gather(member.close(), client.close(), collecting.close())
        kinds = Counter(r.kind for r in SpoolReader(tmp_path / "out"))
        assert kinds["request"] == kinds["serve"] == 50

    run(main())
    if not hooked:
        pytest.skip("irismesh/node.py does not attach an exporter yet")


# ----------------------------------------------------------------- the exporter alone


def test_a_full_buffer_drops_and_counts_and_the_rest_is_exported() -> None:
    drops: list[int] = []
    exporter = TopicExporter(NODE, capacity=3, on_drop=drops.append)
    assert [exporter.append(record(i)) for i in range(5)] == [True] * 3 + [False] * 2
    assert (exporter.buffered, exporter.dropped) == (3, 2)
    publish = Sent()

    async def main() -> None:
        assert await exporter.export(publish) == 3
        assert await exporter.export(publish) == 0  # nothing left, nothing sent

    run(main())
    assert drops == [2]  # reported once, at the export
    assert (exporter.exported, exporter.messages, exporter.buffered) == (3, 1, 0)
    [payload] = publish.payloads
    contents = decode_spool(payload)  # a chunk is a spool file's bytes: header, then records
    assert contents.node == NODE
    assert contents.corrupt == 0
    assert [Record(*row) for row in contents.rows] == [record(i) for i in range(3)]
    assert exporter.append(record(9))  # room again


@pytest.mark.parametrize(
    "error",
    [
        SlowConsumer(topic_for(NODE), 0.1, ["cd" * 16]),
        Closed("node is closed"),
        RuntimeError("a bug in publish"),
    ],
    ids=["slow-consumer", "closed", "bug"],
)
def test_publish_errors_are_counted_never_raised(error: Exception) -> None:
    drops: list[int] = []
    exporter = TopicExporter(NODE, chunk_bytes=1024, on_drop=drops.append)
    for i in range(100):
        exporter.append(record(i))

    async def main() -> None:
        assert await exporter.export(raising(error)) == 0

    run(main())
    assert (exporter.exported, exporter.dropped, exporter.errors) == (0, 100, 1)
    assert exporter.last_error is error
    assert drops == [100]


def test_a_publish_that_hangs_is_cut_short_and_counted() -> None:
    exporter = TopicExporter(NODE, timeout=0.1)
    exporter.append(record(0))

    async def hang(topic: str, payload: bytes, *, timeout: float) -> int:
        await asyncio.sleep(60)
        return 1

    async def main() -> None:
        started = time.monotonic()
        assert await exporter.export(hang) == 0
        assert time.monotonic() - started < 1

    run(main())
    assert (exporter.dropped, exporter.errors) == (1, 1)
    assert isinstance(exporter.last_error, TimeoutError)


def test_without_subscribers_nothing_is_packed_or_sent() -> None:
    interested = False
    exporter = TopicExporter(NODE, has_subscribers=lambda: interested)

    def no_packing(batch: object) -> Any:
        raise AssertionError("packed although nobody subscribes")

    exporter.pack = no_packing  # type: ignore[method-assign]
    publish = Sent()
    for i in range(10):
        exporter.append(record(i))
    run(exporter.export(publish))  # type: ignore[arg-type]
    assert publish.payloads == []
    assert (exporter.unobserved, exporter.dropped, exporter.buffered) == (10, 0, 0)
    # Nobody listening: a full buffer loses nothing anyone asked for, so it is no drop either.
    exporter.capacity = 5
    for i in range(8):
        exporter.append(record(i))
    assert (exporter.unobserved, exporter.dropped) == (13, 0)
    run(exporter.export(publish))  # type: ignore[arg-type]
    assert (exporter.unobserved, exporter.dropped) == (18, 0)


def test_no_room_at_a_subscriber_drops_without_calling_publish() -> None:
    exporter = TopicExporter(NODE, can_send=lambda: False)
    exporter.append(record(0))
    run(exporter.export(raising(AssertionError("published without room"))))  # type: ignore[arg-type]
    assert (exporter.dropped, exporter.errors, exporter.exported) == (1, 0, 0)


def test_chunks_stay_under_the_limit_keep_order_and_skip_unpackable_records() -> None:
    exporter = TopicExporter(NODE, capacity=100_000)
    records = [record(i) for i in range(20_000)]
    for r in records[:7000]:
        exporter.append(r)
    exporter.append((*record(7000)[:10], object(), None))  # msgpack cannot encode it
    for r in records[7000:]:
        exporter.append(r)
    publish = Sent()
    run(exporter.export(publish))  # type: ignore[arg-type]
    assert len(publish.payloads) > 1
    assert all(len(p) <= 256 * 1024 for p in publish.payloads)
    decoded = [decode_spool(p) for p in publish.payloads]
    assert all(d.node == NODE and d.corrupt == 0 for d in decoded)
    assert [Record(*row) for d in decoded for row in d.rows] == records
    assert (exporter.exported, exporter.dropped) == (20_000, 1)


def test_the_recorder_feeds_the_exporter_the_records_the_spool_gets(tmp_path: Path) -> None:
    with SpoolWriter(tmp_path, NODE) as writer:
        recorder = Recorder(NODE, writer, sample_every=2, clock=lambda: 1.7e9)
        exporter = TopicExporter(NODE)
        recorder.exporter = exporter
        for _ in range(4):
            recorder.request("db", bytes(16), 0.001, 10, "ok")
        recorder.gauges({"peers": 2})
        assert exporter.buffered == writer.buffered == 3  # 2 sampled requests and a gauge
        assert exporter._buffer == writer._buffer
    alone = Recorder(NODE, sample_every=1)  # an exporter alone turns records on
    alone.exporter = exporter
    alone.serve("db", bytes(16), 0.001, 10, "ok")
    assert exporter.buffered == 4


# ----------------------------------------------------------------- the collector alone


def test_the_collector_writes_only_what_a_node_says_of_itself(tmp_path: Path) -> None:
    other = "cd" * 16
    collector = Collector(cast(irismesh.Node, None), tmp_path)  # handle() needs no node

    def message(topic_node: str, header_node: str, rows: list[Record], publisher: str) -> Message:
        body = b"".join(msgpack.packb(r) for r in rows)
        return Message(topic_for(topic_node), pack_header(header_node) + body, publisher)

    mine = [record(i) for i in range(5)]
    assert collector.handle(message(NODE, NODE, mine, NODE)) == 5
    # Publishing on another node's topic, or under its header, or records of another node:
    assert collector.handle(message(other, other, [record(0, other)], NODE)) == 0
    assert collector.handle(message(NODE, other, [record(0, other)], NODE)) == 0
    assert collector.handle(message(NODE, NODE, [record(5), record(6, other)], NODE)) == 1
    # Undecodable bytes after two good records: those two are kept, the rest is corrupt.
    broken = message(NODE, NODE, [record(7), record(8)], NODE)
    broken = Message(broken.topic, broken.payload + b"\xc1garbage", NODE)
    assert collector.handle(broken) == 2
    assert (collector.rejected, collector.corrupt) == (3, 1)

    async def stop() -> None:
        stats = await collector.stop()
        assert stats.nodes == {NODE: 8}
        assert stats.files == 1

    run(stop())
    [path] = complete_files(tmp_path)
    assert path.name == f"{NODE}-00000000.msgpack"
    records, corrupt = read_spool_file(path)
    assert corrupt == 0
    assert records == [record(i) for i in range(9) if i != 6]
