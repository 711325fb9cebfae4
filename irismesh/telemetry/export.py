"""Telemetry over the mesh: nodes publish their records, `mesh telemetry collect` spools them.

Export without shared disks: a node's `TopicExporter` gets the same sampled records as its
spool writer and publishes them on its own reserved topic `_mesh.telemetry.<node hex id>`; a
`Collector` on any one machine subscribes to `_mesh.telemetry.*` and writes each origin node's
records through a `SpoolWriter` of its own, so the directory it fills is exactly what the
nodes would have spooled locally: the same file names (`<origin>-<seq>.msgpack`), the same
header, the same record encoding, complete files only. The compactor and Spark read it like
any other spool directory.

Theory of operation
-------------------
Exporting. `TopicExporter.append` is the hot path, called by the `Recorder` for each record
it makes: it puts the record (the very tuple the spool writer gets, so it costs one list slot)
on a bounded list, or drops and counts it when the list is full. It never blocks.

The node calls `export(publish)` every gauge interval from its telemetry loop. When no other
node subscribes to the exporter's topic, export discards the buffered records (counted as
`unobserved`, which is not a loss: nobody asked for them; so is a full buffer's overflow while
nobody subscribes) without packing anything, so a mesh without a collector pays one list
append per record and one interest lookup per interval.
Otherwise it packs the records into chunks of at most `chunk_bytes` (256 KiB), each chunk the
bytes of a small spool file (`spool.pack_header` then the records packed one after the other
by `spool.pack_records`, the same code the spool writer uses), and publishes them in order.
A chunk carries its own header, so the collector maps fields by name exactly as a reader of
an older or newer node's file does.

Export never waits for a slow collector and never raises into the node. Before each chunk it
asks `can_send()` (no subscriber of the topic is out of flow-control credit); when one is,
the remaining chunks are dropped and counted instead of published, because a publish that
waits for credit would hold the node's publish queue, and the application's own publishes
with it. Every publish also runs under an overall deadline of `timeout` seconds, and any
exception from it (SlowConsumer, Closed, NoKey, any MeshError, even a bug) drops the rest of
the batch, is counted in `errors` and kept in `last_error`. Records lost this way are counted
in `dropped`, and `on_drop` reports them to the node's recorder as a `drop` record named
`telemetry_export`, so the loss shows in the node's own telemetry.

Collecting. The collector subscribes with policy "block": nothing is dropped on its side. A
collector that falls behind stops granting credit; exporters see that through `can_send()`
and drop and count on their side, never waiting. The loss is therefore counted where it
happens, in each node's `dropped` and its `drop` records, while the collector's own buffer
stays bounded (maxsize plus one flow-control window per exporting node). Messages lost in
transit (a link that died) are counted in the subscription's `missed`.

A message is accepted only from its own origin: its topic must be `_mesh.telemetry.<P>` and
its header's node `P`, where `P` is the publisher the link authenticated, and each record's
`node` field must be `P` too; anything else is counted in `rejected` and not written, so one
node cannot write records into another's files. Records are otherwise written as they came:
their types are checked by whoever reads the spool (`check_record`, Spark's decoder), by the
same rule as for a local spool. A message that does not decode counts as `corrupt` records.

The writers are flushed off the event loop every `flush_interval` seconds (and sooner when a
writer's buffer is half full, before reading more); they complete a file when it passes
`max_bytes` or `max_age`. `stop()` first handles the messages already received, then closes
every writer, so every file is complete.

Do not point a collector at a directory where the same nodes spool locally: both would write
`<node>-<seq>.msgpack` files with the same names.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import msgpack

from irismesh._core.topics import validate_topic
from irismesh.errors import ConfigurationError
from irismesh.telemetry.spool import (
    RecordBuffer,
    SpoolWriter,
    check_node_name,
    decode_spool,
    pack_header,
    pack_records,
)

if TYPE_CHECKING:
    import os

    from irismesh.patterns.pubsub import Message, Policy, Subscription
    from irismesh.telemetry.recorder import Recorder

__all__ = [
    "CHUNK_BYTES",
    "COLLECT_PATTERN",
    "EXPORT_DROP",
    "TOPIC_PREFIX",
    "TOPIC_SCOPE",
    "CollectStats",
    "Collector",
    "Publish",
    "TopicExporter",
    "attach_exporter",
    "exporter_for",
    "topic_for",
]

TOPIC_SCOPE: Final = "_mesh"  # the keyring scope the records are sealed under (else '*')
TOPIC_PREFIX: Final = "_mesh.telemetry"
COLLECT_PATTERN: Final = TOPIC_PREFIX + ".*"
CHUNK_BYTES: Final = 256 * 1024
EXPORT_DROP: Final = "telemetry_export"  # the `name` of the drop records an exporter causes
DEFAULT_TIMEOUT: Final = 0.5
_PACK_INLINE: Final = 2048  # more records than this are packed in a thread
_FIRST_GUESS: Final = 1024  # records in a first chunk, before their size is known
_NODE_FIELD: Final = 1  # index of `node` in schema.FIELDS


def topic_for(node: str) -> str:
    """The reserved topic on which node `node` (hex id) publishes its records."""
    return f"{TOPIC_PREFIX}.{node}"


class Publish(Protocol):
    """`Node.publish` (or anything called the same way)."""

    def __call__(self, topic: str, payload: bytes, *, timeout: float) -> Awaitable[int]: ...


class TelemetrySource(Protocol):
    """What an exporter needs of a node's telemetry (`NodeTelemetry` is one)."""

    @property
    def node_id(self) -> bytes: ...

    @property
    def recorder(self) -> Recorder: ...

    @property
    def max_payload(self) -> int: ...

    def has_subscribers(self, topic: str) -> bool: ...

    def can_send(self, topic: str) -> bool: ...


class ExportingNode(Protocol):
    """A node whose telemetry can be exported (`irismesh.Node` is one)."""

    @property
    def telemetry(self) -> TelemetrySource | None: ...


class SubscribingNode(Protocol):
    """A node a collector can subscribe through (`irismesh.Node` is one)."""

    def subscribe(
        self, pattern: str, *, policy: Policy = ..., maxsize: int = ...
    ) -> Subscription: ...


# ------------------------------------------------------------------------------------ export


class TopicExporter(RecordBuffer):
    """A node's records, published on `_mesh.telemetry.<node>`; see the module docstring.

    `has_subscribers()` says whether some node subscribes to the topic (None: assume one
    does); `can_send()` whether every subscriber can take a message now (None: assume so);
    `on_drop(count)` hears of records lost, once per export. `dropped` counts the records
    lost: buffer full, unpackable, no room, publish failed.
    """

    def __init__(
        self,
        node: str,
        *,
        capacity: int = 65_536,
        chunk_bytes: int = CHUNK_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        has_subscribers: Callable[[], bool] | None = None,
        can_send: Callable[[], bool] | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        check_node_name(node)
        if capacity <= 0 or chunk_bytes <= 0 or not timeout > 0:
            raise ValueError("capacity, chunk_bytes and timeout must be positive")
        super().__init__(capacity)
        self.node = node
        self.topic = validate_topic(topic_for(node))
        self._header = pack_header(node)
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self._has_subscribers = has_subscribers
        self._can_send = can_send
        self._on_drop = on_drop
        # Whether some node subscribed at the last export: a full buffer loses records only
        # if so (else they count as unobserved, and make no `drop` record).
        self._observed = has_subscribers is None
        self._export_lock: asyncio.Lock | None = None  # one export at a time
        self._reported = 0  # drops already handed to on_drop
        self.exported = 0  # records published to at least one subscriber
        self.unobserved = 0  # records nobody subscribed to, discarded (not a loss)
        self.messages = 0  # chunks published to at least one subscriber
        self.errors = 0  # publishes that raised
        self.last_error: BaseException | None = None

    def __repr__(self) -> str:
        return (
            f"<TopicExporter {self.topic} buffered={len(self._buffer)} "
            f"exported={self.exported} dropped={self.dropped}>"
        )

    # ---------------------------------------------------------------- hot path

    def append(self, record: Sequence[Any]) -> bool:
        """Buffer one record (a tuple in FIELDS order); False, and counted, if it was dropped."""
        buffer = self._buffer
        if len(buffer) >= self.capacity:
            if self._observed:
                self._count_dropped(1)
            else:
                with self._drop_lock:
                    self.unobserved += 1
            return False
        buffer.append(record)
        return True

    # ---------------------------------------------------------------- export

    async def export(self, publish: Publish) -> int:
        """Publish the records buffered so far; how many reached a subscriber. Never raises
        (but for cancellation): what could not be published is dropped and counted."""
        if self._export_lock is None:
            self._export_lock = asyncio.Lock()
        async with self._export_lock:
            try:
                return await self._export(publish)
            finally:
                self._report_drops()

    async def _export(self, publish: Publish) -> int:
        buffer = self._buffer
        count = len(buffer)
        if self._has_subscribers is not None:
            self._observed = self._has_subscribers()
        if not count:
            return 0
        # Copy then delete the same prefix: a record appended meanwhile (by another thread)
        # lands after it and stays for the next export.
        batch = buffer[:count]
        del buffer[:count]
        if not self._observed:
            with self._drop_lock:
                self.unobserved += count
            return 0
        loop = asyncio.get_running_loop()
        if count > _PACK_INLINE:  # tens of milliseconds: let the loop run meanwhile
            chunks, lost = await loop.run_in_executor(None, self.pack, batch)
        else:
            chunks, lost = self.pack(batch)
        self._count_dropped(lost)
        deadline = time.monotonic() + self.timeout
        exported = 0
        for index, (payload, records) in enumerate(chunks):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self._can_send is not None and not self._can_send()):
                self._count_dropped(sum(n for _, n in chunks[index:]))
                break
            try:
                async with asyncio.timeout(remaining):
                    reached = await publish(self.topic, payload, timeout=remaining)
            except Exception as exc:  # telemetry must never break the node
                self.errors += 1
                self.last_error = exc
                self._count_dropped(sum(n for _, n in chunks[index:]))
                break
            if not reached:  # the subscribers left meanwhile
                with self._drop_lock:
                    self.unobserved += sum(n for _, n in chunks[index:])
                break
            self.messages += 1
            exported += records
        self.exported += exported
        return exported

    def pack(self, batch: Sequence[Sequence[Any]]) -> tuple[list[tuple[bytes, int]], int]:
        """Chunks of `batch`, each a spool header and records (at most `chunk_bytes` unless
        one record alone is larger), with their record counts; and how many records could
        not be packed. Safe to call from a thread."""
        packer = msgpack.Packer(use_bin_type=True)
        header = self._header
        room = max(1, self.chunk_bytes - len(header))  # 1: a record a chunk, however tiny
        chunks: list[tuple[bytes, int]] = []
        lost = 0
        start, size = 0, _FIRST_GUESS
        while start < len(batch):
            part = batch[start : start + size]
            body, packed = pack_records(packer, part)
            if len(body) > room and len(part) > 1:  # too many: retry with fewer
                size = max(1, len(part) * room * 9 // (len(body) * 10))
                continue
            lost += len(part) - packed
            if packed:
                chunks.append((b"".join((header, body)), packed))
            start += len(part)
            if body:  # as many as should fit, going by these records' sizes
                size = max(1, len(part) * room * 9 // (len(body) * 10))
        return chunks, lost

    def _report_drops(self) -> None:
        new = self.dropped - self._reported
        if new > 0 and self._on_drop is not None:
            self._reported = self.dropped
            self._on_drop(new)


def attach_exporter(
    node: ExportingNode,
    *,
    capacity: int = 65_536,
    chunk_bytes: int = CHUNK_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
) -> TopicExporter:
    """The exporter of `node`'s telemetry, fed by its recorder (made on the first call).

    The node's telemetry loop then calls `await exporter.export(node.publish)` every gauge
    interval. Interest and credit are read from the node's core when export runs, so this may
    be called before or after `node.start()`. Raises ConfigurationError if the node records
    no telemetry (telemetry=False).
    """
    source = node.telemetry
    if source is None:
        raise ConfigurationError("this node records no telemetry (telemetry=False)")
    return exporter_for(source, capacity=capacity, chunk_bytes=chunk_bytes, timeout=timeout)


def exporter_for(
    source: TelemetrySource,
    *,
    capacity: int = 65_536,
    chunk_bytes: int = CHUNK_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
) -> TopicExporter:
    """`attach_exporter` for a node's telemetry itself."""
    recorder = source.recorder
    existing = recorder.exporter
    if isinstance(existing, TopicExporter):
        return existing
    topic = topic_for(source.node_id.hex())

    def on_drop(count: int) -> None:
        recorder.drop(EXPORT_DROP, count)

    exporter = TopicExporter(
        source.node_id.hex(),
        capacity=capacity,
        chunk_bytes=min(chunk_bytes, source.max_payload),
        timeout=timeout,
        has_subscribers=lambda: source.has_subscribers(topic),
        can_send=lambda: source.can_send(topic),
        on_drop=on_drop,
    )
    recorder.exporter = exporter
    return exporter


# ------------------------------------------------------------------------------------ collect


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectStats:
    """What a collector has done so far."""

    directory: str
    nodes: dict[str, int]  # records written per origin node (hex id)
    records: int  # records handed to the writers
    messages: int  # messages received
    files: int  # spool files completed
    bytes: int  # bytes written
    corrupt: int  # records that did not decode
    rejected: int  # records that claimed another origin than their publisher
    missed: int  # messages lost in transit (gaps in a publisher's stream)
    dropped: int  # records the writers could not write (buffer full, disk errors)
    write_errors: int
    last_error: str | None  # the last disk error, if any


class Collector:
    """Writes the records every node publishes into spool files in `directory`.

    `async with Collector(node, "spool") as collector: ...` (or `await start()` and
    `await stop()`); `stats()` says how far it got. See the module docstring.
    """

    def __init__(
        self,
        node: SubscribingNode,
        directory: str | os.PathLike[str],
        *,
        policy: Policy = "block",
        maxsize: int = 64,
        max_bytes: int = 4 * 1024 * 1024,
        max_age: float = 10.0,
        capacity: int = 262_144,
        flush_interval: float = 0.5,
        pattern: str = COLLECT_PATTERN,
    ) -> None:
        if not flush_interval > 0:
            raise ValueError("flush_interval must be positive")
        self.node = node
        self.directory = Path(directory)
        self.policy: Policy = policy
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.capacity = capacity
        self.flush_interval = flush_interval
        self.pattern = pattern
        self.writers: dict[str, SpoolWriter] = {}
        self.records: dict[str, int] = {}  # written, per origin
        self.messages_from: dict[str, int] = {}  # messages received, per origin
        self.messages = 0
        self.corrupt = 0
        self.rejected = 0
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_lock = asyncio.Lock()
        self._flush_due = False
        self._stopped = False

    async def __aenter__(self) -> Collector:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> Collector:
        """Subscribe and start writing; raises OSError if the directory cannot be made."""
        if self._sub is not None:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sub = self.node.subscribe(self.pattern, policy=self.policy, maxsize=self.maxsize)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read(self._sub)),
            loop.create_task(self._flush_every(self.flush_interval)),
        ]
        return self

    async def stop(self) -> CollectStats:
        """Handle what has arrived, unsubscribe, and complete every file."""
        if self._stopped:
            return self.stats()
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sub = self._sub
        if sub is not None:
            while (message := sub.get_nowait()) is not None:
                self.handle(message)
            sub.close()
        async with self._flush_lock:
            writers = list(self.writers.values())
            await asyncio.get_running_loop().run_in_executor(None, _close_all, writers)
        return self.stats()

    # ---------------------------------------------------------------- receiving

    def handle(self, message: Message) -> int:
        """Write one message's records; how many were accepted."""
        self.messages += 1
        origin = message.publisher
        self.messages_from[origin] = self.messages_from.get(origin, 0) + 1
        contents = decode_spool(message.payload)
        self.corrupt += contents.corrupt
        rows = contents.rows
        if message.topic != topic_for(origin) or contents.node != origin:
            self.rejected += len(rows)  # a node speaks for itself only
            return 0
        mine = [row for row in rows if row[_NODE_FIELD] == origin]
        self.rejected += len(rows) - len(mine)
        if not mine:
            return 0
        writer = self.writers.get(origin) or self._writer(origin)
        accepted = sum(1 for row in mine if writer.append(row))
        self.records[origin] = self.records.get(origin, 0) + accepted
        if writer.buffered >= writer.capacity // 2:
            self._flush_due = True
        return accepted

    def _writer(self, origin: str) -> SpoolWriter:
        writer = self.writers[origin] = SpoolWriter(
            self.directory,
            origin,
            max_bytes=self.max_bytes,
            max_age=self.max_age,
            capacity=self.capacity,
        )
        self.records.setdefault(origin, 0)
        return writer

    async def _read(self, sub: Subscription) -> None:
        async for message in sub:
            self.handle(message)
            if self._flush_due:  # write before reading more: the exporters wait meanwhile
                await self.flush()

    async def _flush_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.flush()

    async def flush(self) -> None:
        """Write what the writers buffer, off the event loop, completing full or old files."""
        async with self._flush_lock:
            self._flush_due = False
            writers = list(self.writers.values())
            if writers:
                await asyncio.get_running_loop().run_in_executor(None, _flush_all, writers)

    # ---------------------------------------------------------------- reporting

    def stats(self) -> CollectStats:
        writers = list(self.writers.values())
        errors = [w.last_error for w in writers if w.last_error is not None]
        return CollectStats(
            directory=str(self.directory),
            nodes=dict(self.records),
            records=sum(self.records.values()),
            messages=self.messages,
            files=sum(w.files_completed for w in writers),
            bytes=sum(w.bytes_written for w in writers),
            corrupt=self.corrupt,
            rejected=self.rejected,
            missed=self._sub.missed if self._sub is not None else 0,
            dropped=sum(w.dropped for w in writers),
            write_errors=sum(w.write_errors for w in writers),
            last_error=str(errors[-1]) if errors else None,
        )


def _flush_all(writers: Iterable[SpoolWriter]) -> None:
    for writer in writers:
        writer.flush()


def _close_all(writers: Iterable[SpoolWriter]) -> None:
    for writer in writers:
        writer.close()
