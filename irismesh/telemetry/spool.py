"""The node-side spool: telemetry records appended to rotating msgpack files, and their reader.

Theory of operation
-------------------
Recording sits on the node's hot path, so `SpoolWriter.append` does the least possible: it
puts the record (a tuple in `schema.FIELDS` order) on an in-memory list and returns. When the
list holds `capacity` records, append drops the record and counts it in `dropped` instead:
telemetry never blocks messaging and never grows without bound.

The owner calls `flush()` every second or so (the node's gauge timer, or a thread). flush
packs the buffered records with msgpack and appends them to the *current file*, which lives
under a temporary, hidden name `.<node>-<seq>.msgpack.tmp`. When the current file passes
`max_bytes`, or is older than `max_age` seconds, flush completes it: the file is closed and
`os.rename`d to `<node>-<seq>.msgpack`. A rename within one directory is atomic, so readers
(the compactor, Spark's file stream) only ever see complete files, and the leading dot keeps
Spark and glob from listing the temporary one. `close()` flushes and completes.

A file is a sequence of msgpack objects: one header map, then records as positional arrays:

    {"irismesh_spool": 1, "node": "<hex>", "fields": ["ts", "node", ...]}
    [ts, node, kind, pattern, cluster, peer, latency_us, size, outcome, weight, name, value,
     node_name, peer_name]
    ...

The header names the fields in the order the writer used, so a reader maps the columns of an
older or newer writer by name (missing nullable fields become None, missing required ones
their defaults). Files without a header are read in `FIELDS` order, a record that ends before
the fields appended after the first `BASE_FIELDS` with None there. `pack_header` and
`pack_records` are the one encoding of both: the exporter (`irismesh.telemetry.export`) uses
them too, so each chunk of records a node publishes is the bytes of a small spool file.

`read_spool_file` decodes one file. A record that is not an array of the right shape and types
is skipped and counted as corrupt; bytes that cannot be decoded at all (a truncated tail from
a crash, garbage) end the file and count as one corrupt record, since msgpack cannot
resynchronise. `salvage()` completes temporary files left behind by a crashed writer.

Threads: `append` may be called from any thread (list operations are atomic under the GIL);
`flush`, `rotate` and `close` take a lock, so one owner thread and any number of recording
threads can share a writer. Nothing here knows about asyncio.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import msgpack

from irismesh.telemetry.schema import BASE_FIELDS, FIELD_NAMES, FIELDS, Record, check_record

__all__ = [
    "HEADER_KEY",
    "SPOOL_SUFFIX",
    "SpoolContents",
    "SpoolReader",
    "SpoolWriter",
    "check_node_name",
    "complete_files",
    "decode_spool",
    "gc_paused",
    "pack_header",
    "pack_records",
    "read_spool_file",
    "salvage",
    "spool_file_name",
]

SPOOL_SUFFIX: Final = ".msgpack"
TEMP_SUFFIX: Final = ".msgpack.tmp"
HEADER_KEY: Final = "irismesh_spool"
FORMAT_VERSION: Final = 1
_COMPLETE = re.compile(r"^(?P<node>[^./][^/]*)-(?P<seq>\d+)\.msgpack$")
_SEQ_DIGITS: Final = 8


def _array_header_size(length: int) -> int:
    """Bytes of a msgpack array header: fixarray, array 16 or array 32."""
    return 1 if length < 16 else 3 if length < 1 << 16 else 5


def check_node_name(node: str) -> None:
    """Raise ValueError unless `node` can name spool files and topics (a hex id, in practice)."""
    if not node or "/" in node or node.startswith("."):
        raise ValueError(f"node must be a plain name such as a hex id, got {node!r}")


def spool_file_name(node: str, seq: int) -> str:
    """The name of a complete spool file; zero-padded so names sort by sequence."""
    return f"{node}-{seq:0{_SEQ_DIGITS}d}{SPOOL_SUFFIX}"


def pack_header(node: str) -> bytes:
    """The header that starts every spool file (and every exported chunk of records)."""
    header = {HEADER_KEY: FORMAT_VERSION, "node": node, "fields": list(FIELD_NAMES)}
    data: bytes = msgpack.packb(header, use_bin_type=True)
    return data


def pack_records(
    packer: msgpack.Packer, records: Sequence[Sequence[Any]]
) -> tuple[bytes | memoryview, int]:
    """`records` packed one after the other, as a spool file holds them, and how many that is:
    a record holding a value msgpack cannot encode is left out (the others are kept)."""
    count = len(records)
    try:
        # Packing the batch as one array is one C call instead of one per record; without the
        # array's header, the bytes are exactly those of its items packed one by one.
        return memoryview(packer.pack(records))[_array_header_size(count) :], count
    except (TypeError, ValueError, OverflowError):
        packed = []
        for record in records:
            with contextlib.suppress(TypeError, ValueError, OverflowError):
                packed.append(packer.pack(record))
        return b"".join(packed), len(packed)


def _temp_name(node: str, seq: int) -> str:
    return "." + spool_file_name(node, seq) + ".tmp"


class RecordBuffer:
    """A bounded list of records that any thread may append to; `dropped` counts the records
    it had to refuse (a spool writer's, an exporter's)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buffer: list[Sequence[Any]] = []
        self._drop_lock = threading.Lock()  # the drop counters only; never held across I/O
        self.dropped = 0

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def _count_dropped(self, count: int) -> None:
        # `+=` is a read and a write: two threads dropping at once could lose a count.
        if count:
            with self._drop_lock:
                self.dropped += count


class SpoolWriter(RecordBuffer):
    """Appends records to rotating spool files in `directory`; see the module docstring.

    `dropped` counts the records refused because the buffer was full or the disk failed.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        node: str,
        *,
        max_bytes: int = 4 * 1024 * 1024,
        max_age: float = 10.0,
        capacity: int = 65_536,
        fsync: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_node_name(node)
        if max_bytes <= 0 or max_age <= 0 or capacity <= 0:
            raise ValueError("max_bytes, max_age and capacity must be positive")
        super().__init__(capacity)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.node = node
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.fsync = fsync
        self._clock = clock
        self._lock = threading.Lock()  # flush, rotate, close: one at a time
        self._packer = msgpack.Packer(use_bin_type=True)
        self._file: IO[bytes] | None = None
        self._file_bytes = 0
        self._file_opened = 0.0
        self._seq = self._next_free_seq()
        self._closed = False
        self.written = 0  # records handed to the OS
        self.files_completed = 0
        self.bytes_written = 0
        self.write_errors = 0
        self.last_error: OSError | None = None

    # ---------------------------------------------------------------- hot path

    def append(self, record: Sequence[Any]) -> bool:
        """Buffer one record (a tuple in FIELDS order); False, and counted, if it was dropped."""
        buffer = self._buffer
        if len(buffer) >= self.capacity or self._closed:
            self._count_dropped(1)
            return False
        buffer.append(record)
        return True

    # ---------------------------------------------------------------- owner side

    def flush(self) -> int:
        """Write the buffered records, completing the current file if it is full or old.

        Returns the number of records written. Never raises for I/O errors: they drop the
        records concerned, count them and keep the error in `last_error`.
        """
        with self._lock:
            written = self._write_buffered()
            if self._file is not None and (
                self._file_bytes >= self.max_bytes
                or self._clock() - self._file_opened >= self.max_age
            ):
                self._complete()
            return written

    def rotate(self) -> Path | None:
        """Write the buffered records and complete the current file now; its final path."""
        with self._lock:
            self._write_buffered()
            return self._complete()

    def close(self) -> None:
        """Flush and complete the current file; later appends are dropped and counted."""
        with self._lock:
            if self._closed:
                return
            self._write_buffered()
            self._complete()
            self._closed = True

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _write_buffered(self) -> int:
        buffer = self._buffer
        count = len(buffer)
        if not count:
            return 0
        # Copy then delete the same prefix: a record appended meanwhile by another thread lands
        # after it and stays for the next flush.
        batch = buffer[:count]
        del buffer[:count]
        # A caller handed in a value msgpack cannot encode: lose that record, not the batch.
        data, packed = pack_records(self._packer, batch)
        self._count_dropped(count - packed)
        count = packed
        try:
            handle = self._file or self._open()
            handle.write(data)
            handle.flush()
        except OSError as exc:
            self._fail(exc, count)
            return 0
        self._file_bytes += len(data)
        self.bytes_written += len(data)
        self.written += count
        return count

    def _open(self) -> IO[bytes]:
        self.directory.mkdir(parents=True, exist_ok=True)  # recreated if someone removed it
        path = self.directory / _temp_name(self.node, self._seq)
        handle = open(path, "wb")  # noqa: SIM115  (kept open across flushes, closed in _complete)
        data = pack_header(self.node)
        handle.write(data)
        self._file = handle
        self._file_bytes = len(data)
        self._file_opened = self._clock()
        return handle

    def _complete(self) -> Path | None:
        handle = self._file
        if handle is None:
            return None
        self._file = None
        temp = self.directory / _temp_name(self.node, self._seq)
        final = self.directory / spool_file_name(self.node, self._seq)
        self._seq += 1
        try:
            handle.flush()
            if self.fsync:
                os.fsync(handle.fileno())
            handle.close()
            os.rename(temp, final)
        except OSError as exc:
            self._fail(exc, 0)
            return None
        self.files_completed += 1
        return final

    def _fail(self, exc: OSError, lost: int) -> None:
        self.write_errors += 1
        self._count_dropped(lost)
        self.last_error = exc
        if self._file is not None:
            # Start a fresh file next time rather than append after a partial write.
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
            self._seq += 1

    def _next_free_seq(self) -> int:
        """One past the highest sequence this node already has here (a restart continues)."""
        highest = -1
        for entry in os.listdir(self.directory):
            name = entry[1 : -len(".tmp")] if entry.endswith(TEMP_SUFFIX) else entry
            match = _COMPLETE.match(name)
            if match and match["node"] == self.node:
                highest = max(highest, int(match["seq"]))
        return highest + 1


# ------------------------------------------------------------------------------------ reading


@dataclass(frozen=True, slots=True, kw_only=True)
class SpoolContents:
    """What one spool file holds: its rows in FIELDS order (unchecked) and corrupt count."""

    rows: list[tuple[Any, ...]]
    corrupt: int
    node: str | None  # from the header, when there is one


def complete_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete spool files in `directory`, by name (temporary and other files skipped)."""
    base = Path(directory)
    return sorted(base / name for name in os.listdir(base) if _COMPLETE.match(name))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while a file's million small containers are built.

    Each allocation of a tracked container counts towards the next collection, and each
    collection walks every live one: decoding a large file with the GC on spends most of its
    time collecting garbage that does not exist. Reference counting still frees everything.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def decode_spool(data: bytes) -> SpoolContents:
    """Decode one spool file's bytes into rows in FIELDS order, without type checks.

    Rows come out as sequences of at least len(FIELDS) items (an older writer's, padded with
    None); a row of another shape is counted as corrupt here. Types are checked by the caller
    (`check_record`, or decode.py).
    """
    with gc_paused():
        objects, broken = _unpack(data)
    corrupt = 1 if broken else 0
    node: str | None = None
    if objects and isinstance(objects[0], dict) and HEADER_KEY in objects[0]:
        header = objects.pop(0)
        node = header["node"] if isinstance(header.get("node"), str) else None
        mapping = _mapping(header.get("fields"))
        if mapping is not None:
            objects = [_remap(obj, mapping) for obj in objects]
    width = len(FIELDS)
    if not objects or (set(map(type, objects)) == {tuple} and min(map(len, objects)) >= width):
        rows = objects  # the usual case, checked by two loops in C
    else:
        rows = [
            obj if len(obj) >= width else (*obj, *(None,) * (width - len(obj)))
            for obj in objects
            if type(obj) is tuple and len(obj) >= BASE_FIELDS
        ]
        corrupt += len(objects) - len(rows)
    return SpoolContents(rows=rows, corrupt=corrupt, node=node)


def _unpack(data: bytes) -> tuple[list[Any], bool]:
    """Every whole msgpack object in `data` (arrays as tuples), and whether some were lost."""
    unpacker = msgpack.Unpacker(
        raw=False, use_list=False, max_buffer_size=max(len(data), 1024), strict_map_key=False
    )
    unpacker.feed(data)
    try:
        objects = list(unpacker)  # one loop in C
    # FormatError, StackError, bad UTF-8 (ValueErrors), a list as a map key (TypeError), ...
    except (ValueError, TypeError, msgpack.UnpackException):
        return _unpack_until_broken(data), True
    # An object cut short (a crash mid-write) ends the iteration as quietly as the end of the
    # data does; but then the unpacker refuses raw reads, which tells the two apart.
    try:
        unpacker.read_bytes(1)
    except ValueError:
        return objects, True
    return objects, False


def _unpack_until_broken(data: bytes) -> list[Any]:
    """The objects before the first undecodable byte (msgpack cannot resynchronise)."""
    unpacker = msgpack.Unpacker(
        raw=False, use_list=False, max_buffer_size=max(len(data), 1024), strict_map_key=False
    )
    unpacker.feed(data)
    objects: list[Any] = []
    with contextlib.suppress(ValueError, TypeError, msgpack.UnpackException):
        for obj in unpacker:
            objects.append(obj)
    return objects


_DEFAULTS: Final = tuple(Record._field_defaults.get(name) for name in FIELD_NAMES)


def _mapping(fields: Any) -> list[int | None] | None:
    """Index of each of our fields in a writer's field list; None means "ours exactly"."""
    if not isinstance(fields, tuple) or fields[: len(FIELD_NAMES)] == FIELD_NAMES:
        return None  # no usable field list, or ours (a newer writer may append fields)
    position = {name: i for i, name in enumerate(fields) if isinstance(name, str)}
    return [position.get(name) for name in FIELD_NAMES]


def _remap(obj: Any, mapping: list[int | None]) -> Any:
    if type(obj) is not tuple:
        return obj
    try:
        return tuple(
            obj[i] if i is not None else default
            for i, default in zip(mapping, _DEFAULTS, strict=True)
        )
    except IndexError:
        return None  # shorter than the writer's own header says: corrupt


def read_spool_file(path: str | os.PathLike[str]) -> tuple[list[Record], int]:
    """The valid records of one spool file, and how many were corrupt."""
    contents = decode_spool(Path(path).read_bytes())
    records: list[Record] = []
    corrupt = contents.corrupt
    for row in contents.rows:
        record = check_record(row)
        if record is None:
            corrupt += 1
        else:
            records.append(record)
    return records, corrupt


class SpoolReader:
    """Iterates the records of every complete spool file in a directory, counting corrupt ones.

    The file list is taken when iteration starts; files completed later are not included.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.corrupt = 0
        self.files = 0
        self.records = 0

    def __iter__(self) -> Iterator[Record]:
        for path in complete_files(self.directory):
            try:
                records, corrupt = read_spool_file(path)
            except FileNotFoundError:
                continue  # compacted and moved away by someone else meanwhile
            self.files += 1
            self.corrupt += corrupt
            self.records += len(records)
            yield from records


def salvage(directory: str | os.PathLike[str], *, older_than: float = 60.0) -> list[Path]:
    """Complete temporary files not modified for `older_than` seconds (left by a crash).

    Their records are then read like any others; a truncated last record counts as corrupt.
    Only call this when no live writer can still be using such a file.
    """
    base = Path(directory)
    now = time.time()
    done: list[Path] = []
    for entry in os.listdir(base):
        if not (entry.startswith(".") and entry.endswith(TEMP_SUFFIX)):
            continue
        final_name = entry[1 : -len(".tmp")]
        if not _COMPLETE.match(final_name):
            continue
        temp = base / entry
        try:
            if now - temp.stat().st_mtime < older_than:
                continue
            os.rename(temp, base / final_name)
        except FileNotFoundError:
            continue
        done.append(base / final_name)
    return sorted(done)
