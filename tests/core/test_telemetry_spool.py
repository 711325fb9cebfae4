"""The telemetry schema and spool: records round-trip, files appear whole, nothing blocks.

Pure file I/O on tmp_path; no Spark, no pyarrow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from irismesh.telemetry.schema import (
    BASE_FIELDS,
    FIELD_NAMES,
    FIELDS,
    Kind,
    Outcome,
    Record,
    check_record,
)
from irismesh.telemetry.spool import (
    HEADER_KEY,
    SpoolReader,
    SpoolWriter,
    complete_files,
    decode_spool,
    read_spool_file,
    salvage,
    spool_file_name,
)

NODE = "ab" * 16


def request(i: int, **changes: Any) -> Record:
    record = Record(
        1_700_000_000.0 + i / 1000,
        NODE,
        Kind.REQUEST,
        "reqrep",
        "db",
        "cd" * 16,
        250 + i,
        100,
        Outcome.OK,
        1,
    )
    return record._replace(**changes)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def files_in(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# ------------------------------------------------------------------------------------ schema


def test_the_record_tuple_and_the_field_table_agree() -> None:
    assert Record._fields == FIELD_NAMES
    assert len(FIELDS) == 14
    assert FIELD_NAMES[BASE_FIELDS:] == ("node_name", "peer_name")
    defaults = Record(1.0, NODE, "gauge")
    assert check_record(list(defaults)) == defaults
    assert (defaults.weight, defaults.outcome, defaults.pattern) == (1, "", "")


def test_the_schema_and_the_spool_import_without_pyspark_or_pyarrow() -> None:
    code = (
        "import sys, irismesh.telemetry.schema, irismesh.telemetry.spool\n"
        "bad = [m for m in ('pyspark', 'pyarrow', 'pandas') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("index", "value"),
    [
        (0, "yesterday"),  # ts
        (0, None),
        (0, float("nan")),
        (1, None),  # node is required
        (1, b"bytes"),
        (2, 7),
        (6, 2.5),  # latency_us is an integer
        (6, True),  # bool is not an integer here
        (6, 2**64),  # beyond int64
        (9, 0),  # weight must be >= 1
        (9, None),
        (11, "high"),
        (12, 7),  # node_name is text
        (13, b"w1"),
    ],
)
def test_check_record_refuses_wrong_types(index: int, value: Any) -> None:
    row = list(request(1))
    row[index] = value
    assert check_record(row) is None


def test_check_record_accepts_nulls_ints_for_floats_and_extra_fields() -> None:
    row = list(request(1, peer=None, latency_us=None, size=None))
    row[0] = 1_700_000_000  # an integer timestamp
    record = check_record([*row, "a field from a newer writer"])
    assert record is not None
    assert record.ts == 1_700_000_000.0
    assert isinstance(record.ts, float)
    assert check_record(row[: BASE_FIELDS - 1]) is None  # a missing field
    assert check_record({"ts": 1.0}) is None
    # An older writer's record, without the fields appended since: they read as None.
    assert check_record(row[:BASE_FIELDS]) == record
    assert record.node_name is None


# ------------------------------------------------------------------------------------ writer


def test_records_round_trip_and_files_appear_only_when_complete(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, NODE)
    records = [request(i) for i in range(100)]
    for record in records:
        assert writer.append(record)
    assert writer.flush() == 100
    # Written, but the file is still the hidden temporary one.
    assert complete_files(tmp_path) == []
    assert all(name.startswith(".") and name.endswith(".tmp") for name in files_in(tmp_path))
    assert list(SpoolReader(tmp_path)) == []
    writer.close()
    assert files_in(tmp_path) == [spool_file_name(NODE, 0)]
    reader = SpoolReader(tmp_path)
    assert list(reader) == records
    assert (reader.files, reader.records, reader.corrupt) == (1, 100, 0)


def test_a_typical_record_is_small_on_disk(tmp_path: Path) -> None:
    with SpoolWriter(tmp_path, NODE) as writer:
        for i in range(1000):
            writer.append(request(i))
    # About 105 B: two 32-digit hex ids (node, peer) are 68 of them.
    assert writer.bytes_written / 1000 < 120


def test_rotation_by_size_keeps_every_record_in_order(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, NODE, max_bytes=2000)
    records = [request(i) for i in range(300)]
    for chunk in range(0, 300, 20):
        for record in records[chunk : chunk + 20]:
            writer.append(record)
        writer.flush()
    writer.close()
    names = [p.name for p in complete_files(tmp_path)]
    assert len(names) == writer.files_completed > 5
    assert names == sorted(names)
    assert list(SpoolReader(tmp_path)) == records


def test_rotation_by_age(tmp_path: Path) -> None:
    clock = FakeClock()
    writer = SpoolWriter(tmp_path, NODE, max_age=10.0, clock=clock)
    writer.append(request(1))
    writer.flush()
    clock.now = 9.9
    writer.flush()
    assert complete_files(tmp_path) == []
    clock.now = 10.0
    writer.flush()  # nothing new to write, but the file is old: complete it
    assert len(complete_files(tmp_path)) == 1
    clock.now = 100.0
    writer.flush()  # no current file: nothing to complete, no empty file made
    assert len(complete_files(tmp_path)) == 1
    assert writer.rotate() is None


def test_a_full_buffer_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, NODE, capacity=10)
    accepted = [writer.append(request(i)) for i in range(15)]
    assert accepted == [True] * 10 + [False] * 5
    assert (writer.dropped, writer.buffered) == (5, 10)
    assert writer.flush() == 10
    assert writer.append(request(99))  # room again after a flush
    writer.close()
    assert not writer.append(request(100))  # closed: dropped and counted, never raised
    assert writer.dropped == 6
    assert len(list(SpoolReader(tmp_path))) == 11


def test_disk_errors_drop_and_count_and_the_writer_recovers(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    writer = SpoolWriter(spool, NODE)
    spool.rmdir()
    spool.write_bytes(b"")  # a file where the directory was: nothing can be written
    writer.append(request(1))
    assert writer.flush() == 0  # no exception into the node's timer
    assert (writer.dropped, writer.write_errors) == (1, 1)
    assert isinstance(writer.last_error, OSError)
    spool.unlink()  # gone entirely: the writer makes the directory again
    writer.append(request(2))
    assert writer.flush() == 1
    writer.close()
    assert [r.latency_us for r in SpoolReader(spool)] == [request(2).latency_us]


def test_unpackable_values_lose_only_their_own_record(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, NODE)
    writer.append(request(1))
    writer.append(request(2, name=object()))  # type: ignore[arg-type]
    writer.append(request(3))
    writer.close()
    assert [r.latency_us for r in SpoolReader(tmp_path)] == [251, 253]
    assert (writer.written, writer.dropped) == (2, 1)


def test_a_restarted_writer_continues_the_sequence(tmp_path: Path) -> None:
    for round_ in range(3):
        with SpoolWriter(tmp_path, NODE) as writer:
            writer.append(request(round_))
    other = "ef" * 16
    with SpoolWriter(tmp_path, other) as writer:
        writer.append(request(9, node=other))
    names = [p.name for p in complete_files(tmp_path)]
    expected = [spool_file_name(NODE, seq) for seq in range(3)] + [spool_file_name(other, 0)]
    assert names == sorted(expected)


def test_concurrent_appends_while_flushing_lose_nothing(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, NODE, capacity=1_000_000, max_bytes=50_000)
    per_thread, threads = 5_000, 4
    stop = threading.Event()

    def produce(t: int) -> None:
        for i in range(per_thread):
            writer.append(request(i, size=t))

    def flush_loop() -> None:
        while not stop.is_set():
            writer.flush()

    flusher = threading.Thread(target=flush_loop)
    flusher.start()
    producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join()
    stop.set()
    flusher.join()
    writer.close()
    records = list(SpoolReader(tmp_path))
    assert len(records) == per_thread * threads
    assert writer.dropped == 0
    for t in range(threads):  # each producer's records stay in its own order
        mine = [r.latency_us for r in records if r.size == t]
        assert mine == [250 + i for i in range(per_thread)]


@pytest.mark.parametrize("node", ["", "a/b", ".hidden"])
def test_bad_node_names_are_refused(tmp_path: Path, node: str) -> None:
    with pytest.raises(ValueError, match="node"):
        SpoolWriter(tmp_path, node)


# ------------------------------------------------------------------------------------ reader


def write_raw(directory: Path, name: str, objects: list[Any], tail: bytes = b"") -> Path:
    path = directory / name
    path.write_bytes(b"".join(msgpack.packb(o, use_bin_type=True) for o in objects) + tail)
    return path


def test_the_reader_skips_and_counts_corrupt_records(tmp_path: Path) -> None:
    good = [list(request(i)) for i in range(3)]
    header = {HEADER_KEY: 1, "node": NODE, "fields": list(FIELD_NAMES)}
    bad_type = list(request(9))
    bad_type[6] = "slow"
    write_raw(tmp_path, spool_file_name(NODE, 0), [header, good[0], bad_type, [1, 2], good[1]])
    # A truncated last record: the file of a writer that crashed mid-write, salvaged.
    truncated = msgpack.packb(good[2])[:-5]
    write_raw(tmp_path, spool_file_name(NODE, 1), [header, good[2]], tail=truncated)
    # Garbage in the middle: msgpack cannot resynchronise, the rest of the file is lost.
    write_raw(tmp_path, spool_file_name(NODE, 2), [header, good[0]], tail=b"\xc1" + b"x" * 50)
    reader = SpoolReader(tmp_path)
    records = list(reader)
    assert [r.latency_us for r in records] == [250, 251, 252, 250]
    assert reader.corrupt == 2 + 1 + 1
    assert reader.files == 3


def test_other_files_and_temporary_ones_are_not_read(tmp_path: Path) -> None:
    write_raw(tmp_path, "." + spool_file_name(NODE, 0) + ".tmp", [list(request(1))])
    write_raw(tmp_path, "notes.txt", [1])
    write_raw(tmp_path, "x.msgpack", [list(request(1))])  # not <node>-<seq>
    (tmp_path / "sub").mkdir()
    assert complete_files(tmp_path) == []


def test_a_header_maps_fields_by_name(tmp_path: Path) -> None:
    # An older writer without `value`, with its fields in another order, plus one we lack.
    theirs = [f for f in FIELD_NAMES if f != "value"]
    theirs = [theirs[1], theirs[0], *theirs[2:], "future"]
    header = {HEADER_KEY: 1, "node": NODE, "fields": theirs}
    mine = request(5)._asdict()
    row = [mine.get(name, "?") for name in theirs]
    write_raw(tmp_path, spool_file_name(NODE, 0), [header, row, row[:3]])
    records, corrupt = read_spool_file(tmp_path / spool_file_name(NODE, 0))
    assert records == [request(5)]
    assert corrupt == 1


def test_files_without_a_header_are_read_in_field_order(tmp_path: Path) -> None:
    write_raw(tmp_path, spool_file_name(NODE, 0), [list(request(1)), list(request(2))])
    assert [r.latency_us for r in SpoolReader(tmp_path)] == [251, 252]


def test_spools_of_writers_older_than_node_names_still_load(tmp_path: Path) -> None:
    old = [list(request(i))[:BASE_FIELDS] for i in range(3)]
    header = {HEADER_KEY: 1, "node": NODE, "fields": list(FIELD_NAMES[:BASE_FIELDS])}
    write_raw(tmp_path, spool_file_name(NODE, 0), [header, *old])
    write_raw(tmp_path, spool_file_name(NODE, 1), old)  # and without a header
    named = request(3, node_name="db-1", peer_name="w2")
    write_raw(tmp_path, spool_file_name(NODE, 2), [list(named)])
    reader = SpoolReader(tmp_path)
    assert list(reader) == [request(i) for i in (0, 1, 2, 0, 1, 2)] + [named]
    assert reader.corrupt == 0


def test_salvage_completes_stale_temporary_files_only(tmp_path: Path) -> None:
    crashed = SpoolWriter(tmp_path, NODE)
    crashed.append(request(1))
    crashed.flush()  # on disk under its temporary name; the process "dies" here
    live = SpoolWriter(tmp_path, "ef" * 16)
    live.append(request(2))
    live.flush()
    stale = tmp_path / ("." + spool_file_name(NODE, 0) + ".tmp")
    os.utime(stale, (0, 0))
    assert salvage(tmp_path, older_than=60) == [tmp_path / spool_file_name(NODE, 0)]
    assert [r.latency_us for r in SpoolReader(tmp_path)] == [251]
    live.close()


# ------------------------------------------------------------------------------------ properties

texts = st.text(max_size=12)
records = st.builds(
    Record,
    ts=st.floats(0, 4e9, allow_nan=False),
    node=st.sampled_from([NODE, "ef" * 16]),
    kind=st.sampled_from(list(Kind)).map(str),
    pattern=texts,
    cluster=st.none() | texts,
    peer=st.none() | texts,
    latency_us=st.none() | st.integers(-(2**63), 2**63 - 1),
    size=st.none() | st.integers(0, 2**40),
    outcome=st.sampled_from(list(Outcome)).map(str),
    weight=st.integers(1, 10_000),
    name=st.none() | texts,
    value=st.none() | st.floats(allow_nan=False),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=st.lists(records, max_size=60), max_bytes=st.integers(200, 5000))
def test_any_records_round_trip_in_order_per_node(
    tmp_path_factory: pytest.TempPathFactory, batch: list[Record], max_bytes: int
) -> None:
    spool = tmp_path_factory.mktemp("spool")
    writers = {n: SpoolWriter(spool, n, max_bytes=max_bytes) for n in (NODE, "ef" * 16)}
    for i, record in enumerate(batch):
        writers[record.node].append(record)
        if i % 7 == 0:
            writers[record.node].flush()
    for writer in writers.values():
        writer.close()
    read = list(SpoolReader(spool))
    for node in writers:
        assert [r for r in read if r.node == node] == [r for r in batch if r.node == node]


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400))
@example(data=b"\x81\x91\x01\x02")  # a map keyed by a list: unhashable
@example(data=b"\x91" * 5000)  # deep nesting
def test_decoding_arbitrary_bytes_never_raises(data: bytes) -> None:
    contents = decode_spool(data)
    assert contents.corrupt >= 0
    for row in contents.rows:
        check_record(row)  # may refuse, never raises
