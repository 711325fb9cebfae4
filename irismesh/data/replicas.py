"""A node's replicas of data keys, kept converging with every other holder of each key.

Theory of operation
-------------------
A node holds a key once it reads or writes it (or watches a pattern that matches it): it keeps
the key's CRDT state and subscribes to the key's internal topic (`wire.DATA_PREFIX` + key), so
the holders of a key are exactly the subscribers of its topic, as publish/subscribe knows them.
A node holds a key until it closes (a watch's pattern too: it keeps the keys it matched).

- **Writes** change the local state at once. With `consistency="local"` the write's delta is
  folded into the key's pending delta, and a flush on the next turn of the loop publishes one
  DELTA per key however many writes it folds. With "majority" or "all" the delta goes out at
  once asking for acknowledgements, and the write returns once enough holders merged it
  (a majority of the holders counting this node, or every holder), else DataTimeout; the
  local state keeps the write either way, and it spreads like any other.
- **Reads** return the local value; "majority" and "all" first ASK the holders for their states
  and merge the answers of a majority (or all) of them.
- **Anti-entropy.** Deltas ride publish/subscribe, which loses what is in flight when a link
  breaks. So a node that starts holding a key ASKs for the others' states (again after 1 and
  3 s, until one answers: its interest takes a moment to reach them); every DIGEST_EVERY
  seconds about DIGEST_SENDERS holders of each key, and as soon as membership sees a peer
  come up (a node joined, or came back: a healed partition) every holder, publish a DIGEST of
  the key's state; a holder whose state differs pushes its whole STATE, and one that receives
  a STATE holding less than its own pushes its own back, so two holders that differ agree
  after one exchange.

Memory members (`keep`) hold every key: they subscribe to all of them, count among the
holders of each, and keep each key's state on disk (`data.disk`), saved before they
acknowledge a write, so a member restarted after a crash still has every write it acknowledged.

Bounded state: deltas fold into one pending delta per key; a set's or flag's causal context
folds the dots it sees in order into one integer per writer; removes leave no tombstone. What
a node that left (PeerDown "left", PRUNE_AFTER ago) wrote is folded into the key's lowest
holder's (`types._Prunable.start_pruning` / `see_pruning` / `prune`): a counter's entries are
added to the owner's, a set's, flag's or map's dots are renamed as the owner's and the node
leaves the causal contexts. At each periodic round that holder proposes, every holder that
merges the proposal says it saw it (with its own copy of what the node wrote), and the
proposer folds once every holder it knows did; only while membership holds no member suspect
or dead, so every holder can take part and two sides of a partition never both fold. A node
that is only dead (maybe partitioned away) is never pruned. The fold's marker is forgotten
after PRUNED_KEEP_MS. Registers keep one stamp, whoever wrote it: nothing to prune.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgpack

from irismesh._core.events import PeerDown, PeerUp
from irismesh._core.records import MemberState
from irismesh._core.topics import topic_matches, validate_pattern
from irismesh.data.clock import HybridClock
from irismesh.data.types import (
    Crdt,
    Element,
    Flag,
    LWWRegister,
    MapValue,
    ORMap,
    ORSet,
    PNCounter,
    Prunable,
    decode,
    encode,
    fingerprint,
)
from irismesh.data.wire import DATA_PREFIX, Op, Sealer, WireMessage, validate_key
from irismesh.errors import (
    Closed,
    ConfigurationError,
    DataTimeout,
    MeshError,
    ProtocolError,
    StorageError,
)

if TYPE_CHECKING:
    from irismesh.data.disk import DataDisk
    from irismesh.node import Node
    from irismesh.patterns.pubsub import Message, Subscription

__all__ = [
    "Consistency",
    "DataChange",
    "DataCounter",
    "DataFlag",
    "DataMap",
    "DataRegister",
    "DataSet",
    "DataWatch",
    "NodeData",
]

Consistency = Literal["local", "majority", "all"]
_CONSISTENCIES = ("local", "majority", "all")
DIGEST_EVERY = 10.0  # seconds between anti-entropy rounds (jittered by a quarter)
DIGEST_SENDERS = 3  # holders of a key that send its digest in a periodic round, on average
ASK_AGAIN = (1.0, 3.0)  # seconds after holding a key to ask again while nobody answered
PUSH_EVERY = 1.0  # seconds a key's whole state is pushed at most once in
PEER_UP_ROUND = 0.05  # seconds from a peer coming up to the digest round (a burst: one round)
PEER_UP_GAP = 1.0  # seconds between two digest rounds set off by peers coming up, at least
PRUNE_AFTER = 60.0  # seconds after a node left before its counters' entries are folded
PRUNED_KEEP_MS = 6 * 3600 * 1000  # how long a fold's marker is kept (ms)
SAVE_EVERY = 0.2  # seconds a memory member's change waits at most to reach its disk
FLUSH_ON_CLOSE = 1.0  # seconds a closing node gives its unsent local writes
WATCH_QUEUE = 1024  # changes a watch buffers before dropping the oldest
_log = logging.getLogger("irismesh.data")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataChange:
    """A key's new value, as a watch reports it."""

    key: str
    value: Any
    local: bool  # this node's own write (else merged from another holder)


class _Held:
    """One key's replica on this node."""

    __slots__ = (
        "answered",
        "key",
        "pending",
        "push_due",
        "pushed",
        "state",
        "topic",
        "value",
        "watched",
    )

    def __init__(self, key: str, state: Crdt) -> None:
        self.key = key
        self.topic = DATA_PREFIX + key
        self.state = state
        self.pending: Crdt | None = None  # local deltas not yet published, folded
        self.answered = False  # another holder has sent its state
        self.pushed = 0.0  # when the whole state was last pushed
        self.push_due: asyncio.TimerHandle | None = None  # a push held back, due later
        self.watched = False
        # The value as last read, until the state changes (a 10,000-element set is not copied
        # again for every read); not for a map, whose value is a dict the caller may change.
        self.value: Any = _UNREAD

    def read(self) -> Any:
        value = self.value
        if value is _UNREAD:
            value = self.state.value
            if not isinstance(self.state, ORMap):
                self.value = value
        return value


_UNREAD = object()


class _Wait:
    """Holders heard from for one write's acknowledgements or one read's states."""

    __slots__ = ("done", "heard", "needed")

    def __init__(self, needed: int) -> None:
        self.needed = needed
        self.heard: set[bytes] = set()
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def hear(self, node: bytes) -> None:
        self.heard.add(node)
        if len(self.heard) >= self.needed and not self.done.done():
            self.done.set_result(None)


class NodeData:
    """`node.data`: the node's replicated data (its handles, watches and replication)."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._me = node.node_id
        self._me_hex = node.node_id.hex()
        self._sealer = Sealer(lambda: node.keyring)
        self._clock = HybridClock(node.node_id)
        self.physical: Callable[[], int] = _now_ms  # the wall clock, in ms (tests skew it)
        self._held: dict[str, _Held] = {}
        self._subs: dict[str, Subscription] = {}  # pattern (without prefix) -> subscription
        self._watches: list[DataWatch] = []
        self._waits: dict[int, _Wait] = {}
        self._asking: set[str] = set()  # keys not held that were asked for (`_ask_unheld`)
        self._ref = random.getrandbits(31)
        self._dirty: dict[str, _Held] = {}
        self._flushing: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.stats: Counter[str] = Counter()
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._digests = loop.create_task(self._digest_rounds())
        self._digest_soon: asyncio.TimerHandle | None = None
        self._digest_last = -PEER_UP_GAP  # when a peer's coming up last set off a round
        self._disk: DataDisk | None = None  # a memory member's: every key, at rest
        self._unsaved: dict[str, _Held] = {}
        self._saving: asyncio.Task[None] | None = None
        self._left: dict[bytes, float] = {}  # nodes that left (said goodbye) -> when
        node._listen(PeerUp, self._peer_up)
        node._listen(PeerDown, self._peer_down)

    def keep(self, directory: str | Path) -> None:
        """Hold every key of the mesh this node's keyring opens, and keep them on disk in
        `directory` (what a memory member does), starting from what is there."""
        from irismesh.data.disk import DataDisk

        if self._disk is not None:
            return
        self._subscribe("#")
        disk = self._disk = DataDisk(directory, self._sealer)
        for key, state in disk.load():
            held = self._held.get(key)
            if held is None:
                self._adopt(key, state)
            elif type(held.state) is type(state):
                held.state.merge(state)  # type: ignore[arg-type]
        self._unsaved.clear()
        self._saving = self._loop.create_task(self._save_rounds())

    async def _save_rounds(self) -> None:
        while True:
            await asyncio.sleep(SAVE_EVERY)
            self._save_now()

    def _save_now(self) -> None:
        if self._disk is None or not self._unsaved:
            return
        unsaved, self._unsaved = self._unsaved, {}
        try:
            self._disk.save([(k, h.state) for k, h in unsaved.items()])
        except StorageError as exc:
            self.stats["data_saves_failed"] += 1
            self._unsaved.update(unsaved)
            _log.warning("data keys not saved: %s", exc)

    # ----------------------------------------------------------------- handles

    def counter(self, key: str) -> DataCounter:
        """A counter that goes up and down (PN-counter) under `key`."""
        return DataCounter(self, self._hold(key, PNCounter).key)

    def set(self, key: str) -> DataSet:
        """A set of bytes, str or int where an add concurrent with a remove wins."""
        return DataSet(self, self._hold(key, ORSet).key)

    def register(self, key: str) -> DataRegister:
        """One value; the last write by hybrid logical clock wins."""
        return DataRegister(self, self._hold(key, LWWRegister).key)

    def flag(self, key: str) -> DataFlag:
        """A boolean; an enable concurrent with a disable wins."""
        return DataFlag(self, self._hold(key, Flag).key)

    def map(self, key: str) -> DataMap:
        """A map from fields to counters, sets or registers; an update wins over a remove."""
        return DataMap(self, self._hold(key, ORMap).key)

    def watch(self, pattern: str, *, maxsize: int = WATCH_QUEUE) -> DataWatch:
        """Every change of the keys matching `pattern` (topic wildcards: `*`, `#`), local or
        merged, from now on: `async for change in node.data.watch("flags.#")`."""
        self._running()
        pattern = validate_pattern(pattern)
        watch = DataWatch(self, pattern, maxsize)
        self._watches.append(watch)
        for held in self._held.values():
            if topic_matches(pattern, held.key):
                held.watched = True
        self._subscribe(pattern)
        return watch

    def keys(self) -> dict[str, str]:
        """The keys this node holds, with their types' names."""
        return {k: type(h.state).__name__ for k, h in self._held.items()}

    def values(self) -> dict[str, Any]:
        """The value of each key this node holds, as merged here (a local read of each)."""
        return {k: h.read() for k, h in self._held.items()}

    # ----------------------------------------------------------------- operations

    def _running(self) -> None:
        if self._closed:
            raise Closed("node closed")
        self._node._caller.running()

    def _hold(self, key: str, kind: type[Crdt]) -> _Held:
        self._running()
        held = self._held.get(key)
        if held is None:
            key = validate_key(key)
            self._sealer.require(key)
            held = self._adopt(key, kind())
        if type(held.state) is not kind:
            raise ConfigurationError(
                f"data key {key!r} holds a {type(held.state).__name__}, not a {kind.__name__}"
            )
        return held

    def _adopt(self, key: str, state: Crdt) -> _Held:
        held = self._held[key] = _Held(key, state)
        if self._disk is not None:
            self._unsaved[key] = held
        held.watched = any(topic_matches(w.pattern, key) for w in self._watches)
        if not any(topic_matches(p, key) for p in self._subs):
            self._subscribe(key)
        self._spawn(self._ask_until_answered, held)
        return held

    def _subscribe(self, pattern: str) -> None:
        if pattern not in self._subs:
            self._subs[pattern] = self._node._pubsub.subscribe(
                DATA_PREFIX + pattern, "drop_oldest", 1, self._on_message
            )

    async def _write(
        self, held: _Held, delta: Crdt, consistency: Consistency, timeout: float | None
    ) -> None:
        held.value = _UNREAD
        if self._disk is not None:
            self._unsaved[held.key] = held
        self._changed(held, None, local=True)
        if consistency == "local":
            if held.pending is None:
                held.pending = delta
            else:
                held.pending.merge(delta)  # type: ignore[arg-type]
            self._dirty[held.key] = held
            if self._flushing is None:
                self._flushing = self._loop.create_task(self._flush())
            turns = self._node._caller.turns
            if turns.spend():
                await turns.pause()
            return
        needed = self._needed(held, consistency)
        if needed == 0:
            await self._send(held, Op.DELTA, 0, b"", encode(delta))
            return
        await self._gather(held, consistency, needed, timeout, Op.DELTA, encode(delta))

    async def _read(self, held: _Held, consistency: Consistency, timeout: float | None) -> Any:
        self._check(consistency)
        if consistency != "local":
            needed = self._needed(held, consistency)
            if needed:
                await self._gather(held, consistency, needed, timeout, Op.ASK, b"")
        else:
            turns = self._node._caller.turns
            if turns.spend():
                await turns.pause()
        return held.read()

    def _check(self, consistency: str) -> None:
        if consistency not in _CONSISTENCIES:
            raise ConfigurationError(
                f"consistency must be one of {', '.join(_CONSISTENCIES)}, not {consistency!r}"
            )

    def _needed(self, held: _Held, consistency: Consistency) -> int:
        """How many other holders must answer for `consistency`."""
        core = self._node._core
        others = len(core.subscribers(held.topic)) if core is not None else 0
        if consistency == "all":
            return others
        return (others + 1) // 2  # with this node, a majority of the holders

    async def _gather(
        self,
        held: _Held,
        consistency: Consistency,
        needed: int,
        timeout: float | None,
        op: int,
        body: bytes,
    ) -> None:
        budget = self._node._default_timeout if timeout is None else timeout
        if not budget > 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        self._ref = ref = (self._ref + 1) & 0x7FFFFFFF or 1
        wait = self._waits[ref] = _Wait(needed)
        try:
            async with asyncio.timeout(budget):
                await self._send(held, op, ref, b"", body, timeout=budget)
                await wait.done
        except TimeoutError:
            raise DataTimeout(
                held.key, consistency, len(wait.heard) + 1, needed + 1, budget
            ) from None
        finally:
            self._waits.pop(ref, None)

    async def _send(
        self,
        held: _Held,
        op: int,
        ref: int,
        to: bytes,
        body: bytes,
        *,
        timeout: float | None = None,
    ) -> None:
        await self._publish(held.key, op, ref, to, body, timeout=timeout)

    async def _publish(
        self, key: str, op: int, ref: int, to: bytes, body: bytes, *, timeout: float | None = None
    ) -> None:
        topic = DATA_PREFIX + key
        sealed = self._sealer.seal(topic, WireMessage(op, key, ref, to, body).pack())
        self.stats["data_bytes_sent"] += len(sealed)
        self.stats[_SENT[op]] += 1
        # Straight to pub/sub (not `node.publish`): a closing node still sends its last deltas.
        pubsub = self._node._pubsub
        if pubsub.publish_now(topic, sealed, b"", 0) is None:
            budget = self._node._default_timeout if timeout is None else timeout
            await pubsub.publish_later(topic, sealed, budget, b"", 0)

    def _send_soon(self, held: _Held, op: int, ref: int, to: bytes, body: bytes) -> None:
        self._spawn(self._send, held, op, ref, to, body)

    async def _flush(self) -> None:
        """Publish each key's folded local deltas (the loop ran once: writes gathered)."""
        try:
            while self._dirty:
                dirty, self._dirty = self._dirty, {}
                for held in dirty.values():
                    delta, held.pending = held.pending, None
                    if delta is not None:
                        try:
                            await self._send(held, Op.DELTA, 0, b"", encode(delta))
                        except MeshError as exc:
                            self.stats["data_deltas_failed"] += 1
                            _log.debug("delta for %s not sent: %s", held.key, exc)
        finally:
            self._flushing = None

    def _spawn(self, run: Callable[..., Awaitable[None]], *args: Any) -> None:
        # The coroutine is made inside the task: a task cancelled before it starts leaves no
        # coroutine that was never awaited.
        task = self._loop.create_task(self._quietly(run, *args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quietly(self, run: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await run(*args)
        except MeshError as exc:
            self.stats["data_sends_failed"] += 1
            _log.debug("data message not sent: %s", exc)

    # ----------------------------------------------------------------- receiving

    def _on_message(self, msg: Message) -> None:
        if msg.publisher == self._me_hex or self._closed:
            return
        stats = self.stats
        stats["data_bytes_received"] += len(msg.payload)
        try:
            m = WireMessage.unpack(self._sealer.open(msg.topic, msg.payload))
            if DATA_PREFIX + m.key != msg.topic:
                raise ProtocolError("bad_data", "key")
            sender = bytes.fromhex(msg.publisher)
            if m.op == Op.ACK or (m.op == Op.STATE and m.to == self._me):
                wait = self._waits.get(m.ref) if m.to == self._me else None
                if m.op == Op.STATE:
                    self._merge(m.key, decode(m.body), answered=True)
                if wait is not None:
                    wait.hear(sender)
                return
            if m.op == Op.DELTA:
                held = self._merge(m.key, decode(m.body))
                if m.ref and held is not None:
                    self._save_now()  # on disk before acknowledged
                    self._send_soon(held, Op.ACK, m.ref, sender, b"")
            elif m.op == Op.STATE:
                theirs = decode(m.body)
                held = self._merge(m.key, theirs, answered=True)
                pushed = m.ref == 0  # pushed after a digest, not an answer to someone's ask
                if pushed and held is not None and fingerprint(held.state) != fingerprint(theirs):
                    self._push(held)  # they lack some of ours
            elif m.op == Op.ASK:
                held = self._held.get(m.key)
                if held is not None:
                    self._send_soon(held, Op.STATE, m.ref, sender, encode(held.state))
            elif m.op == Op.DIGEST:
                held = self._held.get(m.key)
                if held is None:
                    self._ask_unheld(m.key)
                elif fingerprint(held.state) != m.body:
                    self._push(held)
        except ProtocolError as exc:
            stats["data_dropped_" + exc.reason] += 1
        except ValueError:
            stats["data_dropped_bad_data"] += 1

    def _ask_unheld(self, key: str) -> None:
        """A digest of a key not held here, which only a pattern (a watch's, a memory
        member's) brings: ask its holders for its state, which makes it held (its type comes
        with the state). So a pattern finds the keys that exist, not only those written
        after it."""
        if key in self._asking or self._closed:
            return
        self._asking.add(key)
        self._spawn(self._publish, key, Op.ASK, 0, b"", b"")

    def _merge(self, key: str, incoming: Crdt, *, answered: bool = False) -> _Held | None:
        held = self._held.get(key)
        if held is None:  # a key a watch's pattern matches: held from now on
            self._asking.discard(key)
            held = self._adopt(key, type(incoming)())
        if type(held.state) is not type(incoming):
            self.stats["data_dropped_other_type"] += 1
            return None
        if answered:
            held.answered = True
        before = held.read() if held.watched else None
        self._observe(incoming)
        held.state.merge(incoming)  # type: ignore[arg-type]
        held.value = _UNREAD
        if self._disk is not None:
            self._unsaved[key] = held
        self.stats["data_merges"] += 1
        if not isinstance(incoming, LWWRegister) and incoming.pruning:
            self._on_pruning(held)
        self._changed(held, before, local=False)
        return held

    def _observe(self, incoming: Crdt) -> None:
        """The clock takes in the stamps a merge brings: a write after them orders after."""
        if isinstance(incoming, LWWRegister):
            registers: list[LWWRegister] = [incoming]
        elif isinstance(incoming, ORMap):
            registers = [v for v in incoming.values.values() if isinstance(v, LWWRegister)]
        else:
            return
        for register in registers:
            if register.stamp is not None:
                self._clock.observe(register.stamp, self.physical())

    def _changed(self, held: _Held, before: Any, *, local: bool) -> None:
        if not held.watched:
            return
        value = held.read()
        if value == before and not local:
            return
        change = DataChange(key=held.key, value=value, local=local)
        for watch in self._watches:
            if topic_matches(watch.pattern, held.key):
                watch._put(change)

    def _push(self, held: _Held) -> None:
        """Publish the key's whole state (a holder lacks some of it), at most once every
        PUSH_EVERY seconds: a push asked for sooner is held back and made when the pause ends
        (once, with the state as it is then), so the last difference is never left for the
        next periodic round."""
        now = time.monotonic()
        if now - held.pushed < PUSH_EVERY:
            self.stats["data_pushes_held_back"] += 1
            if held.push_due is None and not self._closed:
                held.push_due = self._loop.call_later(
                    held.pushed + PUSH_EVERY - now, self._push_due, held
                )
            return
        held.pushed = now
        self._send_soon(held, Op.STATE, 0, b"", encode(held.state))

    def _push_due(self, held: _Held) -> None:
        held.push_due = None
        if not self._closed:
            self._push(held)

    # ----------------------------------------------------------------- anti-entropy

    async def _ask_until_answered(self, held: _Held) -> None:
        await asyncio.sleep(0)  # the subscription is on its way first
        for pause in (0.0, *ASK_AGAIN):
            await asyncio.sleep(pause)
            if held.answered or self._closed:
                return
            await self._send(held, Op.ASK, 0, b"", b"")

    def _peer_down(self, event: PeerDown) -> None:
        if event.reason == "left":
            self._left[event.node_id] = time.monotonic()

    def _peer_up(self, event: PeerUp) -> None:
        """A node joined or came back (membership revived it: a healed partition, a false
        death refuted): every key's digest goes out at once, so the two sides of a partition
        exchange what they missed as soon as they see each other, not at the next periodic
        round. The peers of one burst (a partition's other side) share one round, and rounds
        set off this way are PEER_UP_GAP apart at least (one more follows a burst that
        outlasts the gap). Publishing waits for the link to every holder membership knows,
        the revived ones included, so the digest reaches them."""
        self._left.pop(event.node_id, None)  # back (the same identity): not pruned
        if self._closed or self._digest_soon is not None:
            return
        now = time.monotonic()
        delay = max(PEER_UP_ROUND, self._digest_last + PEER_UP_GAP - now)

        def round_now() -> None:
            self._digest_soon = None
            self._digest_last = time.monotonic()
            self._spawn(self._digest_round)

        self._digest_soon = self._loop.call_later(delay, round_now)

    async def _digest_rounds(self) -> None:
        while not self._closed:
            await asyncio.sleep(DIGEST_EVERY * random.uniform(0.75, 1.25))
            self._prune_round()
            await self._digest_round(every_key=False)

    # ----------------------------------------------------------------- pruning

    def _prune_round(self) -> None:
        """Fold what nodes that left PRUNE_AFTER ago or more wrote (this node
        proposing when it is the key's lowest holder), and forget fold markers past their
        time. Only while membership holds no node suspect or dead: then every holder is
        reachable, and two sides of a partition never fold one node twice."""
        core = self._node._core
        if core is None or self._closed:
            return
        now, now_ms = time.monotonic(), self.physical()
        for node_id in [n for n, at in self._left.items() if now - at > PRUNED_KEEP_MS / 1000]:
            del self._left[node_id]  # long gone: whatever could be folded was
        gone = [n for n, at in self._left.items() if now - at >= PRUNE_AFTER]
        whole = self._whole()
        for held in list(self._held.values()):
            state = held.state
            if isinstance(state, LWWRegister):
                continue  # one writer's stamp: nothing per node to fold
            if state.forget_pruned(now_ms):
                self.stats["data_prune_markers_forgotten"] += 1
            if not whole or not gone:
                continue
            holders = core.subscribers(held.topic)
            if min([self._me, *holders]) != self._me:
                continue
            for removed in gone:
                self._spread(held, state.start_pruning(removed, self._me))
            self._prune_if_seen(held, state, holders)

    def _whole(self) -> bool:
        core = self._node._core
        if core is None:
            return False
        return all(
            m.state is not MemberState.SUSPECT and m.state is not MemberState.DEAD
            for m in core.membership.members()
        )

    def _on_pruning(self, held: _Held) -> None:
        """A merge brought pruning markers: say this holder saw them (its delta carries its
        entries of the node, so the owner folds the most any holder has); the owner folds
        once every holder did."""
        state = held.state
        if isinstance(state, LWWRegister) or not state.pruning:
            return
        for removed in list(state.pruning):
            self._spread(held, state.see_pruning(removed, self._me))
        core = self._node._core
        if core is not None and self._whole():
            self._prune_if_seen(held, state, core.subscribers(held.topic))

    def _prune_if_seen(self, held: _Held, state: Prunable, holders: list[bytes]) -> None:
        for removed, (owner, seen) in list(state.pruning.items()):
            if owner != self._me or removed not in self._left:
                continue
            if seen.issuperset(holders):
                folded = state.prune(removed, self.physical() + PRUNED_KEEP_MS)
                if folded is not None:
                    self.stats["data_nodes_pruned"] += 1
                    self._spread(held, folded)

    def _spread(self, held: _Held, delta: Prunable | None) -> None:
        """A change made here that is not a write: folded into the key's pending delta and
        published on the next flush, like a local write."""
        if delta is None:
            return
        held.value = _UNREAD
        if self._disk is not None:
            self._unsaved[held.key] = held
        if held.pending is None:
            held.pending = delta
        else:
            held.pending.merge(delta)  # type: ignore[arg-type]
        self._dirty[held.key] = held
        if self._flushing is None:
            self._flushing = self._loop.create_task(self._flush())

    async def _digest_round(self, *, every_key: bool = True) -> None:
        """A DIGEST of each key held; in the periodic rounds, of each key with a chance that
        makes about DIGEST_SENDERS of its holders send one (not every holder to every other)."""
        core = self._node._core
        for held in list(self._held.values()):
            if self._closed or core is None:
                return
            if not every_key:
                holders = len(core.subscribers(held.topic)) + 1
                if random.random() * holders > DIGEST_SENDERS:
                    continue
            try:
                await self._send(held, Op.DIGEST, 0, b"", fingerprint(held.state))
            except MeshError as exc:
                self.stats["data_sends_failed"] += 1
                _log.debug("digest of %s not sent: %s", held.key, exc)

    # ----------------------------------------------------------------- lifecycle

    async def close(self) -> None:
        """Stop replicating (the node is closing): local writes not yet sent go first (for up
        to FLUSH_ON_CLOSE seconds), then waits fail with Closed and watches end."""
        if self._closed:
            return
        flushing = self._flushing
        if flushing is not None:
            with contextlib.suppress(TimeoutError, MeshError):
                await asyncio.wait_for(asyncio.shield(flushing), FLUSH_ON_CLOSE)
        self._closed = True
        self._digests.cancel()
        if self._disk is not None:
            if self._saving is not None:
                self._saving.cancel()
            self._save_now()
            self._disk.close()
        if self._digest_soon is not None:
            self._digest_soon.cancel()
        for held in self._held.values():
            if held.push_due is not None:
                held.push_due.cancel()
        for task in (*self._tasks, self._flushing):
            if task is not None:
                task.cancel()
        for wait in self._waits.values():
            if not wait.done.done():
                wait.done.set_exception(Closed("node closed"))
        for sub in self._subs.values():
            sub.close()
        for watch in list(self._watches):
            watch.close()

    def figures(self) -> dict[str, int]:
        figures = dict(self.stats)
        figures["data_keys_held"] = len(self._held)
        if self._disk is not None:
            figures["data_rows_saved"] = self._disk.saved
            figures["data_rows_locked"] = self._disk.locked
        return figures


_SENT = {
    Op.DELTA: "data_deltas_sent",
    Op.ACK: "data_acks_sent",
    Op.ASK: "data_asks_sent",
    Op.STATE: "data_states_sent",
    Op.DIGEST: "data_digests_sent",
}


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Handle:
    """A data key as this node reads and writes it."""

    __slots__ = ("_data", "key")

    def __init__(self, data: NodeData, key: str) -> None:
        self._data = data
        self.key = key

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.key!r}>"

    def _held(self) -> _Held:
        data = self._data
        data._running()
        return data._held[self.key]

    async def _write(
        self, change: Callable[[Any], Crdt], consistency: Consistency, timeout: float | None
    ) -> None:
        data = self._data
        data._check(consistency)
        held = self._held()
        await data._write(held, change(held.state), consistency, timeout)

    async def get(self, *, consistency: Consistency = "local", timeout: float | None = None) -> Any:
        """The value: this node's ("local"), or merged with a majority's or every holder's
        state first (DataTimeout if too few answer within `timeout`)."""
        return await self._data._read(self._held(), consistency, timeout)


class DataCounter(_Handle):
    """A replicated counter (`node.data.counter(key)`)."""

    __slots__ = ()

    async def add(
        self, amount: int = 1, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> None:
        """Add `amount` (negative to subtract)."""
        if type(amount) is not int:
            raise ConfigurationError(f"a counter adds ints, not {amount!r}")
        me = self._data._me
        await self._write(lambda s: s.add(me, amount), consistency, timeout)

    async def get(self, *, consistency: Consistency = "local", timeout: float | None = None) -> int:
        value: int = await super().get(consistency=consistency, timeout=timeout)
        return value


def _encodable(value: object) -> None:
    """ConfigurationError now rather than a delta that cannot be sent later."""
    try:
        msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigurationError(
            f"a register holds what msgpack encodes, not {value!r:.60}: {exc}"
        ) from None


def _element(element: object) -> Element:
    if type(element) not in (bytes, str, int):
        raise ConfigurationError(f"a set holds bytes, str or int, not {element!r}")
    return element  # type: ignore[return-value]


class DataSet(_Handle):
    """A replicated add-wins set (`node.data.set(key)`)."""

    __slots__ = ()

    async def add(
        self, element: Element, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> None:
        e, me = _element(element), self._data._me
        await self._write(lambda s: s.add(me, e), consistency, timeout)

    async def remove(
        self, element: Element, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> None:
        """Remove `element` as this node has seen it (an add it has not seen survives)."""
        e = _element(element)
        await self._write(lambda s: s.remove(e), consistency, timeout)

    async def clear(
        self, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> None:
        """Remove every element this node has seen (adds it has not seen survive)."""
        await self._write(lambda s: s.clear(), consistency, timeout)

    async def get(
        self, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> frozenset[Element]:
        value: frozenset[Element] = await super().get(consistency=consistency, timeout=timeout)
        return value


class DataRegister(_Handle):
    """A replicated last-writer-wins register (`node.data.register(key)`)."""

    __slots__ = ()

    async def set(
        self, value: Any, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> None:
        """Write `value` (anything msgpack encodes); it orders after every write this node
        has seen."""
        _encodable(value)
        stamp = self._data._clock.now(self._data.physical())
        await self._write(lambda s: s.assign(stamp, value), consistency, timeout)


class DataFlag(_Handle):
    """A replicated enable-wins flag (`node.data.flag(key)`)."""

    __slots__ = ()

    async def enable(
        self, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> None:
        me = self._data._me
        await self._write(lambda s: s.enable(me), consistency, timeout)

    async def disable(
        self, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> None:
        await self._write(lambda s: s.disable(), consistency, timeout)

    async def get(
        self, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> bool:
        value: bool = await super().get(consistency=consistency, timeout=timeout)
        return value


class DataMap(_Handle):
    """A replicated map of counters, sets and registers (`node.data.map(key)`)."""

    __slots__ = ()

    async def _update(
        self,
        field: Element,
        kind: type[MapValue],
        change: Callable[[Any], MapValue],
        consistency: Consistency,
        timeout: float | None,
    ) -> None:
        f, me = _element(field), self._data._me

        def update(m: ORMap) -> Crdt:
            try:
                entry = m.entry(f, kind)
            except TypeError as exc:
                raise ConfigurationError(str(exc)) from None
            return m.updated(me, f, change(entry))

        await self._write(update, consistency, timeout)

    async def add(
        self,
        field: Element,
        amount: int = 1,
        *,
        consistency: Consistency = "local",
        timeout: float | None = None,
    ) -> None:
        """Add `amount` to the counter under `field`."""
        me = self._data._me
        await self._update(field, PNCounter, lambda c: c.add(me, amount), consistency, timeout)

    async def set(
        self,
        field: Element,
        value: Any,
        *,
        consistency: Consistency = "local",
        timeout: float | None = None,
    ) -> None:
        """Write `value` into the register under `field`."""
        _encodable(value)
        stamp = self._data._clock.now(self._data.physical())
        await self._update(
            field, LWWRegister, lambda r: r.assign(stamp, value), consistency, timeout
        )

    async def add_element(
        self,
        field: Element,
        element: Element,
        *,
        consistency: Consistency = "local",
        timeout: float | None = None,
    ) -> None:
        """Add `element` to the set under `field`."""
        e, me = _element(element), self._data._me
        await self._update(field, ORSet, lambda s: s.add(me, e), consistency, timeout)

    async def remove_element(
        self,
        field: Element,
        element: Element,
        *,
        consistency: Consistency = "local",
        timeout: float | None = None,
    ) -> None:
        """Remove `element` from the set under `field`."""
        e = _element(element)
        await self._update(field, ORSet, lambda s: s.remove(e), consistency, timeout)

    async def remove(
        self, field: Element, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> None:
        """Remove `field` (an update concurrent with the remove brings it back)."""
        f = _element(field)
        await self._write(lambda m: m.remove(f), consistency, timeout)

    async def get(
        self, *, consistency: Consistency = "local", timeout: float | None = None
    ) -> dict[Element, Any]:
        value: dict[Element, Any] = await super().get(consistency=consistency, timeout=timeout)
        return value


class DataWatch:
    """Changes of the keys matching a pattern: `async for change in watch`, `async with`."""

    def __init__(self, data: NodeData, pattern: str, maxsize: int) -> None:
        self.pattern = pattern
        self.missed = 0  # changes dropped because the reader fell `maxsize` behind
        self._data = data
        self._queue: deque[DataChange] = deque()
        self._maxsize = maxsize
        self._ready = asyncio.Event()
        self.closed = False

    def _put(self, change: DataChange) -> None:
        if len(self._queue) >= self._maxsize:
            self._queue.popleft()
            self.missed += 1
        self._queue.append(change)
        self._ready.set()

    async def get(self) -> DataChange:
        while not self._queue:
            if self.closed:
                raise Closed("watch closed")
            self._ready.clear()
            await self._ready.wait()
        return self._queue.popleft()

    def __aiter__(self) -> DataWatch:
        return self

    async def __anext__(self) -> DataChange:
        try:
            return await self.get()
        except Closed:
            raise StopAsyncIteration from None

    def close(self) -> None:
        self.closed = True
        self._ready.set()
        with contextlib.suppress(ValueError):
            self._data._watches.remove(self)

    async def __aenter__(self) -> DataWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
