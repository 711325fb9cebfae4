"""An in-process link between two gateways of one process (see `irismesh.federation.local`).

`LocalEnd` is a `LinkEnd` whose peer is another gateway object in the same process and event
loop: items are handed over as they are (the same lists, no sealing, no msgpack, no socket),
reliable and in order by construction. It keeps the TCP link's flow control: at most `window`
reliable items are handed to the peer and not yet consumed by it, the rest wait here, and at
most `buffer` wait in all (beyond that each is dropped and counted, `dropped_buffer_full`), so
a slow importer holds the exporter back exactly as across a TCP link. Plain items (requests,
replies, tunnels) are handed over at the next flush, in order, while the link is up.

The end sits among the `LinkTransport`'s ends (`LinkTransport.attach`), so the gateway sees
the same interface as for a TCP link: its `flush` hands items over, the liveness timer leaves
the end alone (it is up from both gateways' start until either closes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from irismesh.federation.link import OnItems, OnState
from irismesh.federation.linkproto import Item, LinkEnd


def _nothing() -> None:
    pass


def _no_items(_end: LinkEnd, _items: list[Item]) -> None:
    pass


def _no_state(_end: LinkEnd, _up: bool) -> None:
    pass


@dataclass(slots=True, eq=False)
class LocalEnd(LinkEnd):
    """One gateway's end of an in-process link (see the module's docstring)."""

    other: LocalEnd | None = None
    _waiting: deque[Item] = field(default_factory=deque)  # reliable, not handed over yet
    _handed: deque[Item] = field(default_factory=deque)  # handed over, not consumed yet
    _room: bool = False  # the peer consumed some: tell this end's gateway
    _deliver: OnItems = _no_items  # this end's gateway's, for what arrives here
    _state: OnState = _no_state
    _flush_soon: Callable[[], None] = _nothing

    def __post_init__(self) -> None:
        self.stream = self.random_bytes(8)  # no link keys: nothing is sealed

    @property
    def buffered(self) -> int:
        return len(self._waiting) + len(self._handed)

    def send(self, item: Item) -> bool:
        if len(self._waiting) + len(self._handed) >= self.config.buffer:
            self.stats["dropped_buffer_full"] += 1
            return False
        self._waiting.append(item)
        return True

    def outgoing(self, now: float) -> list[bytes]:
        """Hand what waits over to the peer now (nothing goes on a wire)."""
        other = self.other
        if not self.up or other is None:
            return []
        items: list[Item] = []
        window = self.config.window
        waiting, handed = self._waiting, self._handed
        while waiting and len(handed) < window:
            item = waiting.popleft()
            handed.append(item)
            items.append(item)
        if self._plain:
            items.extend(self._plain)
            self._plain.clear()
        if items:
            self.stats["items_handed"] += len(items)
            other._deliver(other, items)
        if self._room:
            self._room = False
            self._deliver(self, [])  # acks made room: exporters waiting on it look again
        return []

    def consumed(self, count: int = 1) -> None:
        """This end's gateway is done with `count` reliable items: the peer forgets them."""
        other = self.other
        if other is not None:
            other.acknowledged(count)

    def acknowledged(self, count: int) -> None:
        handed = self._handed
        count = min(count, len(handed))
        if count <= 0:
            return
        acked = self.acked_items  # a list where redundant gateways tell what was delivered
        for _ in range(count):
            item = handed.popleft()
            if acked is not None:
                acked.append(item)
        self._room = True
        self._flush_soon()

    def unacknowledged(self, since: int = 0, now: float | None = None) -> tuple[list[Item], int]:
        """Nothing to carry over to another link (`Gateway._carry_over`): an in-process link
        goes down only as one of its gateways closes, and its items go with it."""
        return [], since

    def tick(self, now: float) -> bool:
        return False  # up from both gateways' start until either closes

    def silent_for(self, now: float) -> float:
        return 0.0

    def hello_due(self, now: float) -> bool:
        return False

    def use_secrets(self, secrets: tuple[bytes, ...]) -> bool:
        return False  # no link key: the two ends share a process

    def down(self) -> None:
        """Either gateway closes: the link is down at both ends."""
        if not self.up:
            return
        self.stats["downs"] += 1
        self.up = False
        self._plain.clear()
        other = self.other
        if other is not None and other.up:
            other.down()
            other._state(other, False)


def up(a: LocalEnd, b: LocalEnd) -> None:
    """Both gateways have started: the link is up, and each gateway is told."""
    for end in (a, b):
        if not end.up:
            end.up = True
            end.stats["ups"] += 1
    for end in (a, b):
        end._state(end, True)
        end._flush_soon()
