"""The asyncio driver: what every transport shares (`Driver`).

`Driver` feeds frames to the core and flushes what it sends; a transport's driver reads and
writes its links: `irismesh._stream.StreamDriver` (TCP, the default) or
`irismesh._zmqdriver.ZmqDriver` (zmq, imported only by a node that runs on it). Both keep to
the batching here.

With many requests in flight, each side should work on one batch while the other works on
the next. So a member answers a long run of requests in slices of equal length (`slice_length`),
flushing after each: read together, two batches of replies would go back as one, and each side
would wait while the other worked on the whole window. One timer (`call_at`) fires when the
core next has something to do (a probe, a deadline, a ping, housekeeping:
`MeshCore.next_deadline`); before the core's tick, all links are drained so that what arrived
during a stall of this loop counts as heard, not as silence.

This module is compiled by mypyc together with the core (see setup.py and irismesh._core),
so its attributes are typed slots and its calls into the core are native; it runs as Python
wherever the core does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from irismesh._core.engine import MeshCore
from irismesh._core.events import CloseLink, Event, OpenLink, RequestArrived
from irismesh._datagrams import DatagramSocket
from irismesh._spin import Spin

_monotonic = time.monotonic  # bound once: the clock is read for every frame

BATCH = 256
# Events handled between two flushes, in a long run of them: enough that a batch from a caller
# with 100 requests in flight goes back in one or two frames (at 16 it went back in about six,
# and both sides spent about a tenth more CPU per request, measured), few enough that in a
# longer run the peer works on the first replies while this side does the rest.
EVENT_SLICE = 64


def slice_length(count: int) -> int:
    """How many of `count` events go between two flushes: at most EVENT_SLICE, in slices of
    equal length (a run of 100 goes back as two frames of 50, not 64 and 36: the peer's next
    two batches are then alike, and neither side waits long for the other's larger one)."""
    slices = -(-count // EVENT_SLICE)
    return -(-count // slices)


def urgent_first(events: list[Event]) -> list[Event]:
    """`events` with the requests above the default priority moved to the front, highest
    first (the handlers take them before the rest of a run of arrivals; every other event
    keeps its place and order, and a request moved forward stays ahead of its cancel)."""
    urgent: list[RequestArrived] = []
    rest: list[Event] = []
    for event in events:
        if isinstance(event, RequestArrived) and event.priority > 0:  # traced ones too
            urgent.append(event)
        else:
            rest.append(event)
    if not urgent:
        return events
    urgent.sort(key=lambda e: -e.priority)
    return [*urgent, *rest]


class Driver:
    """Connects one MeshCore to the network and the event loop: what every transport shares
    (dispatching the core's events, sending in slices, the timer, partners). A transport's
    driver (`_zmqdriver.ZmqDriver`, `_stream.StreamDriver`) reads and writes its links."""

    def __init__(
        self,
        core: MeshCore,
        loop: asyncio.AbstractEventLoop,
        on_events: Callable[[list[Event]], None],
        datagrams: DatagramSocket,
    ) -> None:
        self.core = core
        core.batching = True  # seal what one flush sends on a link together
        self.loop = loop  # the event loop it runs on (its clock is the core's)
        self._on_events = on_events
        self._timer: asyncio.TimerHandle | None = None
        self.timer_at = float("inf")  # when the timer fires next (read it; `arm` sets it)
        # A pass that flushes and re-checks input is queued on the loop (read it; `flush_soon`
        # sets it): a request staged meanwhile goes out in that pass.
        self.flush_pending = False
        self._closed = False
        self._max_frame = core.config.max_frame
        # Opt-in busy polling (seconds): after serving, poll the listening socket up to this
        # long for the next request before returning to the loop, while `idle()` says no
        # handler waits, and while `request_spin` finds that it pays (see irismesh._spin).
        self.busy_poll = 0.0
        self.request_spin: Spin | None = None
        self._served_at = 0.0  # when the wait for the next request began (0.0: not timed)
        self._served_spun = False  # ... and whether it was spent spinning
        self.idle: Callable[[], bool] = lambda: True
        # Drivers of other nodes of this process whose cores this one's relays requests to or
        # answers (`Node.relay_requests`): what a drain here staged in theirs is sent at its
        # end (`_flush_partners`), not a turn of the loop later.
        self.partners: list[Driver] = []
        self._datagrams = datagrams
        receive = core.receive_datagram
        datagrams.start(
            loop,
            lambda source, data: receive(source, data, _monotonic()),
            self.process,
            core.stats,
        )

    # ----------------------------------------------------------------- what a transport does

    async def serve(self) -> None:
        """Start accepting the links peers dial (before `start`)."""

    def drain_all(self) -> None:
        """Read every link with input waiting (before the core's tick)."""
        raise NotImplementedError

    def _send(self) -> None:
        """Seal what is staged and send the core's frames and datagrams."""
        raise NotImplementedError

    def _seal_and_send_datagrams(self) -> None:
        """What every `_send` does first: seal what is staged (returns at once when nothing
        is), and send membership's datagrams."""
        core = self.core
        core.seal_staged()
        if core.membership.outbox:
            send_datagram = self._datagrams.send
            for address, datagram in core.take_datagrams():
                send_datagram(address, datagram)

    def _recheck_input(self) -> None:
        """The pass `flush_soon` queued: flush, then read the links marked for a look."""
        raise NotImplementedError

    def _open(self, event: OpenLink) -> None:
        raise NotImplementedError

    def _close_link(self, link_id: int) -> None:
        raise NotImplementedError

    def spin(self, link_id: int, seconds: float, done: Callable[[], bool]) -> None:
        """Poll one dialled link for up to `seconds` until `done()`, not yielding (opt-in)."""
        raise NotImplementedError

    async def wait_closed(self, timeout: float) -> None:
        """After `close`: wait up to `timeout` for what was sent to be gone."""

    def close(self, linger_ms: int = 200) -> None:
        """Flush goodbyes (given `linger_ms` to leave) and close every socket."""
        raise NotImplementedError

    # ----------------------------------------------------------------- output

    def process(self) -> None:
        """Dispatch the core's events, then send its frames (and again, for the events that
        sending found: failed links). Links are opened as their events come, before anything
        is sent on them, or their HELLOs would be lost; links are closed after what was
        queued for them is sent, or their BYEs would be."""
        core = self.core
        outbox = core.outbox
        while True:
            while outbox.events:
                events = outbox.events
                outbox.events = []
                if outbox.link_events:  # links to open or close among them
                    outbox.link_events = False
                    closing: list[int] = []
                    for event in events:
                        if isinstance(event, OpenLink):
                            self._open(event)
                        elif isinstance(event, CloseLink):
                            closing.append(event.link_id)
                    if closing:
                        # What the core queued on a link before closing it goes out first:
                        # its BYE, and the cancels or frames staged just before.
                        self._send()
                        for link_id in closing:
                            self._close_link(link_id)
                if core.calls.urgent:  # requests above the default priority came: first
                    core.calls.urgent = False
                    events = urgent_first(events)
                if len(events) <= EVENT_SLICE:
                    self._on_events(events)
                    continue
                # A long run of events (a batch of requests): send the replies of each slice
                # as it is done, so that the peer works on them while this side does the rest
                # (one batch answered whole would leave each side idle while the other works).
                step = slice_length(len(events))
                for start in range(0, len(events), step):
                    self._on_events(events[start : start + step])
                    if not outbox.events:  # nothing to open first
                        self._send()
            self._send()
            if not outbox.events:
                return

    def _flush_partners(self) -> None:
        """Send what a drain here staged in the partners' cores (relayed requests, their
        replies). Only a drain calls this, as a callback of the loop of its own, so no
        partner is inside its own pass (a pass entered twice would reorder its events)."""
        for partner in self.partners:
            outbox = partner.core.outbox
            if not partner._closed and (
                outbox.staged_out
                or outbox.staged_in
                or outbox.events
                or outbox.out_frames
                or outbox.in_frames
            ):
                partner.process()
                # The requests relayed to it came without a `Caller`, which arms the timer for
                # a request's deadline: arm it here, so one whose member never answers fails
                # at its deadline, not at the partner's next tick.
                if partner.core.calls.relaying:
                    due = partner.core.calls.pending.next_deadline()
                    if due is not None and due < partner.timer_at:
                        partner.arm(due)

    def flush(self) -> None:
        """Send what the core queued (after the links it asked for are open)."""
        self.process()

    def _dialled_link_read(self) -> None:
        """Frames were read on a dialled link: the flush is queued (see the drivers), and
        what they staged in partners' cores goes out now."""
        self.flush_soon()
        if self.partners:
            self.process()
            self._flush_partners()

    def flush_soon(self) -> None:
        """Send what the core queued, once, at the end of this loop iteration."""
        if not self.flush_pending:
            self.flush_pending = True
            self.loop.call_soon(self._recheck_input)

    def arm(self, when: float) -> None:
        """Make sure the timer fires no later than `when`."""
        if when < self.timer_at and not self._closed:
            if self._timer is not None:
                self._timer.cancel()
            self.timer_at = when
            self._timer = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.timer_at = float("inf")
        if self._closed:
            return
        self.drain_all()
        now = _monotonic()
        self.core.tick(now)
        self.process()
        self.arm(max(self.core.next_deadline(now), now + 0.001))

    def start(self) -> None:
        self.arm(_monotonic())

    def _request_came(self) -> None:
        """Busy polling: a request came after a wait that began when the last was served."""
        spin = self.request_spin
        if spin is not None:
            spin.observe(self._served_spun, time.perf_counter() - self._served_at)
        self._served_at = 0.0

    def _spin_for_requests(self, poll: Callable[[float], bool], take: Callable[[], None]) -> None:
        """After serving (opt-in `busy_poll`): `poll(until)` for the next request while no
        handler awaits, for as long as `request_spin` finds that pays, and `take()` what it
        caught. The transport gives the two; the policy is the same on each."""
        spin, clock = self.request_spin, time.perf_counter
        spun = False
        while self.idle():
            began = clock()
            budget = self.busy_poll if spin is None else spin.budget()
            if not budget:
                break
            spun = True
            caught = poll(began + budget)
            now = clock()
            if spin is not None:
                spin.spun(now - began, caught)
            if not caught:
                # The wait goes on in the loop; the request that ends it tells how long it was.
                self._served_at, self._served_spun = began, True
                self.flush_soon()
                return
            if spin is not None:
                spin.observe(True, now - began)
            take()
            self.process()
        self._served_at, self._served_spun = (clock(), False) if self.idle() else (0.0, False)
        if spun:
            self.flush_soon()
