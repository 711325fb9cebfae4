"""Tunnels: the part of the Node API for ordered, flow-controlled streams to one member.

`Node` inherits it; the node's `Tunnels` (`patterns.tunnel`) does the work.
"""

from __future__ import annotations

from typing import TypeVar

from irismesh._nodestate import NodeState
from irismesh.errors import ConfigurationError, MeshError
from irismesh.patterns.tunnel import (
    DEFAULT_MAX_MESSAGE,
    DEFAULT_WINDOW,
    Tunnel,
    TunnelHandler,
    TunnelOpening,
)

T = TypeVar("T", bound=TunnelHandler)


class TunnelApi(NodeState):
    """Node's methods for tunnels."""

    def on_tunnel(self, handler: T, *, accept: bool = True) -> T:
        """Decorator: `async def handler(tunnel)` serves each tunnel a caller opens to this member.

        The tunnel closes when the handler returns; if it raises, the caller's end is reset
        with the error's message. With `accept=False` (`node.on_tunnel(handler, accept=False)`)
        the handler gets the tunnel unaccepted, the caller's `node.tunnel` still waiting: it
        calls `tunnel.accept()`, or `tunnel.reset(reason)` to refuse it (a reason starting
        "no live member" makes the caller's `node.tunnel` raise NoResponders).
        """
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster serves no tunnels: pass cluster=")
        self._tunnels.handler = handler
        self._tunnels.accept_first = accept
        return handler

    def tunnel(
        self,
        cluster: str,
        *,
        timeout: float | None = None,
        window: int = DEFAULT_WINDOW,
        max_message: int = DEFAULT_MAX_MESSAGE,
    ) -> TunnelOpening:
        """Open an ordered, flow-controlled stream to one live member of `cluster`.

        `async with node.tunnel("db", timeout=1.0) as t: await t.send(b"..."); await t.recv()`
        (or `t = await node.tunnel(...)` and `await t.close()`). Raises NoResponders at once
        without a member, RequestTimeout if none accepted within `timeout`, TunnelReset if the
        member refused. `window` is what this end buffers unread, in bytes.
        """
        timeout = self._default_timeout if timeout is None else timeout
        if not timeout > 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        if type(window) is not int or not 1 <= window <= 1 << 30:
            raise ConfigurationError(f"window must be 1 byte to 1 GiB, got {window!r}")
        if type(max_message) is not int or max_message < 1:
            raise ConfigurationError(f"max_message must be a positive int, got {max_message!r}")

        async def opener() -> Tunnel:
            try:
                self._caller.running()
                remaining = await self._linked(cluster, timeout, every=False)
                return await self._tunnels.open(cluster, remaining, window, max_message)
            except MeshError:
                await self._caller.turns.maybe_pause()  # refused at once: still fair
                raise

        return TunnelOpening(opener)
