"""The event loop irismesh runs its own programs on: uvloop where it is installed.

uvloop (libuv under asyncio's API) carries messages about a fifth faster than asyncio's own
loop here, so the `mesh` command, the examples, the demo and `irismesh.sync.Node` use it. A
library user who runs their own loop keeps it: irismesh works on any asyncio loop, and choosing
uvloop is one line (`irismesh.run(main())`, or `asyncio.run(main(),
loop_factory=uvloop.new_event_loop)` on Python 3.12). `IRISMESH_LOOP=asyncio` in the
environment keeps asyncio's own loop everywhere, to compare or to debug.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes irismesh's loops: uvloop's where installed (and not turned off)."""
    if os.environ.get("IRISMESH_LOOP", "").lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """`asyncio.run(main)`, on uvloop where installed."""
    with asyncio.Runner(debug=debug, loop_factory=loop_factory()) as runner:
        return runner.run(main)


__all__ = ["loop_factory", "new_event_loop", "run"]
