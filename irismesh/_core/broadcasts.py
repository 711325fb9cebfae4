"""Membership updates waiting to be piggybacked: each sent a limited number of times.

SWIM spreads joins, suspicions, deaths and leaves by piggybacking them on the datagrams the
protocol sends anyway (probes, acks, gossip). Each update is retransmitted up to `limit` times,
about λ·log N (`transmit_limit`), which in an epidemic reaches every node with high
probability. The queue holds at most one update per node: a newer update about a node replaces
the older one (an ALIVE with a higher incarnation makes an older SUSPECT worthless). Updates
sent fewer times go first, so a fresh update overtakes one that has already spread, and the
queue is bounded: past `capacity`, the update sent most often is dropped (and counted).

Updates are kept in buckets by transmit count, so taking k updates costs O(k) whatever the
queue's size (a node that just joined a large mesh may queue thousands of ALIVEs).
"""

from __future__ import annotations

import math


def transmit_limit(multiplier: int, members: int) -> int:
    """How often an update is sent: `multiplier` x ceil(log10(members + 1))."""
    return multiplier * max(1, math.ceil(math.log10(members + 1)))


class TransmitQueue:
    """Packed updates keyed by the node they are about, fewest transmissions first."""

    __slots__ = ("_buckets", "_where", "capacity", "dropped")

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self.dropped = 0
        # transmits -> {node id: packed update}; dicts keep insertion order (oldest first).
        self._buckets: dict[int, dict[bytes, bytes]] = {}
        self._where: dict[bytes, int] = {}  # node id -> its update's bucket

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._where

    def queue(self, node_id: bytes, packed: bytes) -> None:
        """Queue an update about `node_id`, replacing any older one about it."""
        self._discard(node_id)
        if len(self._where) >= self.capacity:
            self._drop_most_sent()
        self._buckets.setdefault(0, {})[node_id] = packed
        self._where[node_id] = 0

    def take(self, budget: int, limit: int, overhead: int = 2) -> list[bytes]:
        """Updates for one datagram: at most `budget` bytes, each charged `overhead` more.

        Each update taken counts one transmission; one sent `limit` times leaves the queue.
        """
        taken: list[bytes] = []
        if not self._where:
            return taken
        moves: list[tuple[bytes, bytes, int]] = []
        for transmits in sorted(self._buckets):
            bucket = self._buckets[transmits]
            for node_id, packed in bucket.items():
                cost = len(packed) + overhead
                if cost > budget:
                    if budget < 32:  # nothing else will fit either
                        break
                    continue
                budget -= cost
                taken.append(packed)
                moves.append((node_id, packed, transmits))
            if budget < 32:
                break
        for node_id, packed, transmits in moves:
            del self._buckets[transmits][node_id]
            if not self._buckets[transmits]:
                del self._buckets[transmits]
            if transmits + 1 >= limit:
                del self._where[node_id]
            else:
                self._buckets.setdefault(transmits + 1, {})[node_id] = packed
                self._where[node_id] = transmits + 1
        return taken

    def clear(self) -> None:
        self._buckets.clear()
        self._where.clear()

    def _discard(self, node_id: bytes) -> None:
        transmits = self._where.pop(node_id, None)
        if transmits is not None:
            bucket = self._buckets[transmits]
            del bucket[node_id]
            if not bucket:
                del self._buckets[transmits]

    def _drop_most_sent(self) -> None:
        most = max(self._buckets)
        node_id = next(iter(self._buckets[most]))
        self._discard(node_id)
        self.dropped += 1
