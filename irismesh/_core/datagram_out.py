"""Membership's datagrams on their way out: piggybacking, table exchanges, sealing.

Every datagram membership sends goes through one `DatagramOut`: it fills what room a datagram
has left with queued updates (each retransmitted about λ·log N times), splits a whole-table
exchange into datagrams that fit, numbers each datagram for the receivers' replay windows and
seals it under the mesh key; it also seals the node's name for its handshakes, from the same
sequence of counters. Sans I/O: datagrams wait in `outbox` for the driver.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from irismesh._core.broadcasts import TransmitQueue, transmit_limit
from irismesh._core.gossip import (
    HEADER_SIZE,
    DatagramSealer,
    encode_compound,
    encode_message,
    encode_single,
    encode_state,
    seal_datagram,
    seal_name,
)
from irismesh._core.records import MemberRecord, MembershipConfig


class DatagramOut:
    """Packs, numbers and seals one node's membership datagrams."""

    def __init__(
        self,
        sender: bytes,
        *,
        sealer: DatagramSealer,
        config: MembershipConfig,
        population: Callable[[], int],
        stats: Counter[str],
    ) -> None:
        self.outbox: list[tuple[str, bytes]] = []  # (address, datagram)
        self.queue = TransmitQueue()  # updates waiting to be piggybacked
        self._sender = sender
        self._sealer = sealer
        self._config = config
        self._population = population  # nodes in the mesh, this one counted
        self._stats = stats
        self._counter = 0

    def take(self) -> list[tuple[str, bytes]]:
        """The datagrams waiting, handed over to the driver."""
        datagrams = self.outbox
        if datagrams:
            self.outbox = []
        return datagrams

    def send(self, address: str, messages: list[list[Any]]) -> None:
        """Messages to one address, with as many queued updates as fit beside them."""
        self.send_packed(address, [encode_message(m) for m in messages], piggyback=True)

    def send_packed(self, address: str, packed: list[bytes], *, piggyback: bool) -> None:
        if piggyback and self.queue:
            used = sum(len(p) + 2 for p in packed)
            budget = self._config.max_datagram - HEADER_SIZE - self._sealer.overhead - 3 - used
            limit = transmit_limit(self._config.retransmit_multiplier, self._population())
            packed = packed + self.queue.take(budget, limit)
        if not packed:
            return
        body = encode_compound(packed) if len(packed) > 1 else encode_single(packed[0])
        self._counter += 1
        datagram = seal_datagram(self._sealer, self._sender, self._counter, body)
        self.outbox.append((address, datagram))
        self._stats["datagrams_sent"] += 1

    def seal_name(self, name: str) -> bytes:
        """`name` sealed for this node's handshake records, its counter the next datagram's
        (a nonce is never used twice under the node's key)."""
        self._counter += 1
        return seal_name(self._sealer, self._sender, self._counter, name)

    def send_state(self, address: str, entries: Iterable[bytes], *, reply: bool) -> None:
        """A whole table (`state_entry`s) to one address, in as many datagrams as it takes;
        only the first asks for the partner's table in return."""
        flag = reply
        budget = self._config.max_datagram - HEADER_SIZE - self._sealer.overhead - 16
        chunk: list[bytes] = []
        size = 0
        for entry in entries:
            if chunk and size + len(entry) > budget:
                self.send_packed(address, [encode_state(flag, chunk)], piggyback=False)
                chunk, size, flag = [], 0, False  # one reply for the whole table
            chunk.append(entry)
            size += len(entry)
        self.send_packed(address, [encode_state(flag, chunk)], piggyback=False)


def state_entry(record: MemberRecord, incarnation: int, state: int) -> bytes:
    """One member's line in a table exchange."""
    entry = [record.node_id, incarnation, state, record.endpoint, record.address, record.tags]
    return encode_message([*entry, record.name, record.public, record.signature])


def push_pull_interval(base: float, nodes: int) -> float:
    """memberlist's scaling: longer as the mesh grows past 32 nodes, so that the cost of
    whole-table exchanges stays flat per node."""
    scale = 1 if nodes <= 32 else math.ceil(math.log2(nodes) - math.log2(32)) + 1
    return base * scale


__all__ = ["DatagramOut", "push_pull_interval", "state_entry"]
