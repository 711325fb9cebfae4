"""Memory members and what callers say to them: the `_memory` cluster's protocol.

A node started with a memory directory serves the cluster `_memory` beside its own, with a
`MemoryStore` behind it. Callers reach every memory member at once with a survey (a retained
publish must be held by several of them, a reread must hear from all of them), so the protocol
is msgpack requests, each answered by every member:

    ["store", [[topic, payload, published_at, id], ...]]  ->  [stored, clock]
    ["latest", pattern, n, after]  ->  [[[topic, payload, published_at, id], ...], next]

    ["since", id]  ->  [[[topic, payload, published_at, id], ...], next]
    ["enqueue", [[id, cluster, payload, enqueued_at, expires_at], ...]]  ->  [held, clock]
    ["done", [id, ...], at]  ->  [forgotten]
    ["jobs", since, after]  ->  [[[id, cluster, payload, enqueued_at, expires_at], ...],
                                 [done id, ...], next]
    ["finished", since, after]  ->  [[[done_at, id], ...], next]

An answer to "since" holds messages with ids after `id`, oldest first, up to PAGE_BYTES, and
`next`, the id to ask after for more (None: no more): how a member that starts catches up with
what was stored while it was away. An answer to "latest" is one page: the paths after the
topic `after` (None: from the first), as many as fit in PAGE_BYTES, and `next`, the last topic
of the page, to ask for the next one (None: that was the last). A caller asks every member for
each page.

An answer to "jobs" holds the jobs waiting with ids after `after` (None: from the first),
oldest first, up to PAGE_BYTES (at least one), with the first page the ids of the jobs finished
since `since` (the newest of them, half a page at most; those left out are counted as
`jobs_answers_truncated`), and `next`, the id to ask after for more (None: no more). An answer
to "finished" holds the tombstones kept since `since` ordered after the tombstone `after`
([done_at, id]; None: from the first), by (done_at, id), oldest first, up to PAGE_BYTES, and
`next`, the last of them, to ask after for more (None: no more). A caller asks every member
for each page after the least `next` of their answers, until none has more, for _JOB_PAGES
pages and until a deadline at most. So a member that starts learns the tombstones of the
week (`catch_up_jobs`: a busy mesh finishes far more jobs in a week than one answer carries),
then copies the others' jobs, and the dispatcher gathers those it lacks (with the ids finished
since it asked: a handful). The tombstones keep their times where they are copied, so each
ends a week after its job was done wherever it is held.

The previous release knew only `["jobs", since]`, answered with every job it holds (up to
4096) and every id finished since `since`, and no `next`: a member still answers that form,
within PAGE_BYTES too: the jobs that fit, then the newest ids that fit in the room they leave
(a truncation counted as above; the jobs left out wait for a later look). A caller whose first
page of either paged request a member refused asks it that way (an answer without `next` is
all that member holds; the ids in it are dated when they were learnt).

Ids come from each node's hybrid logical clock (`store.clock_id`). A member takes the ids it
stores into its clock and answers a store or an enqueue with its clock (`clock`, an id; earlier
versions answered without it); a caller takes in that clock and every id it rereads. So a
retained message published after its publisher reread another, or after a member that held
the other answered it, orders after it whatever the machines' clocks say.

Every member stores every retained message: a publish returns once `replicas` of them (or all
there are, if fewer) have it on disk, so one crash loses nothing. A reread merges the members'
answers by message id, so a member that missed messages while it was down does not hide them,
and a member that starts again first copies what the others hold (`catch_up`).

The memory member with the lowest id among the live ones (the dispatcher) hands the jobs out,
those in its own store. An enqueue may reach only other members: the dispatcher had just
started again and copied their jobs a moment before the enqueuer knew of it, or its copy's
answer was lost. The others never hand out a job while a member with a lower id lives, so the
dispatcher asks them for the jobs they hold ("jobs") as it takes over and, while it has handed
out everything it holds, every GATHER_EVERY seconds: it takes on those it lacks (counted as
`jobs_gathered`) and tells them to forget those it finished (a "done" they missed). Asked only
while its own jobs are all in hand, the others' answers hold about as many jobs as that; a look
that stops early (its pages or its time used up) leaves the next one to go on from there.

Store access is serialised on one thread of the member's own (SQLite writes wait for the disk
and must not stall the node's loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, Generic, TypeVar

import msgpack

from irismesh._core.frames import MAX_TRACE
from irismesh._core.rights import Rights
from irismesh._core.topics import validate_pattern, validate_topic
from irismesh.errors import (
    Closed,
    ConfigurationError,
    MemberLost,
    MeshError,
    NoResponders,
    PayloadTooLarge,
    ProtocolError,
    RemoteError,
    RequestTimeout,
)
from irismesh.memory import MAX_LATEST, MEMORY_CLUSTER
from irismesh.memory.jobs import TOMBSTONE_KEEP, Job, JobStore, Tombstone
from irismesh.memory.store import (
    ID_SIZE,
    MemoryStore,
    Stored,
    clock_id,
    clock_state,
    id_time,
    memory_clock,
    message_id,
    observe_id,
    physical_us,
)

T = TypeVar("T")
C = TypeVar("C", bytes, Tombstone)  # a paged request's cursor: a job id or a tombstone

# A survey of the `_memory` cluster: (answers, errors, missing) by member, as Node.survey.
Survey = Callable[
    [bytes, float | None], Awaitable[tuple[dict[str, bytes], dict[str, MeshError], list[str]]]
]

_STORE, _LATEST, _SINCE = "store", "latest", "since"
_MAX_VERDICTS = 4096  # callers' rights decided, remembered at once
_ENQUEUE, _DONE, _JOBS, _FINISHED = "enqueue", "done", "jobs", "finished"
MAX_ATTEMPTS: Final = 5  # handler runs a job gets before it is set aside (dead-lettered)
DISPATCH_TIMEOUT: Final = 30.0  # seconds a dispatched job may take, at most
_IN_FLIGHT: Final = 64  # jobs a dispatcher has handled at once
_UNSURE_KEPT: Final = 65536  # jobs remembered as maybe run, for the repeats count
_Rows = list[tuple[str, bytes, float, bytes]]
_RETRY_AFTER: Final = 0.2  # seconds before a job that failed or found no member goes again
# Seconds between a dispatcher's looks at the jobs the other memory members hold (while it has
# handed out all it holds), and how long it waits for their answers.
GATHER_EVERY: Final = 2.0
_GATHER_TIMEOUT: Final = 5.0
# Pages (PAGE_BYTES each) of jobs, and of tombstones, that one catch-up or one look reads at
# most, and the seconds a starting member's catch-up on jobs (tombstones first) takes at most.
_JOB_PAGES: Final = 256
_JOBS_CATCH_UP_FOR: Final = 60.0
CATCH_UP_MARGIN: Final = 60.0  # seconds before its newest message a starting member asks from
_MAX_BATCH: Final = 4096
_GROUP: Final = 256  # store requests written in one transaction at most
_BATCH_BYTES: Final = 256 << 10  # payload a caller sends in one store or enqueue request
_ROW_ROOM: Final = 64  # a row's id, times and msgpack framing, at most
# Turns of the loop a batch stays open for more rows before it is sent. Publishers that one
# reply woke together do not all reach `_batched` in the same turn: the fairness of a
# publishing loop (`Turns.pause`) holds some back a turn. A batch sent at the first turn
# splits them in two requests, and a member with "fsync" waits for the disk once per write
# group, so twice where once would do (measured with 32 publishes in flight: 19 rows a
# commit on average; 32 with two turns). A turn costs microseconds, a sync 0.2-4 ms.
_BATCH_TURNS: Final = 2
_JOB_COUNTS: Final = ("jobs_enqueued", "jobs_enqueue_failed")
RETAINED_ROOM: Final = 4096  # what a retained payload leaves of a frame for its envelope
PAGE_BYTES: Final = 512 << 10  # an answer's payloads, well below a frame's limit
_ID_BYTES: Final = ID_SIZE + 2  # an id in msgpack (bin 8)
_TOMBSTONE_BYTES: Final = 1 + 9 + _ID_BYTES  # [done_at, id] in msgpack
_ANSWER_ROOM: Final = 64  # an answer's arrays' headers and cursor, at most
_FINISHED_PAGE: Final = (PAGE_BYTES - _ANSWER_ROOM) // _TOMBSTONE_BYTES  # tombstones a page
_PAGE_PATHS: Final = 256  # paths read from the store at a time while filling a page


def encode_store(messages: Iterable[tuple[str, bytes, float, bytes]]) -> bytes:
    rows = [[topic, payload, at, msg_id] for topic, payload, at, msg_id in messages]
    return _pack([_STORE, rows])


def encode_latest(pattern: str, latest: int, after: str | None = None) -> bytes:
    return _pack([_LATEST, pattern, latest, after])


def encode_since(after: bytes) -> bytes:
    return _pack([_SINCE, after])


def decode_page(answer: bytes) -> tuple[list[Stored], str | bytes | None]:
    """A member's answer to "latest": its page, and the topic to ask after for the next one
    (None: no more); ProtocolError if it is not one."""
    try:
        page = _unpack(answer)
    except ConfigurationError:
        raise ProtocolError("bad_body", "memory answer") from None
    if type(page) is not list or len(page) != 2 or type(page[0]) is not list:
        raise ProtocolError("bad_body", "memory answer")
    rows, following = page
    if following is not None and type(following) not in (str, bytes):
        raise ProtocolError("bad_body", "memory answer")
    out = []
    for row in rows:
        if not _is_row(row):
            raise ProtocolError("bad_body", "memory row")
        topic, payload, published_at, msg_id = row
        out.append(Stored(topic, payload, float(published_at), msg_id))
    return out, following


def merge(answers: Iterable[Sequence[Stored]], latest: int) -> list[Stored]:
    """Several members' answers as one: each path's `latest` newest messages (by id, each
    once), newest first, paths in topic order."""
    by_topic: dict[str, dict[bytes, Stored]] = {}
    for answer in answers:
        for stored in answer:
            by_topic.setdefault(stored.topic, {})[stored.id] = stored
    out: list[Stored] = []
    for topic in sorted(by_topic):
        newest = sorted(by_topic[topic].values(), key=lambda s: s.id, reverse=True)
        out.extend(newest[:latest])
    return out


class MemoryMember:
    """The member's side: a store, and the answers to what callers ask of it."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        # The node's clock for the memory's ids (NodeMemory shares its own); this machine's
        # wall clock in microseconds (tests skew it).
        self.clock = memory_clock(b"")
        self.physical: Callable[[], int] = physical_us
        self.jobs = JobStore(self.store)
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="irismesh-memory")
        # Group commit: stores and enqueues that arrive while one group is written wait, and
        # go in the next group together (one flush to disk for each kind in it).
        self._writes: list[tuple[_Rows, list[Job], asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        # Called on the loop once jobs were written: the dispatcher wakes.
        self.on_jobs: Callable[[], None] | None = None
        # Callers' rights, decided (`refused`): (rights, right, name) -> allowed.
        self._verdicts: dict[tuple[Rights, str, str], bool] = {}
        self.stats: Counter[str] = Counter()  # requests it could not read, dropped

    async def serve(self, payload: bytes) -> bytes:
        """One request to `_memory`, on the node's loop: stores and enqueues are written in
        groups on the member's store thread, reads run there one at a time."""
        request = _unpack(payload)
        if type(request) is list and len(request) == 2 and request[0] in (_STORE, _ENQUEUE):
            rows, jobs = (
                (_rows(request[1]), []) if request[0] == _STORE else ([], _jobs(request[1]))
            )
            newest = max([row[3] for row in rows] + [job.id for job in jobs], default=b"")
            observe_id(self.clock, newest, self.physical())
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            self._writes.append((rows, jobs, done))
            if self._writer is None or self._writer.done():
                self._writer = loop.create_task(self._write())
            await done
            return _pack([len(rows) + len(jobs), clock_state(self.clock)])
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.handle, payload)

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        while self._writes:
            batch, self._writes = self._writes[:_GROUP], self._writes[_GROUP:]
            try:
                await loop.run_in_executor(self.pool, self._put, batch)
            except MeshError as exc:
                if len(batch) > 1:  # one bad request must not fail the others: one at a time
                    for each in batch:
                        await self._write_one(each)
                else:
                    done = batch[0][2]
                    if not done.done():
                        done.set_exception(exc)
            else:
                for write in batch:
                    if not write[2].done():
                        write[2].set_result(None)
            if self.on_jobs is not None and any(write[1] for write in batch):
                self.on_jobs()

    async def _write_one(self, write: tuple[_Rows, list[Job], asyncio.Future[None]]) -> None:
        done = write[2]
        try:
            await asyncio.get_running_loop().run_in_executor(self.pool, self._put, [write])
        except MeshError as exc:
            if not done.done():
                done.set_exception(exc)
        else:
            if not done.done():
                done.set_result(None)

    def _put(self, batch: list[tuple[_Rows, list[Job], asyncio.Future[None]]]) -> None:
        rows = [row for group, _jobs, _done in batch for row in group]
        jobs = [job for _rows, group, _done in batch for job in group]
        with self._lock:
            if rows:
                self.store.put_many(rows)
            if jobs:
                self.jobs.add(jobs)

    def refused(self, payload: bytes, rights: Rights) -> tuple[str, str] | None:
        """What request `payload` asks that a caller with `rights` (its verified grant's) may
        not have, as (name, right); None if nothing (a malformed request is `serve`'s to
        refuse). Retaining needs `publish` for each topic, rereading `subscribe` for the
        pattern, enqueueing `call` for each job's cluster; the members' own requests (copying,
        handing out and finishing jobs) need the `memory` right, which allows everything.
        Verdicts are remembered by (rights, right, name): a publisher's retained messages
        cost one check per topic, not one each."""
        if rights.memory:
            return None
        try:
            request = _unpack(payload)
        except ConfigurationError:
            return None
        if type(request) is not list or len(request) < 2:
            return None
        op = request[0]
        if op in (_STORE, _ENQUEUE):
            right, at = ("publish", 0) if op == _STORE else ("call", 1)
            rows = request[1] if type(request[1]) is list else []
            for row in rows:
                name = row[at] if type(row) is list and len(row) > at else None
                if type(name) is str and not self._allowed(rights, right, name):
                    return name, right
            return None
        if op == _LATEST:
            pattern = request[1]
            if type(pattern) is str and not self._allowed(rights, "subscribe", pattern):
                return pattern, "subscribe"
            return None
        return MEMORY_CLUSTER, "memory"

    def _allowed(self, rights: Rights, right: str, name: str) -> bool:
        key = (rights, right, name)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if right == "publish":
                verdict = rights.may_publish(name)
            elif right == "call":
                verdict = rights.may_call(name)
            else:
                verdict = rights.may_subscribe(name)
            if len(self._verdicts) >= _MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict

    def handle(self, payload: bytes) -> bytes:
        """One request to `_memory` other than a store (in the member's store thread)."""
        request = _unpack(payload)
        if type(request) is not list or not request:
            raise ConfigurationError("a memory request is a msgpack array: [op, ...]")
        op = request[0]
        if op == _LATEST and len(request) == 4 and type(request[1]) is str:
            _op, pattern, latest, after = request
            if type(latest) is not int or not 1 <= latest <= MAX_LATEST:
                raise ConfigurationError(f"latest must be 1 to {MAX_LATEST}, not {latest!r}")
            if after is not None and type(after) is not str:
                raise ConfigurationError("latest's `after` is a topic or nil")
            return _pack_page(*self.page(pattern, latest, after))
        if op == _DONE and len(request) == 3 and type(request[1]) is list:
            ids = [i for i in request[1] if type(i) is bytes and len(i) == ID_SIZE]
            with self._lock:
                return _pack([self.jobs.finish(ids, float(request[2]))])
        if op == _FINISHED and len(request) == 3 and type(request[1]) in (int, float):
            return self._finished_page(float(request[1]), request[2])
        if op == _JOBS and len(request) == 2 and type(request[1]) in (int, float):
            return self._jobs_at_once(float(request[1]))
        if op == _JOBS and len(request) == 3 and type(request[1]) in (int, float):
            return self._jobs_page(float(request[1]), request[2])
        if op == _SINCE and len(request) == 2 and type(request[1]) is bytes:
            with self._lock:
                return _pack_page(*self.store.since(request[1], PAGE_BYTES))
        self.stats["requests_malformed"] += 1
        raise ConfigurationError(f"unknown memory request {op!r}")

    def _finished_page(self, since: float, after: Any) -> bytes:
        """An answer to "finished": the tombstones kept since `since` after the tombstone
        `after` (nil: from the first), oldest first, as many as fit in PAGE_BYTES."""
        try:
            mark = _tombstone(after)
        except ConfigurationError:
            self.stats["requests_malformed"] += 1
            raise
        with self._lock:
            found = self.jobs.tombstones(since, _FINISHED_PAGE + 1, mark)
        following = list(found[_FINISHED_PAGE - 1]) if len(found) > _FINISHED_PAGE else None
        return _pack([[list(t) for t in found[:_FINISHED_PAGE]], following])

    def _jobs_page(self, since: float, after: Any) -> bytes:
        """An answer to "jobs": the jobs held after id `after` (nil: from the first) and,
        with the first page, the ids finished since `since` (the newest half a page of them at
        most: a caller of this release asks "finished" for them instead)."""
        if after is not None and not (type(after) is bytes and len(after) == ID_SIZE):
            self.stats["requests_malformed"] += 1
            raise ConfigurationError("jobs' `after` is a job id or nil")
        done: list[bytes] = []
        cut = False
        with self._lock:
            # A later page's jobs are those still held when it is read: no ids with it.
            if after is None:
                done, cut = self._newest_finished(since, PAGE_BYTES // 2)
            room = PAGE_BYTES - _ids_size(len(done))
            held, following = self.jobs.page(after or b"", room, _MAX_BATCH)
        rows = _job_rows(held)
        if done:  # a first job larger than the room left takes it from the oldest ids
            fits = _ids_fitting(PAGE_BYTES - len(_pack(rows)))
            if fits < len(done):
                cut, done = True, done[len(done) - fits :]
        if cut:
            self.stats["jobs_answers_truncated"] += 1
        return _pack([rows, done, following])

    def _jobs_at_once(self, since: float) -> bytes:
        """An answer to the previous release's "jobs", all at once as it expects: the jobs
        held, then the newest ids finished since `since`, as many as fit in PAGE_BYTES."""
        with self._lock:
            held, left_out = self.jobs.page(b"", PAGE_BYTES, _MAX_BATCH)
            rows = _job_rows(held)
            done, cut = self._newest_finished(since, PAGE_BYTES - len(_pack(rows)))
        if cut or left_out is not None:  # what was left out waits for a later look
            self.stats["jobs_answers_truncated"] += 1
        return _pack([rows, done])

    def _newest_finished(self, since: float, room: int) -> tuple[list[bytes], bool]:
        """The ids of the jobs finished last since `since` that fit in `room` bytes of an
        answer, oldest first, for the forms of "jobs" that carry them at once, and whether some
        were left out: a member that was away a short while needs the newest."""
        fits = _ids_fitting(room)
        done = self.jobs.newest_tombstones(since, fits + 1)
        if len(done) > fits:
            return done[1:], True
        return done, False

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` on the member's store thread, under its lock."""

        def locked() -> T:
            with self._lock:
                return call(*args)

        return await asyncio.get_running_loop().run_in_executor(self.pool, locked)

    def page(self, pattern: str, latest: int, after: str | None) -> tuple[list[Stored], str | None]:
        """The paths after `after` whose messages fit in PAGE_BYTES (at least one message),
        and the topic to ask after next (None: these were the last)."""
        rows: list[Stored] = []
        size = 0
        cursor = after
        while True:
            with self._lock:
                chunk = self.store.latest(pattern, latest, after=cursor, paths=_PAGE_PATHS)
            if not chunk:
                return rows, None
            for stored in chunk:
                grown = size + len(stored.payload) + len(stored.topic) + 64
                if rows and grown > PAGE_BYTES and stored.topic != rows[-1].topic:
                    return rows, rows[-1].topic
                rows.append(stored)
                size = grown
            cursor = chunk[-1].topic

    def absorb(self, answers: Iterable[Sequence[Stored]]) -> int:
        """What other members hold, copied here (catching up after a restart); how many
        messages were new."""
        rows = [(s.topic, s.payload, s.published_at, s.id) for answer in answers for s in answer]
        observe_id(self.clock, max((row[3] for row in rows), default=b""), self.physical())
        added = 0
        with self._lock:
            for start in range(0, len(rows), _MAX_BATCH):
                added += self.store.put_many(rows[start : start + _MAX_BATCH])
        return added

    def figures(self) -> Mapping[str, int]:
        with self._lock:
            return {**self.store.figures(), **self.jobs.figures(), **self.stats}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self._lock:
            self.store.close()


class NodeMemory:
    """A node's side of the memory: its retained publishes and rereads, and, on a memory
    member, its own store (which counts as one of the replicas and answers as one member)."""

    def __init__(
        self,
        node_id: bytes,
        survey: Survey,
        *,
        replicas: int = 2,
        member: MemoryMember | None = None,
        max_payload: int = 1 << 20,
    ) -> None:
        if type(replicas) is not int or replicas < 1:
            raise ConfigurationError(f"replicas must be a positive integer, not {replicas!r}")
        self.replicas = replicas
        self.member = member
        # A retained message travels again in rereads, with its topic and id beside it.
        self.max_retained = max_payload - RETAINED_ROOM
        self.stats: Counter[str] = Counter()
        self._node_id = node_id
        self._survey = survey
        # The clock of this node's ids, shared with its member; `physical` is this machine's
        # wall clock in microseconds (tests skew it).
        self.clock = memory_clock(node_id)
        self.physical: Callable[[], int] = physical_us
        if member is not None:
            member.clock = self.clock
            member.physical = lambda: self.physical()
        self._pool = member.pool if member is not None else None
        self._wake: asyncio.Event | None = None  # the dispatcher's: a job came, or room
        self._dispatching: set[asyncio.Task[None]] = set()
        # Jobs whose last hand-out ended without an answer it could trust (a timeout, a lost
        # member): it may have run, so handing it out again is a repeat (insertion-ordered).
        self._unsure: dict[bytes, None] = {}
        # Handled jobs waiting to be forgotten, and the task that forgets them.
        self._finished: list[tuple[bytes, asyncio.Future[None]]] = []
        self._finisher: asyncio.Task[None] | None = None
        # Where the dispatcher's next look at the others' jobs goes on (None: from the first).
        self._gather_from: bytes | None = None
        # Rows asked for in this turn of the loop, by kind and timeout, sent together.
        self._batches: dict[tuple[str, float | None], _Batch] = {}

    async def retain(self, topic: str, payload: bytes, timeout: float | None) -> bytes:
        """Store a message with the memory members; its id once `replicas` of them (or every
        member there is, if fewer) hold it. Raises NoResponders with no memory member."""
        topic = validate_topic(topic)
        if len(payload) > self.max_retained:
            raise PayloadTooLarge(len(payload), self.max_retained)
        msg_id = clock_id(self.clock, self.physical())
        row = [topic, payload, time.time(), msg_id]
        await self._batched(_STORE, row, len(payload) + len(topic) + _ROW_ROOM, timeout)
        return msg_id

    async def enqueue(
        self,
        cluster: str,
        payload: bytes,
        expiry: float,
        timeout: float | None,
        trace: bytes = b"",
    ) -> bytes:
        """Hold a job for `cluster` with the memory members; its id once `replicas` of them (or
        every member there is, if fewer) hold it. Its `trace` context (b"": none) is held with
        it, and its run continues that trace."""
        if not expiry > 0:
            raise ConfigurationError(f"expiry must be positive seconds, not {expiry!r}")
        if len(payload) > self.max_retained:
            raise PayloadTooLarge(len(payload), self.max_retained)
        job_id = clock_id(self.clock, self.physical())
        now = time.time()
        row: list[Any] = [job_id, cluster, payload, now, now + expiry]
        if trace:
            row.append(trace)
        size = len(payload) + len(cluster) + len(trace) + _ROW_ROOM
        await self._batched(_ENQUEUE, row, size, timeout)
        if self._wake is not None:
            self._wake.set()
        return job_id

    async def _batched(self, op: str, row: list[Any], size: int, timeout: float | None) -> None:
        """Have the memory members hold one row (a retained message or a job), in one request
        with the rows of the same kind and timeout asked for in the same _BATCH_TURNS turns of
        the loop (a batch ends at _BATCH_BYTES of payload or _MAX_BATCH rows): concurrent
        publishers share a survey and the members' commit."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        key = (op, timeout)
        batch = self._batches.get(key)
        full = batch is not None and len(batch.rows) >= _MAX_BATCH
        if batch is not None and (full or batch.size + size > _BATCH_BYTES):
            self._send_batch(key)
            batch = None
        if batch is None:
            batch = self._batches[key] = _Batch()
            loop.call_soon(self._send_after, _BATCH_TURNS - 1, key, batch)
        batch.rows.append(row)
        batch.waiting.append(done)
        batch.size += size
        await done

    def _send_after(self, turns: int, key: tuple[str, float | None], batch: _Batch) -> None:
        """Send `batch` once `turns` more turns of the loop went by (sooner if it filled)."""
        if turns > 0 and self._batches.get(key) is batch:
            asyncio.get_running_loop().call_soon(self._send_after, turns - 1, key, batch)
        else:
            self._send_batch(key, batch)

    def _send_batch(self, key: tuple[str, float | None], batch: _Batch | None = None) -> None:
        if batch is not None and self._batches.get(key) is not batch:
            return  # sent already (it was full)
        batch = self._batches.pop(key, None)
        if batch is not None:
            task = self._track(self._hold_batch(key[0], key[1], batch))
            # Cancelled (the node closes), started or not: its callers must not wait forever.
            task.add_done_callback(lambda _: _settle(batch.waiting, Closed("node closed")))

    async def _hold_batch(self, op: str, timeout: float | None, batch: _Batch) -> None:
        done, failed = ("retained", "retained_failed") if op == _STORE else _JOB_COUNTS
        try:
            await self._hold(_pack([op, batch.rows]), timeout, done, failed, len(batch.rows))
        except RemoteError as exc:
            if len(batch.rows) == 1:
                _settle(batch.waiting, exc)
                return
            # A member refused the batch (a row it cannot store): each row on its own, so
            # that one bad row fails only its own publish.
            self.stats["memory_batches_split"] += 1
            for row, waiting in zip(batch.rows, batch.waiting, strict=True):
                single = _Batch()
                single.rows.append(row)
                single.waiting.append(waiting)
                await self._hold_batch(op, timeout, single)
        except MeshError as exc:
            _settle(batch.waiting, exc)
        else:
            _settle(batch.waiting, None)

    async def _hold(
        self, request: bytes, timeout: float | None, done: str, failed: str, rows: int = 1
    ) -> None:
        """Have the memory members hold what `request` carries (`rows` rows): done once
        `replicas` of them (or every one there is, if fewer) answered; counted under `done` and
        `failed`, and copies short of `replicas` under `done` + "_underreplicated"."""
        try:
            answers, errors, missing = await self._ask(request, timeout)
            if not answers:
                raise _failure(errors, missing, timeout)
        except RemoteError:
            if rows == 1:
                self.stats[failed] += 1
            raise  # a batch is split and tried again row by row
        except MeshError:
            self.stats[failed] += rows
            raise
        if len(answers) < min(self.replicas, len(answers) + len(errors) + len(missing)):
            self.stats[done + "_underreplicated"] += rows
        self.stats[done] += rows
        for answer in answers.values():
            try:
                held = _unpack(answer)
            except ConfigurationError:
                continue  # counted as held: the member said it holds it, not what it saw
            if type(held) is list and len(held) == 2 and type(held[1]) is bytes:
                self.observe(held[1])

    def observe(self, msg_id: bytes) -> None:
        """Take an id this node saw into its clock (counting one too far ahead to adopt)."""
        observe_id(self.clock, msg_id, self.physical())
        if self.clock.refused_ahead:  # the member's refusals included (the clock is shared)
            self.stats["memory_ids_refused_ahead"] = self.clock.refused_ahead

    # ----------------------------------------------------------------- dispatching

    async def dispatch(
        self,
        request: Callable[[str, bytes, bytes, float, bytes], Awaitable[bytes]],
        peers: Callable[[], list[bytes]],
    ) -> None:
        """A memory member's dispatcher loop: while it is the live memory member with the
        lowest id, it hands the held jobs to their clusters, `_IN_FLIGHT` at a time, and
        tells every member to forget each job once a member of its cluster has handled it.
        Another member takes over when it is gone (at least once: a job handled but not yet
        forgotten goes again, which the handler must bear). It takes on the jobs only the
        others hold as it takes over, and again every GATHER_EVERY seconds while it has handed
        out all it holds (`_gather_jobs`)."""
        member = self.member
        if member is None:
            return
        self._wake = wake = asyncio.Event()
        member.on_jobs = wake.set
        busy: set[bytes] = set()
        next_expiry = 0.0
        next_gather = 0.0  # monotonic time of the next look at the others' jobs
        gathering: asyncio.Task[None] | None = None
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_RETRY_AFTER * 2):
                    await wake.wait()
            wake.clear()
            now = time.time()
            if now >= next_expiry:  # every member drops its own: nobody tells it of them
                next_expiry = now + 1.0
                await member.run(member.jobs.expire, now)
            others = peers()
            if any(peer < self._node_id for peer in others):
                next_gather = 0.0  # when its turn comes, it looks at once
                continue  # another member dispatches
            room = _IN_FLIGHT - len(busy)
            if room <= 0:
                continue
            jobs = await member.run(member.jobs.pending, room, set(busy))
            for job in jobs:
                busy.add(job.id)
                self._track(self._dispatch_one(job, request, busy, wake))
            # All it holds is in hand: a job another member holds besides waits for nobody.
            if (
                len(jobs) < room
                and others
                and time.monotonic() >= next_gather
                and (gathering is None or gathering.done())
            ):
                next_gather = time.monotonic() + GATHER_EVERY
                gathering = self._track(self._gather_jobs(wake))

    async def _dispatch_one(
        self,
        job: Job,
        request: Callable[[str, bytes, bytes, float, bytes], Awaitable[bytes]],
        busy: set[bytes],
        wake: asyncio.Event,
    ) -> None:
        member = self.member
        assert member is not None
        try:
            left = job.expires_at - time.time()
            if left <= 0:
                return  # expire() drops it
            if job.id in self._unsure:  # its last run may have happened: this is a repeat
                self.stats["jobs_redelivered"] += 1
            try:
                timeout = min(DISPATCH_TIMEOUT, left)
                await request(job.cluster, job.id, job.payload, timeout, job.trace)
            except (RequestTimeout, MemberLost):
                self._unsure[job.id] = None  # it may have run, its answer lost
                while len(self._unsure) > _UNSURE_KEPT:
                    del self._unsure[next(iter(self._unsure))]
                self.stats["jobs_retried"] += 1
                await asyncio.sleep(_RETRY_AFTER)
                return
            except RemoteError:
                dead = job.attempts + 1 >= MAX_ATTEMPTS
                self.stats["jobs_failed"] += 1
                await member.run(member.jobs.attempted, job.id, dead)
                await asyncio.sleep(_RETRY_AFTER)
                return
            except MeshError:
                self.stats["jobs_retried"] += 1  # no member in time, overloaded: again later
                await asyncio.sleep(_RETRY_AFTER)
                return
            self._unsure.pop(job.id, None)
            await self._finish(job.id)
            self.stats["jobs_done"] += 1
        finally:
            busy.discard(job.id)
            wake.set()

    async def _gather_jobs(self, wake: asyncio.Event) -> None:
        """The dispatcher takes on the jobs the other memory members hold and it does not
        (`wake` set if there were any), and tells them to forget those it finished: a page at
        a time, from where its last look stopped (one look reads _JOB_PAGES pages at most, in
        _GATHER_TIMEOUT seconds)."""
        member = self.member
        assert member is not None

        async def take(jobs: list[Job], _finished: list[Tombstone]) -> None:
            now = time.time()
            # One past its expiry (by this machine's clock) is not taken on.
            fresh = {job.id: job for job in jobs if job.expires_at > now}
            if not fresh:
                return
            finished = await member.run(member.jobs.finished, list(fresh))
            for job_id in finished:
                del fresh[job_id]
            added = await member.run(member.jobs.add, list(fresh.values())) if fresh else 0
            if added:
                self.stats["jobs_gathered"] += added
                self.observe(max(fresh))
                wake.set()
            if finished:
                self._track(self._tell_done(finished, time.time()))

        deadline = asyncio.get_running_loop().time() + _GATHER_TIMEOUT
        with contextlib.suppress(MeshError):  # the store failed: the next look goes again
            # Tombstones from now on only: those it lacks cost a repeat at most, not a loss.
            self._gather_from = await self._job_pages(
                time.time(), self._gather_from, _GATHER_TIMEOUT, deadline, take
            )

    async def _finish(self, job_id: bytes) -> None:
        """Forget a handled job here, then at the other memory members: together with the
        jobs handled meanwhile (one write and one survey for all of them)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._finished.append((job_id, done))
        if self._finisher is None or self._finisher.done():
            self._finisher = self._track(self._finish_all())
        await done

    async def _finish_all(self) -> None:
        member = self.member
        assert member is not None
        while self._finished:
            batch, self._finished = self._finished, []
            ids = [job_id for job_id, _done in batch]
            now = time.time()
            try:
                await member.run(member.jobs.finish, ids, now)
            except MeshError as exc:
                for _id, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for _id, done in batch:
                if not done.done():
                    done.set_result(None)
            self._track(self._tell_done(ids, now))

    async def _tell_done(self, ids: list[bytes], now: float) -> None:
        with contextlib.suppress(MeshError):  # a member that misses it learns at catch-up
            await self._survey(_pack([_DONE, ids, now]), DISPATCH_TIMEOUT)

    def _track(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._dispatching.add(task)
        task.add_done_callback(self._dispatching.discard)
        return task

    async def catch_up_jobs(self, timeout: float) -> int:
        """A member that starts learns which jobs the others finished in the week their ids are
        kept (their tombstones), then holds the jobs they hold, a page at a time (`timeout`
        seconds for each, _JOB_PAGES pages of each and _JOBS_CATCH_UP_FOR seconds in all at
        most; one that stops short is counted as `jobs_catch_up_incomplete`); how many jobs it
        took on. Jobs finished while it catches up reach it as any member, in a "done"."""
        member = self.member
        if member is None:
            return 0
        added = 0

        async def take(jobs: list[Job], finished: list[Tombstone]) -> None:
            nonlocal added
            if finished:  # first: a job finished elsewhere is not taken on (`add`)
                await member.run(member.jobs.finished_at, finished, time.time())
            if jobs:
                self.observe(max(job.id for job in jobs))
                taken = await member.run(member.jobs.add, jobs)
                self.stats["jobs_caught_up"] += taken
                added += taken

        deadline = asyncio.get_running_loop().time() + _JOBS_CATCH_UP_FOR
        week = time.time() - TOMBSTONE_KEEP
        _mark, learnt = await self._paged(_finished_request(week), None, timeout, deadline, take)
        # The tombstones are known: the jobs' pages need only those finished from now on.
        now = time.time()
        _after, copied = await self._paged(_jobs_request(now), None, timeout, deadline, take)
        if not (learnt and copied):
            self.stats["jobs_catch_up_incomplete"] += 1
        return added

    async def _job_pages(
        self,
        since: float,
        after: bytes | None,
        timeout: float,
        deadline: float,
        take: Callable[[list[Job], list[Tombstone]], Awaitable[None]],
    ) -> bytes | None:
        """The jobs the other memory members hold after id `after` (None: from the first),
        with the first page the ids of those they finished since `since`, handed to `take` a
        page at a time (`_paged`); where to go on (None: that was all)."""
        following, _complete = await self._paged(
            _jobs_request(since), after, timeout, deadline, take
        )
        return following

    async def _paged(
        self,
        pages: _PagedRequest[C],
        after: C | None,
        timeout: float,
        deadline: float,
        take: Callable[[list[Job], list[Tombstone]], Awaitable[None]],
    ) -> tuple[C | None, bool]:
        """What the other memory members answer to a paged request ("jobs" or "finished")
        from `after` on (None: from the first), handed to `take` a page at a time: every
        member is asked for each page (from the same cursor, the least any of them would go
        on from), until none has more, _JOB_PAGES pages were read, the loop's time passed
        `deadline` or no member answered. A member that refuses the first page (of a previous
        release) is asked instead for all it holds at once, the form it knows. Where to go on
        (None: that was all), and whether every member's every page was read."""
        loop = asyncio.get_running_loop()
        complete = True
        answered_whole: set[str] = set()  # refused the first page, answered the old way
        for _page in range(_JOB_PAGES):
            left = min(timeout, deadline - loop.time())
            if left <= 0:
                return after, False
            try:
                answers, errors, missing = await self._survey(pages.ask(after), left)
                whole: dict[str, bytes] = {}
                if after is None and any(isinstance(e, RemoteError) for e in errors.values()):
                    whole = await self._whole_jobs(pages.since, errors, deadline, timeout)
                    answered_whole.update(whole)
            except NoResponders:
                return after, after is None and complete  # no other member: nothing to read
            except MeshError:
                return after, False  # none answered: where it stopped
            complete = complete and not missing and answered_whole.issuperset(errors)
            jobs: dict[bytes, Job] = {}
            finished: dict[bytes, float] = {}
            cursors: list[C] = []
            now = time.time()
            for answer, read in [(a, pages.read) for a in answers.values()] + [
                (a, pages.whole) for a in whole.values()
            ]:
                try:
                    rows, done, following = read(answer, now)
                except ProtocolError:
                    self.stats["memory_answers_malformed"] += 1
                    complete = False
                    continue
                if following is not None and after is not None and following <= after:
                    self.stats["memory_answers_malformed"] += 1  # it would go on for ever
                    complete = False
                    continue
                jobs.update((job.id, job) for job in rows)
                finished.update((t.id, t.done_at) for t in done)
                if following is not None:
                    cursors.append(following)
            tombstones = [Tombstone(done_at, job_id) for job_id, done_at in finished.items()]
            await take(list(jobs.values()), tombstones)
            if not cursors:
                return None, complete
            after = min(cursors)
        return after, False

    async def _whole_jobs(
        self, since: float, refused: Mapping[str, MeshError], deadline: float, timeout: float
    ) -> dict[str, bytes]:
        """The answers of the members that refused a "jobs" request with a page's cursor (the
        previous release's, which answer all their jobs at once, the form they know)."""
        left = min(timeout, deadline - asyncio.get_running_loop().time())
        if left <= 0:
            return {}
        try:
            answers, _errors, _missing = await self._survey(_pack([_JOBS, since]), left)
        except MeshError:
            return {}
        return {name: answer for name, answer in answers.items() if name in refused}

    async def reread(self, pattern: str, latest: int, timeout: float | None) -> list[Stored]:
        """Every stored path matching `pattern`, its `latest` newest messages, newest first,
        merged from every memory member's answer."""
        pattern = validate_pattern(pattern)
        if type(latest) is not int or not 1 <= latest <= MAX_LATEST:
            raise ConfigurationError(f"latest must be 1 to {MAX_LATEST}, not {latest!r}")
        found, errors, missing = await self._pages(pattern, latest, timeout)
        if missing or errors:
            self.stats["rereads_partial"] += 1
        self.stats["rereads"] += 1
        merged = merge(found, latest)
        if merged:
            self.observe(max(stored.id for stored in merged))
        return merged

    async def catch_up(self, timeout: float) -> int:
        """A member that starts copies what the others stored while it was away (from a
        minute before its newest message, for publishers' clocks that disagree), a page at a
        time; how many messages were new."""
        member = self.member
        if member is None:
            return 0
        loop = asyncio.get_running_loop()
        newest = await member.run(member.store.newest_id)
        if newest is not None:  # the clock starts past what this member stored before
            self.observe(newest)
        after = b"" if newest is None else _before(newest, CATCH_UP_MARGIN)
        added = 0
        while True:
            try:
                answers, _errors, _missing = await self._ask(
                    encode_since(after), timeout, own=False
                )
            except NoResponders:
                break  # the only memory member: nothing to copy
            pages, cursors = self._decode_pages(answers)
            added += await loop.run_in_executor(self._pool, member.absorb, pages)
            if not cursors:
                break
            after = min(c for c in cursors if isinstance(c, bytes))
        self.stats["caught_up"] += added
        return added

    def _decode_pages(
        self, answers: Mapping[str, bytes]
    ) -> tuple[list[list[Stored]], list[str | bytes]]:
        """The members' pages, and where each would go on (a malformed answer is counted)."""
        pages: list[list[Stored]] = []
        cursors: list[str | bytes] = []
        for answer in answers.values():
            try:
                rows, following = decode_page(answer)
            except ProtocolError:
                self.stats["memory_answers_malformed"] += 1
                continue
            pages.append(rows)
            if following is not None:
                cursors.append(following)
        return pages, cursors

    async def _pages(
        self, pattern: str, latest: int, timeout: float | None
    ) -> tuple[list[list[Stored]], dict[str, MeshError], list[str]]:
        """Every member's answer to "latest", page after page (all members asked for each
        page, each answering what it holds after the same topic) until none has more."""
        found: list[list[Stored]] = []
        errors: dict[str, MeshError] = {}
        missing: set[str] = set()
        after: str | None = None
        while True:
            answers, failed, silent = await self._ask(
                encode_latest(pattern, latest, after), timeout
            )
            errors.update(failed)
            missing.update(silent)
            if not answers:
                if not found:
                    raise _failure(errors, sorted(missing), timeout)
                break
            pages, cursors = self._decode_pages(answers)
            found.extend(pages)
            if not cursors:
                break
            # No member skips a path another has not sent yet.
            after = min(c for c in cursors if isinstance(c, str))
        return found, errors, sorted(missing)

    async def _ask(
        self, request: bytes, timeout: float | None, *, own: bool = True
    ) -> tuple[dict[str, bytes], dict[str, MeshError], list[str]]:
        """Every memory member's answer, this node's own store's included (`own`)."""
        answers: dict[str, bytes] = {}
        errors: dict[str, MeshError] = {}
        missing: list[str] = []
        own_answer = None
        if self.member is not None and own:
            own_answer = asyncio.ensure_future(self.member.serve(request))
        try:
            answers, errors, missing = await self._survey(request, timeout)
        except NoResponders:
            if own_answer is None:
                raise
        if own_answer is not None:
            try:
                answers = {**answers, self._node_id.hex(): await own_answer}
            except MeshError as exc:
                errors = {**errors, self._node_id.hex(): exc}
        return answers, errors, missing

    def close(self) -> None:
        for task in list(self._dispatching):
            task.cancel()
        batches, self._batches = list(self._batches.values()), {}
        for batch in batches:  # still open (not sent): their callers must not wait forever
            _settle(batch.waiting, Closed("node closed"))
        if self.member is not None:
            self.member.close()


class _Batch:
    """Rows to send in one store or enqueue request, and their callers."""

    __slots__ = ("rows", "size", "waiting")

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self.waiting: list[asyncio.Future[None]] = []
        self.size = 0


def _settle(waiting: Iterable[asyncio.Future[None]], error: MeshError | None) -> None:
    for done in waiting:
        if done.done():
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)


def _before(msg_id: bytes, seconds: float) -> bytes:
    """An id `seconds` before the one given (nothing after it in its other fields)."""
    return message_id(bytes(4), 0, id_time(msg_id) - seconds)[:8]


def _failure(
    errors: Mapping[str, MeshError], missing: Sequence[str], timeout: float | None
) -> MeshError:
    if errors:
        return next(iter(errors.values()))
    return RequestTimeout(MEMORY_CLUSTER, timeout or 0.0, 1)


def _jobs(rows: Any) -> list[Job]:
    """An enqueue request's jobs, checked."""
    if type(rows) is not list or len(rows) > _MAX_BATCH:
        raise ConfigurationError("enqueue takes up to 4096 jobs")
    jobs = []
    for row in rows:
        if not (
            type(row) is list
            and (
                len(row) == 5
                or (len(row) == 6 and type(row[5]) is bytes and 0 < len(row[5]) <= MAX_TRACE)
            )
            and type(row[0]) is bytes
            and len(row[0]) == ID_SIZE
            and type(row[1]) is str
            and type(row[2]) is bytes
            and all(type(t) in (int, float) for t in row[3:5])
        ):
            raise ConfigurationError(
                "a job is [id, cluster, payload, enqueued_at, expires_at(, trace context)]"
            )
        trace = row[5] if len(row) == 6 else b""
        jobs.append(Job(row[0], row[1], row[2], float(row[3]), float(row[4]), 0, trace))
    return jobs


def _ids_size(count: int) -> int:
    """The bytes `count` ids take in an answer, their array's header included."""
    return count * _ID_BYTES + 5


def _ids_fitting(room: int) -> int:
    """How many ids fit in `room` bytes of an answer, besides its other fields."""
    return max(0, (room - _ANSWER_ROOM) // _ID_BYTES)


def _tombstone(value: Any) -> Tombstone | None:
    """A tombstone cursor, [done_at, id], read (None for nil); ConfigurationError if it is
    not one."""
    if value is None:
        return None
    if not (
        type(value) is list
        and len(value) == 2
        and type(value[0]) in (int, float)
        and math.isfinite(value[0])
        and type(value[1]) is bytes
        and len(value[1]) == ID_SIZE
    ):
        raise ConfigurationError("a tombstone is [done_at, job id]")
    return Tombstone(float(value[0]), value[1])


def _job_rows(jobs: Iterable[Job]) -> list[list[Any]]:
    """Jobs as a "jobs" answer's rows (the trace context only where there is one)."""
    return [
        [j.id, j.cluster, j.payload, j.enqueued_at, j.expires_at, *([j.trace] if j.trace else [])]
        for j in jobs
    ]


def _decode_jobs(answer: bytes) -> tuple[list[Job], list[bytes], bytes | None]:
    """A member's answer to "jobs": its jobs, the ids of those it finished, and the id to ask
    after for more (None: that was all, as in the previous release's answers, which have no
    such field); ProtocolError if it is not one."""
    try:
        page = _unpack(answer)
    except ConfigurationError:
        raise ProtocolError("bad_body", "memory jobs answer") from None
    if type(page) is not list or len(page) not in (2, 3) or type(page[1]) is not list:
        raise ProtocolError("bad_body", "memory jobs answer")
    following = page[2] if len(page) == 3 else None
    if following is not None and not (type(following) is bytes and len(following) == ID_SIZE):
        raise ProtocolError("bad_body", "memory jobs answer")
    try:
        jobs = _jobs(page[0])
    except ConfigurationError:
        raise ProtocolError("bad_body", "memory job row") from None
    done = [i for i in page[1] if type(i) is bytes and len(i) == ID_SIZE]
    return jobs, done, following


# How a paged request's answer is read: (jobs, tombstones, the cursor to go on from), its ids
# finished as of the time given when the answer has no times.
_Reader = Callable[[bytes, float], tuple[list[Job], list[Tombstone], C | None]]


class _PagedRequest(Generic[C]):
    """A paged request to the other memory members: the request for the page after a cursor,
    how to read its answer, and how to read a previous release's answer to `["jobs", since]`,
    all it holds at once (asked instead where the paged request is refused)."""

    __slots__ = ("ask", "read", "since", "whole")

    def __init__(
        self,
        since: float,
        ask: Callable[[C | None], bytes],
        read: _Reader[C],
        whole: _Reader[C],
    ) -> None:
        self.since = since
        self.ask: Callable[[C | None], bytes] = ask
        self.read: _Reader[C] = read
        self.whole: _Reader[C] = whole


def _jobs_request(since: float) -> _PagedRequest[bytes]:
    """The jobs held, after a job id; with the first page, the ids finished since `since`."""
    return _PagedRequest(
        since, lambda after: _pack([_JOBS, since, after]), _read_jobs, _read_whole_jobs
    )


def _finished_request(since: float) -> _PagedRequest[Tombstone]:
    """The tombstones kept since `since`, after a tombstone."""

    def ask(after: Tombstone | None) -> bytes:
        return _pack([_FINISHED, since, None if after is None else list(after)])

    return _PagedRequest(since, ask, _read_finished, _read_whole_finished)


def _read_jobs(answer: bytes, now: float) -> tuple[list[Job], list[Tombstone], bytes | None]:
    """An answer to "jobs"."""
    jobs, done, following = _decode_jobs(answer)
    return jobs, [Tombstone(now, job_id) for job_id in done], following


def _read_whole_jobs(answer: bytes, now: float) -> tuple[list[Job], list[Tombstone], None]:
    jobs, done, _following = _read_jobs(answer, now)
    return jobs, done, None


def _read_whole_finished(answer: bytes, now: float) -> tuple[list[Job], list[Tombstone], None]:
    """Its finished ids only: the jobs come after every tombstone is known."""
    _jobs, done, _following = _read_jobs(answer, now)
    return [], done, None


def _read_finished(
    answer: bytes, _now: float
) -> tuple[list[Job], list[Tombstone], Tombstone | None]:
    """An answer to "finished": its tombstones and the one to ask after for more (None: no
    more); ProtocolError if it is not one."""
    try:
        page = _unpack(answer)
        if type(page) is not list or len(page) != 2 or type(page[0]) is not list:
            raise ConfigurationError("not a page")
        found = [_tombstone(row) for row in page[0] if row is not None]
        if len(found) != len(page[0]):
            raise ConfigurationError("a nil tombstone")
        following = _tombstone(page[1])
    except ConfigurationError:
        raise ProtocolError("bad_body", "memory finished answer") from None
    return [], [t for t in found if t is not None], following


def _rows(rows: Any) -> list[tuple[str, bytes, float, bytes]]:
    """A store request's rows, checked."""
    if type(rows) is not list or len(rows) > _MAX_BATCH or not all(_is_row(r) for r in rows):
        raise ConfigurationError("store takes up to 4096 [topic, payload, time, id] rows")
    return [(topic, payload, float(at), msg_id) for topic, payload, at, msg_id in rows]


def _is_row(row: Any) -> bool:
    return (
        type(row) is list
        and len(row) == 4
        and type(row[0]) is str
        and type(row[1]) is bytes
        and type(row[2]) in (int, float)
        and type(row[3]) is bytes
        and len(row[3]) == ID_SIZE
    )


def _pack_page(page: Sequence[Stored], following: str | bytes | None) -> bytes:
    """An answer to "latest" or "since"."""
    return _pack([[[s.topic, s.payload, s.published_at, s.id] for s in page], following])


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        raise ConfigurationError("a memory request or answer is not msgpack") from None


__all__ = [
    "MEMORY_CLUSTER",
    "MemoryMember",
    "NodeMemory",
    "decode_page",
    "encode_latest",
    "encode_store",
    "merge",
]
