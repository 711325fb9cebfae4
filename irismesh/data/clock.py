"""A hybrid logical clock: timestamps that follow wall time yet respect causality.

Theory of operation
-------------------
As Kulkarni, Demirbas et al. define it ("Logical Physical Clocks", 2014), a timestamp is a pair
(wall, logical): `wall` is the largest physical time this node has heard of, its own or carried
by a message, and `logical` counts events that happened while `wall` stood still. So

- a stamp taken after seeing another is larger than it, whatever the two machines' clocks say
  (a node whose clock lags still orders its write after the one it read);
- `wall` never runs more than the largest clock skew ahead of the true time, and `logical`
  stays small (it resets whenever the physical clock moves past `wall`).

Stamps compare as tuples (wall, logical, node): the node id breaks the ties of two concurrent
events, so any two stamps of different nodes are ordered and a register's merge is a total
order. Physical time is passed in (milliseconds): the clock does no I/O.

A stamp from a peer whose `wall` is more than `max_ahead` ms ahead of this node's physical
clock is not taken into `wall` (a clock set a year ahead would otherwise drag every node with
it) and is counted in `refused_ahead`; a register still orders a write after the value it
replaces, whatever that value's stamp (`LWWRegister.assign`).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MAX_AHEAD_MS", "HybridClock", "Stamp"]

MAX_AHEAD_MS = 60_000  # a peer's wall time further ahead than this is not adopted


class Stamp(NamedTuple):
    """A hybrid logical timestamp; tuple order is the clock's order."""

    wall: int  # milliseconds since the epoch
    logical: int
    node: bytes


class HybridClock:
    """One node's hybrid logical clock."""

    __slots__ = ("logical", "max_ahead", "node", "refused_ahead", "wall")

    def __init__(self, node: bytes, *, max_ahead: int = MAX_AHEAD_MS) -> None:
        self.node = node
        self.wall = 0
        self.logical = 0
        self.max_ahead = max_ahead
        self.refused_ahead = 0

    def now(self, physical: int) -> Stamp:
        """A stamp for a local event (a write, or a message sent) at `physical` ms."""
        if physical > self.wall:
            self.wall, self.logical = physical, 0
        else:
            self.logical += 1
        return Stamp(self.wall, self.logical, self.node)

    def observe(self, stamp: Stamp, physical: int) -> None:
        """Take in a stamp carried by a message received at `physical` ms."""
        wall, logical = stamp.wall, stamp.logical
        if wall > physical + self.max_ahead:
            self.refused_ahead += 1
            return
        top = max(self.wall, wall, physical)
        if top == self.wall == wall:
            self.logical = max(self.logical, logical) + 1
        elif top == self.wall:
            self.logical += 1
        elif top == wall:
            self.logical = logical + 1
        else:
            self.logical = 0
        self.wall = top
