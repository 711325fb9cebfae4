"""Priorities (classes of service, "silver"): a small signed integer per request.

A request (or a publish) carries a priority: an int from `MIN_PRIORITY` to `MAX_PRIORITY`,
higher is more important, 0 is the default. `Priority` names three of them, which is all most
meshes need: LOW (-1) for background work that may wait, NORMAL (0), HIGH (1) for what a person
waits on. Any other int of the range is allowed for finer orders.

Where it counts: the member's handler queue (`admission`: the higher class is served first,
turned away last, and the lower keeps a reserved share so that it is never starved), every
outbox on the way (`outbox`: staged calls and replies of a higher class are sealed and sent
before those of a lower one, in frames of their own), the driver (a long run of arrivals hands
the higher classes to the handlers first) and the publisher's wait for credit.

On the wire, a REQUEST's priority rides in the high nibble of its acknowledgement-count byte
(two's complement, so 0, the default, is the byte old nodes send): no byte more. A member says
it understands priorities in its WELCOME (`caps["prio"]`); a caller sends a member that does not
say so every request at the default priority, so old members never see a byte they would reject.
"""

from __future__ import annotations

import enum
from typing import Final

from irismesh.errors import ConfigurationError

MIN_PRIORITY: Final = -7
MAX_PRIORITY: Final = 7


class Priority(enum.IntEnum):
    """The named priorities; any int from MIN_PRIORITY to MAX_PRIORITY is one too."""

    LOW = -1
    NORMAL = 0
    HIGH = 1


def check_priority(priority: object) -> int:
    """`priority` as a plain int, or ConfigurationError saying what is allowed."""
    if type(priority) is not int and not isinstance(priority, Priority):
        raise ConfigurationError(
            f"priority must be an int from {MIN_PRIORITY} to {MAX_PRIORITY} (or a Priority), "
            f"not {type(priority).__name__}"
        )
    value = int(priority)
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ConfigurationError(
            f"priority must be from {MIN_PRIORITY} to {MAX_PRIORITY}, got {value}"
        )
    return value


def label(priority: int) -> str:
    """The name counters use for a priority: "low", "normal", "high", else "p<int>"."""
    if priority == 0:
        return "normal"
    if priority == 1:
        return "high"
    if priority == -1:
        return "low"
    return f"p{priority}"
