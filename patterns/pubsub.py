"""Publish/subscribe for the asyncio node: subscriptions, their buffers, and flow control.

A subscription is a pattern, a bounded buffer and a policy for when its reader falls behind:

* ``"block"`` (the default): nothing is ever dropped. A message from a peer holds the credit it
  used (`MeshCore.release`) until every blocking subscription that got it has read it, so a
  publisher may have at most `CoreConfig.pubsub_window` messages in this node's buffers; when
  they are full the publisher's `publish` waits, and raises `SlowConsumer` after its timeout.
  This node's own publishes wait while a matching blocking subscription holds `maxsize`.
  The buffer is thus bounded by `maxsize` plus one window per remote publisher.
* ``"drop_oldest"``: the buffer holds at most `maxsize` messages; when a new one arrives at a
  full buffer the oldest is dropped and counted, and the next message read says how many were
  missed before it (`Message.missed`). Credit goes back on arrival, so a slow reader never
  slows a publisher down.

Messages of one publisher arrive in the order it published them (one ordered link per pair of
nodes, credit checked for every target before anything is sent). A message lost in transit (a
link that died with messages in flight) shows as a gap in the publisher's stream and is counted
in the `missed` of the subscriptions that get the next one: nothing is lost silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, NamedTuple

from irismesh._core.engine import MeshCore
from irismesh._core.events import CreditArrived, InterestChanged, Listen, MessagesArrived
from irismesh._core.topics import TopicTrie, validate_pattern, validate_topic
from irismesh.errors import (
    Closed,
    ConfigurationError,
    InterestTimeout,
    MeshError,
    SlowConsumer,
)
from irismesh.patterns.dedup import IdWindow

if TYPE_CHECKING:
    from irismesh.telemetry.tracing import Tracing

_log = logging.getLogger("irismesh.pubsub")

Policy = Literal["block", "drop_oldest"]
POLICIES: tuple[Policy, ...] = ("block", "drop_oldest")
FLUSH_EVERY = 256  # publishes staged before they are sent without waiting for the loop
TALLY_EVERY = 1024  # messages tallied before they are handed to the telemetry
CACHED_TOPICS = 4096  # topics (and publishers) whose routes and names a node remembers
RELEASE_EVERY = 32  # messages read from one peer before their credit goes back (or none left)
_new = tuple.__new__  # Message(...) without its __new__'s keyword handling: once per message
# Ids a subscription remembers having delivered: retained messages (reread and live), and
# messages republished by gateways (their origin id), each delivered once within the window.
SEEN_IDS = 65536


class Message(NamedTuple):
    """A published message, as a subscription reads it (a tuple: cheap to make, per message)."""

    topic: str
    payload: bytes
    publisher: str  # the publishing node's hex id ("" for a message reread from the memory)
    missed: int = 0  # messages this subscription lost just before this one
    # A retained message's id (the memory holds it too), or a message's origin id as a gateway
    # republished it from another mesh; else None. A subscription delivers each id once.
    id: bytes | None = None
    # The W3C trace context it came with (b"": none): with tracing on, that of the span of
    # its delivery here. `irismesh.telemetry.tracing.context_of(message)` reads it.
    trace: bytes = b""


class _Hold:
    """The credit one message from a peer holds until every blocking subscription read it."""

    __slots__ = ("count", "routing_id")

    def __init__(self, count: int, routing_id: bytes) -> None:
        self.count = count
        self.routing_id = routing_id


class Subscription:
    """Messages on topics matching `pattern`: `async for msg in sub`, or `await sub.get()`.

    Use it as `async with node.subscribe(pattern) as sub:` so it ends with the block; `close()`
    ends it otherwise. Iteration stops when the subscription or its node closes.
    """

    def __init__(
        self,
        hub: PubSub,
        pattern: str,
        policy: Policy,
        maxsize: int,
        callback: Callable[[Message], object] | None = None,
    ) -> None:
        self.pattern = pattern
        self.policy = policy
        self.maxsize = maxsize
        self.missed = 0  # messages lost in all (dropped by the policy or in transit)
        self.received = 0
        self.errors = 0  # exceptions the callback raised
        self._hub = hub
        self._callback = callback
        self._blocking = policy == "block" and callback is None
        # (message, the credit it holds: None, a peer's routing id if this is its only blocking
        # subscription, else a _Hold shared by them)
        self._queue: deque[tuple[Message, _Hold | bytes | None]] = deque()
        self._gap = 0  # missed since the last message read
        # Credit of messages already read, not yet given back (see get_nowait): to this peer.
        self._owed = 0
        self._owed_to: bytes | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        # A subscription that rereads the memory: live messages wait in `_priming` until the
        # remembered ones are in, and a retained message is delivered once, live or reread.
        self._priming: deque[tuple[Message, _Hold | bytes | None, int]] | None = None
        self._seen: IdWindow | None = None  # ids delivered lately (made at the first id)
        self.duplicates = 0  # retained messages that came twice (reread and live): dropped once
        self.reread_error: MeshError | None = None  # why the memory could not be reread

    def __repr__(self) -> str:
        return f"<Subscription {self.pattern!r} {self.policy} {len(self._queue)}/{self.maxsize}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def qsize(self) -> int:
        """Messages waiting to be read."""
        return len(self._queue)

    def get_nowait(self) -> Message | None:
        """The next message if one is waiting, else None."""
        queue = self._queue
        if not queue:
            return None
        message, hold = queue.popleft()
        if self._gap:
            message = message._replace(missed=self._gap)
            self._gap = 0
        if type(hold) is bytes:
            # The credit goes back RELEASE_EVERY messages at a time, and whenever the buffer is
            # empty: a reader that has caught up never leaves its publishers waiting.
            if hold is not self._owed_to:
                self._pay()
                self._owed_to = hold
            owed = self._owed = self._owed + 1
            if owed >= RELEASE_EVERY or not queue:
                self._pay()
        elif hold is None:
            if self._blocking:
                self._hub._room_made()
        else:
            self._hub._done(hold)  # type: ignore[arg-type]
        return message

    def _pay(self) -> None:
        if self._owed and self._owed_to is not None:
            self._hub._release(self._owed_to, self._owed)
        self._owed = 0

    async def get(self, timeout: float | None = None) -> Message:
        """The next message; raises Closed once closed and drained, TimeoutError after timeout."""
        while True:
            message = self.get_nowait()
            if message is not None:
                return message
            if self._closed:
                raise Closed(f"subscription to {self.pattern!r} is closed")
            if self._callback is not None:
                raise ConfigurationError(
                    f"subscription to {self.pattern!r} hands its messages to its callback:"
                    " there is nothing to read"
                )
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await waiter
            finally:
                self._waiter = None

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Message:
        if self._queue:  # the common case, without a second coroutine
            message = self.get_nowait()
            if message is not None:
                return message
        try:
            return await self.get()
        except Closed:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop receiving; messages still buffered are dropped (their credit goes back)."""
        if self._closed:
            return
        self._closed = True
        self._hub._remove(self)
        self._discard_all()
        self._wake()

    def _discard_all(self) -> None:
        self._pay()
        while self._queue:
            _message, hold = self._queue.popleft()
            if type(hold) is bytes:
                self._hub._release(hold)
            elif hold is not None:
                self._hub._done(hold)  # type: ignore[arg-type]
        if self._blocking:
            self._hub._room_made()

    def _begin_priming(self) -> None:
        self._priming = deque()
        self._seen = IdWindow(SEEN_IDS)

    def _end_priming(self, remembered: list[Message]) -> None:
        """The remembered messages first, then the live ones that came meanwhile (each
        retained message once)."""
        pending, self._priming = self._priming or (), None
        for message in remembered:
            self._put(message, None, 0)
        for message, hold, gap in pending:
            self._put(message, hold, gap)

    def _seen_before(self, msg_id: bytes) -> bool:
        """Whether a message with this id was delivered here already, within the window of
        the last SEEN_IDS ids (a copy that comes later than that is delivered again)."""
        seen = self._seen
        if seen is None:
            seen = self._seen = IdWindow(SEEN_IDS)
        if seen.seen(msg_id):
            self._hub.duplicates += 1
            return True
        return False

    def _let_go(self, hold: _Hold | bytes | None) -> None:
        """A message dropped unread: the credit it held goes back."""
        if type(hold) is bytes:
            self._hub._release(hold)
        elif hold is not None:
            self._hub._done(hold)  # type: ignore[arg-type]

    def _put(self, message: Message, hold: _Hold | bytes | None, gap: int) -> int:
        """Queue a message; returns how many the policy dropped to make room (0 or 1)."""
        priming = self._priming
        if priming is not None:
            if not self._blocking and len(priming) >= self.maxsize:
                _old, old_hold, old_gap = priming.popleft()
                self._let_go(old_hold)
                self.missed += 1
                self._gap += old_gap + 1
            priming.append((message, hold, gap))
            return 0
        msg_id = message[4]
        if msg_id is not None and self._seen_before(msg_id):
            self.duplicates += 1
            self._let_go(hold)
            return 0
        self.received += 1
        if self._callback is not None:
            if gap:
                self.missed += gap
                message = message._replace(missed=gap)
            try:
                self._callback(message)
            except Exception:
                self._failed()
            return 0
        if gap:
            self.missed += gap
            self._gap += gap
        queue = self._queue
        if not self._blocking and len(queue) >= self.maxsize:
            queue.popleft()  # drop_oldest entries hold no credit
            self.missed += 1
            self._gap += 1
            dropped = 1
        else:
            dropped = 0
        queue.append((message, hold))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return dropped

    def _failed(self) -> None:
        """The callback raised (call it from the `except` block): count and log it."""
        self.errors += 1
        if self.errors & (self.errors - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... in the log
            _log.exception(
                "the callback of the subscription to %r raised (%d times so far)",
                self.pattern,
                self.errors,
            )

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Turns:
    """Publishes that wait for room take turns: the highest priority first, and publishes of
    one priority in the order they came. The publish whose turn it is holds it (`holder`, its
    priority) while it waits for room, then passes it on (`release`)."""

    def __init__(self) -> None:
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # (-priority, n, turn)
        self._count = 0
        self.holder: int | None = None

    def must_wait(self, priority: int) -> bool:
        """Whether a publish of `priority` comes after one that waits already (of its own
        priority or higher); a higher one may go ahead of the lower ones that wait."""
        holder = self.holder
        if holder is not None and holder >= priority:
            return True
        waiting = self._waiting
        return bool(waiting) and -waiting[0][0] >= priority

    async def acquire(self, priority: int) -> None:
        if self.holder is None and not self._waiting:
            self.holder = priority
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._count += 1
        heapq.heappush(self._waiting, (-priority, self._count, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # given the turn as it was cancelled
                self.release()
            raise

    def release(self) -> None:
        """The turn passes to the best publish still waiting (a cancelled one is skipped)."""
        self.holder = None
        waiting = self._waiting
        while waiting:
            negative, _n, turn = heapq.heappop(waiting)
            if not turn.done():
                self.holder = -negative
                turn.set_result(None)
                return


class PubSub:
    """A node's subscriptions and its publishing; the node feeds it MessagesArrived events."""

    def __init__(self, node_id: bytes, flush_soon: Callable[[], None], flush: Callable[[], None]):
        self._node_id = node_id.hex()
        self._flush_soon = flush_soon
        self._flush = flush
        self._core: MeshCore | None = None
        self._trie: TopicTrie[Subscription] = TopicTrie()
        self._routes: dict[str, tuple[tuple[Subscription, ...], int, Subscription | None]] = {}
        self._names: dict[bytes, str] = {}
        self._valid: set[str] = set()  # topics already checked
        self._subscriptions: set[Subscription] = set()
        self._turns = Turns()  # publishes that must wait queue here, by priority, in order
        self._room = asyncio.Event()
        self._interest = asyncio.Event()
        self._unflushed = 0
        self._driver_flush_soon = flush_soon  # the driver's own, once attached
        # Told when a publish waited for room: the event loop ran meanwhile (`Turns.turned`).
        self.waited: Callable[[], None] | None = None
        self.published = 0
        self.delivered = 0
        # Telemetry, when the node records: messages are tallied here, one dict update each,
        # and handed to `record(kind, topic, publisher, count, bytes, missed)` in bulk.
        self.record: Callable[[str, str, bytes | None, int, int, int], None] | None = None
        self._tally: dict[tuple[str, str, bytes | None], list[int]] = {}
        self._tallied = 0
        # Publish-to-deliver latency: one publish in `stamp_every()` carries this node's clock
        # (the telemetry's sampling rate), and subscribers time it with `record_delivery`.
        self.stamp_every: Callable[[], int] | None = None
        self._stamp_countdown = 1
        self.record_delivery: Callable[[str, bytes, float, int], None] | None = None
        self.unmatched = 0  # messages that arrived for no subscription (one just ended)
        self.duplicates = 0  # messages with an id a subscription had delivered: dropped
        # Tracing on (`telemetry.tracing`): a CONSUMER span for each message delivered with
        # trace context (the node publishes in PRODUCER spans, `Node.publish`).
        self.tracing: Tracing | None = None
        # Takes in the newest id of the retained messages of each arriving frame (the node's
        # memory clock: a retained write after reading one orders after it); None: nothing.
        self.observe_id: Callable[[bytes], None] | None = None

    def listen(self, on: Listen) -> None:
        """Sign up for the core's events this handles: messages, credit, interest."""
        on(MessagesArrived, self.deliver)
        on(CreditArrived, lambda _event: self.credit_arrived())
        on(InterestChanged, lambda _event: self.interest_changed())

    def attach(self, core: MeshCore, driver_flush_soon: Callable[[], None]) -> None:
        """Start with the node's core; the driver's `flush_soon` serves the publish hot path."""
        self._core = core
        self._driver_flush_soon = driver_flush_soon

    # ----------------------------------------------------------------- subscribing

    def subscribe(
        self,
        pattern: str,
        policy: Policy,
        maxsize: int,
        callback: Callable[[Message], object] | None = None,
        *,
        priming: bool = False,
    ) -> Subscription:
        core = self._running()
        pattern = validate_pattern(pattern)
        if policy not in POLICIES:
            raise ConfigurationError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if type(maxsize) is not int or maxsize < 1:
            raise ConfigurationError(f"maxsize must be a positive integer, not {maxsize!r}")
        if callback is not None and not callable(callback):
            raise ConfigurationError(f"callback must be callable, not {callback!r}")
        sub = Subscription(self, pattern, policy, maxsize, callback)
        if priming:
            sub._begin_priming()  # before any message can reach it
        self._subscriptions.add(sub)
        self._trie.add(pattern, sub)
        self._routes.clear()
        core.subscribe(pattern)
        self._flush_soon()
        return sub

    def end_priming(self, sub: Subscription, remembered: list[Message]) -> None:
        """A rereading subscription has the memory's messages: they go first, then the live
        ones that waited, and from now on live messages take the usual paths."""
        if sub._priming is None:
            return
        sub._end_priming(remembered)
        self._routes.clear()  # it may be a topic's one subscription again
        sub._wake()

    def _remove(self, sub: Subscription) -> None:
        if sub not in self._subscriptions:
            return
        self._subscriptions.discard(sub)
        self._trie.remove(sub.pattern, sub)
        self._routes.clear()
        if self._core is not None:
            with contextlib.suppress(Closed):
                self._core.unsubscribe(sub.pattern)
            self._flush_soon()

    def close(self) -> None:
        """The node closes: end every subscription and wake every waiting publisher."""
        self.flush_tally()
        for sub in list(self._subscriptions):
            sub._closed = True
            sub._discard_all()
            sub._wake()
        self._subscriptions.clear()
        self._core = None
        self._room.set()
        self._interest.set()

    # ----------------------------------------------------------------- receiving

    def deliver(self, event: MessagesArrived) -> None:
        """Messages from one peer into the subscriptions they match: the subscriber's hot path.

        A topic whose only subscription blocks or takes a callback (the common case) takes the
        inlined path: the message goes straight into that buffer (holding its credit until it
        is read) or to the callback. A publisher's messages come in runs of one topic, so a
        topic's route is looked up once per run and its messages are tallied once per run.
        """
        publisher = self._names.get(event.publisher)
        if publisher is None:
            publisher = self._name(event.publisher)
        routing_id = event.routing_id
        gaps = event.gaps
        stamps = event.stamps
        if stamps is not None:
            self._time_deliveries(event, stamps)
        ids = event.ids
        if ids and self.observe_id is not None:
            self.observe_id(max(ids.values()))
        traces = event.traces
        # No gap and no trace context: the one subscription takes the inlined path.
        plain = gaps is None and traces is None
        routes = self._routes
        counting = self.record is not None
        free = 0  # messages no blocking subscription holds: their credit goes back now
        slow = 0  # messages that took _deliver_one (it counts their deliveries)
        last: Subscription | None = None
        touched: list[Subscription] = []
        index = -1
        # The run of messages on one topic: its route, and what it tallies (inlined path).
        topic_now: str | None = None
        run_topic = ""
        route: tuple[tuple[Subscription, ...], int, Subscription | None] = ((), 0, None)
        only: Subscription | None = None
        run_count = run_bytes = 0
        for topic, payload in event.messages:
            index += 1
            if topic is not topic_now:
                if run_count:
                    self._count("deliver", run_topic, event.publisher, run_bytes, 0, run_count)
                    run_count = run_bytes = 0
                topic_now = run_topic = topic
                found = routes.get(topic)
                route = found if found is not None else self._route(topic)
                only = route[2] if plain else None
            if only is not None:
                msg_id = None
                if ids is not None:
                    msg_id = ids.get(index)
                    if msg_id is not None and only._seen_before(msg_id):
                        only.duplicates += 1  # a copy: dropped, its credit back now
                        free += 1
                        continue
                message = _new(Message, (topic, payload, publisher, 0, msg_id, b""))
                only.received += 1
                callback = only._callback
                if callback is None:
                    only._queue.append((message, routing_id))
                    if only is not last:
                        last = only
                        touched.append(only)
                else:
                    free += 1
                    try:
                        callback(message)
                    except Exception:
                        only._failed()
                    if not routes:  # the callback (un)subscribed: route afresh
                        topic_now = None
                if counting and (stamps is None or index not in stamps):
                    run_count += 1
                    run_bytes += len(payload)
                continue
            slow += 1
            free += self._deliver_one(
                route,
                topic,
                payload,
                publisher,
                event,
                gaps.get(index, 0) if gaps else 0,
                counting and (stamps is None or index not in stamps),
                ids.get(index) if ids else None,
                traces.get(index, b"") if traces else b"",
            )
            if not routes:  # a callback (un)subscribed: route afresh
                topic_now = None
        if run_count:
            self._count("deliver", run_topic, event.publisher, run_bytes, 0, run_count)
        self.delivered += index + 1 - slow
        for sub in touched:
            sub._wake()
        if free:
            self._release(routing_id, free)

    def _deliver_one(
        self,
        route: tuple[tuple[Subscription, ...], int, Subscription | None],
        topic: str,
        payload: bytes,
        publisher: str,
        event: MessagesArrived,
        gap: int,
        count: bool,
        msg_id: bytes | None = None,
        trace: bytes = b"",
    ) -> int:
        """One message, whatever its subscriptions; returns 1 if its credit can go back now.
        `count`: tally its delivery (not if it was timed). With its publisher's `trace`
        context and tracing on, it is delivered in a CONSUMER span (callbacks run in it)."""
        subs, blocking, _only = route
        if not subs:
            self.unmatched += 1
            return 1
        if trace and self.tracing is not None:
            span, token, trace = self.tracing.process(topic, trace, publisher)
            try:
                return self._deliver_to(
                    subs, blocking, topic, payload, publisher, event, gap, count, msg_id, trace
                )
            finally:
                self.tracing.leave(token)
                self.tracing.end(span)
        return self._deliver_to(
            subs, blocking, topic, payload, publisher, event, gap, count, msg_id, trace
        )

    def _deliver_to(
        self,
        subs: tuple[Subscription, ...],
        blocking: int,
        topic: str,
        payload: bytes,
        publisher: str,
        event: MessagesArrived,
        gap: int,
        count: bool,
        msg_id: bytes | None,
        trace: bytes,
    ) -> int:
        message = _new(Message, (topic, payload, publisher, 0, msg_id, trace))
        hold: _Hold | bytes | None
        if blocking == 1:
            hold = event.routing_id  # its one blocking subscription releases it
        elif blocking:
            hold = _Hold(blocking, event.routing_id)
        else:
            hold = None
        dropped = 0
        for sub in subs:
            dropped += sub._put(message, hold if sub._blocking else None, gap)
        self.delivered += len(subs)
        if count:
            self._count("deliver", topic, event.publisher, len(payload), gap + dropped)
        elif (gap or dropped) and self.record is not None:  # timed: only what it missed here
            self.record("deliver", topic, event.publisher, 0, 0, gap + dropped)
        return 0 if blocking else 1

    def _time_deliveries(self, event: MessagesArrived, stamps: dict[int, float]) -> None:
        """Messages their publisher stamped: the time from its clock to ours, each (counted
        there instead of in the tally)."""
        timed = self.record_delivery
        if timed is None or self.record is None:
            return
        now = time.time()
        messages = event.messages
        for index, stamp in stamps.items():
            topic, payload = messages[index]
            timed(topic, event.publisher, now - stamp, len(payload))

    def _route(self, topic: str) -> tuple[tuple[Subscription, ...], int, Subscription | None]:
        """The subscriptions a topic goes to, how many of them block, and the one subscription
        when that is all there is and it blocks: kept per topic."""
        subs = tuple(self._trie.match(topic))
        if len(self._routes) >= CACHED_TOPICS:
            self._routes.clear()
        blocking = sum(1 for sub in subs if sub._blocking)
        # The one subscription, when it buffers and blocks or hands messages to a callback.
        only = subs[0] if len(subs) == 1 and (blocking or subs[0]._callback) else None
        if only is not None and only._priming is not None:
            only = None  # its messages wait for the reread: the general path
        route = self._routes[topic] = (subs, blocking, only)
        return route

    def _name(self, node_id: bytes) -> str:
        if len(self._names) >= CACHED_TOPICS:
            self._names.clear()
        name = self._names[node_id] = node_id.hex()
        return name

    def _release(self, routing_id: bytes, count: int = 1) -> None:
        core = self._core
        if core is not None and core.release(routing_id, count):
            self._flush_soon()

    def _done(self, hold: _Hold) -> None:
        hold.count -= 1
        if hold.count == 0:
            self._release(hold.routing_id)

    def _room_made(self) -> None:
        if self._turns.holder is not None:
            self._room.set()

    def credit_arrived(self) -> None:
        self._room.set()

    def interest_changed(self) -> None:
        self._interest.set()

    # ----------------------------------------------------------------- publishing

    def publish_now(
        self, topic: str, payload: bytes, msg_id: bytes = b"", priority: int = 0, trace: bytes = b""
    ) -> int | None:
        """Publish if every target has room now (how many it went to), else None: then wait
        with `publish_later`. The publisher's hot path, without a coroutine of its own. A
        `trace` context goes with the message (`telemetry.tracing`)."""
        core = self._core
        if core is None:
            raise Closed("node is not running")
        if topic not in self._valid:
            self._check(topic)
        turns = self._turns
        if turns.holder is not None and turns.must_wait(priority):
            return None  # others of its priority (or higher) wait already: it queues behind
        if self._subscriptions:  # its own subscriptions may get it too
            return self._try(core, topic, payload, msg_id, trace)
        # _try without local subscriptions, inlined: a Python call fewer per publish.
        stamp = 0.0
        if self.stamp_every is not None:
            n = self._stamp_countdown - 1
            if n:
                self._stamp_countdown = n
            else:
                self._stamp_countdown = self.stamp_every()
                stamp = time.time()
        sent = core.pubsub.publish(topic, payload, stamp, msg_id, trace)
        if sent < 0:
            return None
        self.published += 1
        if self.record is not None:
            self._count("publish", topic, None, len(payload), 0)
        unflushed = self._unflushed = self._unflushed + 1
        if unflushed >= FLUSH_EVERY:
            self._unflushed = 0
            self._flush()
        else:
            self._driver_flush_soon()
        return sent

    async def publish(self, topic: str, payload: bytes, timeout: float) -> int:
        """Publish, waiting up to `timeout` for room (in order with other waiting publishes)."""
        sent = self.publish_now(topic, payload)
        if sent is not None:
            return sent
        return await self.publish_later(topic, payload, timeout)

    async def publish_later(
        self,
        topic: str,
        payload: bytes,
        timeout: float,
        msg_id: bytes = b"",
        priority: int = 0,
        trace: bytes = b"",
    ) -> int:
        """Wait for room, behind the publishes already waiting of its priority or higher,
        then publish; SlowConsumer after `timeout` (after `publish_now` found no room)."""
        deadline = time.monotonic() + timeout
        turns = self._turns
        try:
            async with asyncio.timeout(timeout):
                await turns.acquire(priority)
        except TimeoutError:
            raise SlowConsumer(topic, timeout, self._slow(self._running(), topic)) from None
        try:
            while True:
                self._room.clear()
                core = self._running()
                sent = self._try(core, topic, payload, msg_id, trace)
                if sent is not None:
                    return sent
                self._flush()  # what is staged goes out: the subscribers need it to make room
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SlowConsumer(topic, timeout, self._slow(core, topic))
                if self._room.is_set():  # room came as it flushed: try again at once
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._room.wait()
                if self.waited is not None:  # it waited: the loop had its turn meanwhile
                    self.waited()
        finally:
            turns.release()

    def _count(
        self, kind: str, topic: str, peer: bytes | None, size: int, missed: int, count: int = 1
    ) -> None:
        """Tally `count` messages of `size` bytes in all."""
        key = (kind, topic, peer)
        tally = self._tally.get(key)
        if tally is None:
            tally = self._tally[key] = [0, 0, 0]
        tally[0] += count
        tally[1] += size
        tally[2] += missed
        self._tallied += count
        if self._tallied >= TALLY_EVERY:
            self.flush_tally()

    def flush_tally(self) -> None:
        """Hand what was tallied to the telemetry (every TALLY_EVERY messages, and on demand)."""
        record, tally = self.record, self._tally
        self._tally, self._tallied = {}, 0
        if record is not None:
            for (kind, topic, peer), (count, size, missed) in tally.items():
                record(kind, topic, peer, count, size, missed)

    def _check(self, topic: str) -> None:
        validate_topic(topic)
        if len(self._valid) >= CACHED_TOPICS:
            self._valid.clear()
        self._valid.add(topic)

    def _try(
        self, core: MeshCore, topic: str, payload: bytes, msg_id: bytes = b"", trace: bytes = b""
    ) -> int | None:
        if self._subscriptions:
            route = self._routes.get(topic)
            if route is None:
                route = self._route(topic)
            local = route[0]
            for sub in local:
                if sub._blocking and len(sub._queue) >= sub.maxsize:
                    return None
        else:
            local = ()
        stamp = 0.0
        if self.stamp_every is not None:
            n = self._stamp_countdown - 1
            if n:
                self._stamp_countdown = n
            else:
                self._stamp_countdown = self.stamp_every()
                stamp = time.time()
        # The core's own: a call fewer.
        sent = core.pubsub.publish(topic, payload, stamp, msg_id, trace)
        if sent < 0:
            return None
        self.published += 1
        if self.record is not None:
            self._count("publish", topic, None, len(payload), 0)
        if local:
            message = _new(Message, (topic, payload, self._node_id, 0, msg_id or None, trace))
            for sub in local:
                sub._put(message, None, 0)
            self.delivered += len(local)
            sent += 1
        unflushed = self._unflushed = self._unflushed + 1
        if unflushed >= FLUSH_EVERY:
            self._unflushed = 0
            self._flush()
        else:
            self._driver_flush_soon()
        return sent

    def _slow(self, core: MeshCore, topic: str) -> list[str]:
        slow = [peer.hex() for peer in core.blocked_subscribers(topic)]
        for sub in self._trie.match(topic):
            if sub._blocking and len(sub._queue) >= sub.maxsize:
                slow.append(self._node_id)
                break
        return slow

    async def wait_for_subscribers(self, topic: str, count: int, timeout: float) -> int:
        core = self._running()
        topic = validate_topic(topic)
        deadline = time.monotonic() + timeout
        while True:
            found = len(core.subscribers(topic))
            if found >= count:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InterestTimeout(topic, count, found, timeout)
            self._interest.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._interest.wait()
            core = self._running()

    def _running(self) -> MeshCore:
        if self._core is None:
            raise Closed("node is not running")
        return self._core
