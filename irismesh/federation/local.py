"""`LocalGateways`: one process with a foot in several meshes, their gateways joined in-process.

A gateway pair joins two meshes over TCP: each gateway process is a node of one mesh, and a
request crossing takes three hops (caller, near gateway, link, far gateway, member). Where one
host can reach both segments, one process can hold a gateway of each mesh instead, each with
its own keyring, seeds, discovery and exports, and join them with an in-process link
(`locallink.LocalEnd`): items are handed over as they are, reliable and ordered by
construction, with the TCP link's window and buffer bounds. Everything a TCP link carries
crosses it the same way (requests, broadcasts, surveys, topics with their origin ids and the
meshes they have seen, tunnels with their windows, the gateways' stats for `mesh top`), since
to each `Gateway` the other is one more link end.

Each gateway's node holds only its own mesh's keyring, but the process holds both, and so
sees the exported traffic of every mesh it joins (SECURITY.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable
from typing import Any

from irismesh.errors import ConfigurationError
from irismesh.federation.gateway import Gateway, new_context
from irismesh.federation.locallink import LocalEnd, up

__all__ = ["LocalGateways"]


def _join(first: Gateway, second: Gateway) -> tuple[LocalEnd, LocalEnd]:
    """A `LocalEnd` in each gateway's transport, the two linked (down until both start)."""
    ends: list[LocalEnd] = []
    for own in (first, second):
        transport = own.transport
        end = LocalEnd(
            gateway_id=own.gateway_id,
            mesh=own.mesh,
            secrets=(),
            exports=own.export,
            dialler=True,  # never forgotten, as a silent end that dialled in would be
            config=transport.config,
            auto_consume=False,  # acknowledged once republished, as across TCP
        )
        end._deliver, end._state = transport.attach(end)
        end._flush_soon = transport.flush_soon
        ends.append(end)
    a, b = ends
    a.other, b.other = b, a
    a.peer_id, a.peer_mesh, a.peer_exports = second.gateway_id, second.mesh, second.export
    b.peer_id, b.peer_mesh, b.peer_exports = first.gateway_id, first.mesh, first.export
    # Requests skip the items: handed to the far gateway, which asks its mesh at once.
    a.serve_request, b.serve_request = second.serve_request, first.serve_request
    a.relay_target, b.relay_target = second.relay_target, first.relay_target
    return a, b


class LocalGateways:
    """Gateways of two or more meshes in one process and event loop, each pair joined by an
    in-process link. Each gateway is made as usual (`Gateway(mesh, keyring=..., export=...,
    topics=..., seeds=..., local=True)`), its mesh's own keyring, seeds and discovery; this
    starts them, links them, and closes them::

        async with LocalGateways([
            Gateway("east", keyring=east_keys, export=["db"], local=True),
            Gateway("west", keyring=west_keys, topics=["feeds.#"], local=True),
        ]) as joined:
            ...

    A gateway may have TCP links too (`listen=`, `peers=`), to gateways in other processes.
    """

    def __init__(self, gateways: Iterable[Gateway]) -> None:
        self.gateways = list(gateways)
        if len(self.gateways) < 2:
            raise ConfigurationError("joining meshes in one process takes two gateways or more")
        meshes = [g.mesh for g in self.gateways]
        if len(set(meshes)) != len(meshes):
            raise ConfigurationError(
                f"each gateway joined in one process is of another mesh: {meshes}"
            )
        if len({id(g) for g in self.gateways}) != len(self.gateways):
            raise ConfigurationError("a gateway is given twice")
        # One zmq context for them all (one I/O thread), terminated once all have closed.
        self._context = new_context()
        for gateway in self.gateways:
            gateway.share_context(self._context)
        self._links = [_join(a, b) for a, b in itertools.combinations(self.gateways, 2)]
        self._started: list[Gateway] = []

    def __getitem__(self, mesh: str) -> Gateway:
        for gateway in self.gateways:
            if gateway.mesh == mesh:
                return gateway
        raise KeyError(mesh)

    async def start(self) -> LocalGateways:
        try:
            for gateway in self.gateways:
                await gateway.start()
                self._started.append(gateway)
        except BaseException:
            await self.close()
            raise
        for a, b in self._links:
            up(a, b)
        return self

    async def close(self) -> None:
        started, self._started = self._started, []
        for gateway in reversed(started):
            with contextlib.suppress(Exception):
                await gateway.close()
        if started:  # once the goodbyes its sockets hold have left
            await asyncio.get_running_loop().run_in_executor(None, self._context.term)

    async def __aenter__(self) -> LocalGateways:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Each gateway's stats, by mesh."""
        return {g.mesh: g.stats for g in self.gateways}

    def links(self) -> dict[str, list[dict[str, Any]]]:
        return {g.mesh: g.links() for g in self.gateways}
