"""Tunnels that cross a gateway pair: still ordered, and flow-controlled end to end.

Theory of operation
-------------------
A caller in mesh B opens `node.tunnel("db")` as inside one mesh. In B the members of an
imported cluster are gateways: one gets the tunnel (its import node's tunnel handler,
`serve_import`, not yet accepting it) and opens a tunnel over the inter-mesh link to a
gateway exporting "db" (OPEN). That gateway opens a tunnel in its own mesh, to a member chosen
by its mesh's balancing (`Node.tunnel`), and answers ACCEPT, or RESET with the reason it could
not. Only then does the first gateway accept the caller's tunnel, so `node.tunnel` returns
once a far member took it, and raises as inside one mesh when none did: NoResponders when the
far mesh has no member (or the gateway no link: a reset reason starting `NO_MEMBER`),
RequestTimeout when none accepted in time, TunnelReset with the far reason otherwise.

Each gateway then runs a `Relay` between its tunnel in its mesh (`local`) and the link: one
pump reads whole messages from `local` and sends them over the link as DATA items of at most
`T_MAX_CHUNK` bytes; the other reassembles what the link brings and sends it on `local`. Link
items are plain items of the sealed link (`linkproto`): sent in order, once, while the link is
up. Each direction's items are numbered; a gap (items lost on the link) resets the tunnel, so
what arrives is always in order or not at all; so does a frame the link could not send (its
`frames_unsent`, looked at every `_CHECK_EVERY` seconds), whose items might have been a
tunnel's last for a while (a grant, a FIN), which no gap would ever show.

Flow control holds end to end, with a bounded buffer at every hop: each relay grants the
other `window` bytes (in OPEN and ACCEPT) and grants them again (CREDIT) only as it hands
them on to its own mesh's tunnel, whose send waits for its reader's credit. So a slow reader
in mesh A stops the far gateway's sends, the link's credit runs out, the near gateway stops
reading its tunnel, and the writer in mesh B waits in `send`. What a relay holds is at most
its window plus one message being reassembled (a message larger than half the window is
granted back as it is reassembled, as a tunnel's end does), and one message being sent
(`buffered`, in the gateway's stats as `tunnel_buffered_bytes`, with its peak).

Ends propagate both ways: a FIN (half close) becomes `send_eof` on the other side once what
came before it is passed on; a reset, the far member's death, a closed tunnel, a link going
down or a gateway closing reset the tunnel at both ends with the reason, so the caller's
`recv` and `send` raise TunnelReset as they do when a member inside the mesh vanishes. A
gateway with no link up for the cluster has left it (callers get NoResponders); one that
still finds none when a tunnel arrives refuses it at once, with NoResponders too.

Malformed items, items of tunnels this gateway does not know (late, after a reset) and items
beyond the credit granted are counted drops (`tunnel_items_*`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable

from irismesh.errors import EndOfStream, MeshError, NoResponders, ProtocolError, TunnelReset
from irismesh.federation.linkproto import LinkEnd
from irismesh.federation.linkwire import (
    T_ACCEPT,
    T_CREDIT,
    T_DATA,
    T_FIN,
    T_MAX_CHUNK,
    T_MAX_OPEN,
    T_MAX_WINDOW,
    T_OPEN,
    T_RESET,
    Item,
    TunnelItem,
    parse_tunnel_item,
)
from irismesh.node import Node
from irismesh.patterns.reqrep import continue_trace, incoming_trace
from irismesh.patterns.tunnel import DEFAULT_MAX_MESSAGE, DEFAULT_WINDOW, NO_MEMBER, Tunnel

__all__ = ["MAX_TUNNEL_WINDOW", "GatewayTunnels", "Relay"]

MAX_TUNNEL_WINDOW = T_MAX_WINDOW  # a relay's window, at most: what an OPEN or ACCEPT can carry

log = logging.getLogger("irismesh.federation")

_COUNTERS = (
    "tunnels_forwarded",  # opened over a link for a caller here
    "tunnels_served",  # opened here for a far caller
    "tunnels_reset",
    "tunnels_refused_no_link",
    "tunnels_refused_no_member",
    "tunnels_refused_not_exported",
    "tunnel_items_malformed",
    "tunnel_items_version",
    "tunnel_items_late",
    "tunnel_items_lost",
    "tunnel_items_over_credit",
)
_Key = tuple[int, int, bool]  # (id(link end), tunnel id, opened by this gateway)
_CHECK_EVERY = 0.1  # seconds between looks for frames a link could not send
# A tunnel's reset reasons from the core name the node that went ("member 0123456789ab is
# gone (...)"): the id stays in its mesh, the rest crosses.
_NODE_ID = re.compile(r"\b(member|caller) [0-9a-f]{12}\b")


def crossing_reason(reason: str) -> str:
    """A reset's reason as it crosses the link: node ids left out, at most 1000 bytes."""
    return _NODE_ID.sub(r"\1", reason).encode()[:1000].decode("utf-8", "ignore")


class Relay:
    """One tunnel through this gateway: its tunnel in this mesh and its end on a link."""

    def __init__(
        self,
        hub: GatewayTunnels,
        end: LinkEnd,
        tunnel_id: int,
        *,
        opener: bool,
        cluster: str,
        window: int,
    ) -> None:
        self.hub = hub
        self.end = end
        self.tunnel_id = tunnel_id
        self.opener = opener
        self.cluster = cluster
        self.window = window
        self.local: Tunnel | None = None
        self.credit = 0  # bytes this relay may still send over the link
        self.recv_allowed = window  # bytes the far relay may still send to this one
        self.buffered = 0  # bytes from the link not yet handed on, and a message being sent
        self.ended: str | None = None  # why the tunnel was reset, once it was
        self._seq_out = 0
        self.seq_in = 0
        self._to_grant = 0
        self._inbox: deque[tuple[int, int, bytes]] = deque()  # (op, arg, data) from the link
        self._inbox_ready = asyncio.Event()
        self._credit_ready = asyncio.Event()
        self._accepted = asyncio.Event()  # the far gateway's ACCEPT (or the end)
        self._pumps: list[asyncio.Task[None]] = []
        self.trace = b""  # the far caller's trace context, as its OPEN carried it

    @property
    def key(self) -> _Key:
        return (id(self.end), self.tunnel_id, self.opener)

    # ------------------------------------------------------------- the link

    def send(self, op: int, arg: int = 0, data: bytes = b"") -> bool:
        self._seq_out += 1
        item = TunnelItem(self.tunnel_id, self.opener, self._seq_out, op, arg, data)
        if not self.end.send_plain(item.wire()):
            return False
        self.hub.flush_soon()
        return True

    def on_item(self, item: TunnelItem) -> None:
        """An item of this tunnel from the link (checked by `parse_tunnel_item`)."""
        if self.ended is not None:
            self.hub.stats["tunnel_items_late"] += 1
            return
        if item.seq != self.seq_in + 1:
            self.hub.stats["tunnel_items_lost"] += 1
            self.abort("tunnel items were lost on the gateway link", tell_peer=True)
            return
        self.seq_in = item.seq
        op = item.op
        if op == T_DATA:
            size = len(item.data)
            if size > self.recv_allowed:
                self.hub.stats["tunnel_items_over_credit"] += 1
                self.abort("the far gateway exceeded its window", tell_peer=True)
                return
            self.recv_allowed -= size
            self.buffered += size
            self.hub.note_buffered(size)
            self._inbox.append((op, item.arg, item.data))
            self._inbox_ready.set()
        elif op in (T_CREDIT, T_ACCEPT):
            if (op == T_ACCEPT) != (item.seq == 1) or (op == T_ACCEPT and not self.opener):
                self.hub.stats["tunnel_items_malformed"] += 1
                self.abort("a tunnel item out of place on the gateway link", tell_peer=True)
                return
            self.credit = min(self.credit + item.arg, T_MAX_WINDOW)
            self._credit_ready.set()
            self._accepted.set()
        elif op == T_FIN:
            self._inbox.append((op, 0, b""))
            self._inbox_ready.set()
        elif op == T_RESET:
            reason = item.data.decode("utf-8", "replace") or "reset by the far gateway"
            self.abort(reason, tell_peer=False)
        else:  # a second OPEN
            self.hub.stats["tunnel_items_malformed"] += 1
            self.abort("a tunnel item out of place on the gateway link", tell_peer=True)

    def abort(self, reason: str, *, tell_peer: bool) -> None:
        """Reset the tunnel: the far gateway told (unless it told this one), both pumps
        stopped, and the tunnel in this mesh reset with `reason` (by `run`)."""
        if self.ended is not None:
            return
        self.ended = reason
        self.hub.stats["tunnels_reset"] += 1
        if tell_peer:
            self.send(T_RESET, 0, crossing_reason(reason).encode())
        self.hub.forget(self)
        self.hub.note_buffered(-self.buffered)
        self.buffered = 0
        self._inbox.clear()
        current = asyncio.current_task()
        for pump in self._pumps:
            if pump is not current:
                pump.cancel()
        self._inbox_ready.set()
        self._credit_ready.set()
        self._accepted.set()
        if self.local is not None:
            self.local.reset(reason)

    # ------------------------------------------------------------- running

    async def run(self, local: Tunnel) -> None:
        """Relay until both directions are done or the tunnel is reset; then end `local`."""
        self.local = local
        finished = False
        try:
            # A reset of `local` while neither pump waits on it (while opening, or with one
            # direction done and the other idle) is noticed too, as inside one mesh.
            self._pumps = [asyncio.create_task(self._watch(local))]
            if self.opener and self.ended is None:
                # The caller's `node.tunnel` waits until the far member accepted.
                await self._accepted.wait()
                if self.ended is None:
                    try:
                        local.accept()
                    except TunnelReset as exc:
                        self.abort(exc.reason, tell_peer=True)
            if self.ended is None:
                out = asyncio.create_task(self._pump_out(local))
                into = asyncio.create_task(self._pump_in(local))
                self._pumps += [out, into]
                await asyncio.wait([out, into])
                for pump in (out, into):
                    failed = None if pump.cancelled() else pump.exception()
                    if failed is not None:
                        log.warning("gateway tunnel relay failed: %r", failed)
                        self.abort(f"the gateway's relay failed: {failed}", tell_peer=True)
                finished = self.ended is None
        finally:
            for pump in self._pumps:
                pump.cancel()
            for pump in self._pumps:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pump
            if finished:
                self.hub.forget(self)
                await local.close()
            else:  # stopped from outside (its node closing, say): the far end is told
                self.abort("the gateway stopped relaying the tunnel", tell_peer=True)
                local.reset(self.ended or "")

    async def _watch(self, local: Tunnel) -> None:
        reason = await local.wait_reset()
        self.abort(reason or "the tunnel ended", tell_peer=True)

    async def _pump_out(self, local: Tunnel) -> None:
        """This mesh's tunnel to the link, within the far relay's credit."""
        while True:
            try:
                message = await local.recv()
            except EndOfStream:
                self.send(T_FIN)
                return
            except TunnelReset as exc:
                self.abort(exc.reason, tell_peer=True)
                return
            size = len(message)
            self.buffered += size
            self.hub.note_buffered(size)
            view = memoryview(message)
            offset = 0
            try:
                while True:
                    want = min(T_MAX_CHUNK, size - offset)
                    if want and self.credit <= 0:
                        self._credit_ready.clear()
                        await self._credit_ready.wait()
                        if self.ended is not None:
                            return
                        continue
                    take = min(want, self.credit)
                    more = 1 if offset + take < size else 0
                    if not self.send(T_DATA, more, bytes(view[offset : offset + take])):
                        self.abort("the gateway link went down", tell_peer=False)
                        return
                    self.credit -= take
                    offset += take
                    if not more:
                        break
            finally:
                if self.ended is None:
                    self.buffered -= size
                    self.hub.note_buffered(-size)

    async def _pump_in(self, local: Tunnel) -> None:
        """The link to this mesh's tunnel, granting credit back as it is handed on."""
        parts: list[bytes] = []
        size = granted = 0
        max_message = self.hub.max_message
        while True:
            while not self._inbox:
                if self.ended is not None:
                    return
                self._inbox_ready.clear()
                await self._inbox_ready.wait()
            op, more, data = self._inbox.popleft()
            if op == T_FIN:
                try:
                    await local.send_eof()
                except TunnelReset as exc:
                    self.abort(exc.reason, tell_peer=True)
                return
            parts.append(data)
            size += len(data)
            if size > max_message:
                self.abort(f"a message exceeded max_message ({max_message} bytes)", tell_peer=True)
                return
            if size > self.window // 2:  # a large message cannot fit the window: let it come
                self._grant(size - granted)
                granted = size
            if more:
                continue
            message = parts[0] if len(parts) == 1 else b"".join(parts)
            parts = []
            try:
                await local.send(message)
            except TunnelReset as exc:
                self.abort(exc.reason, tell_peer=True)
                return
            if self.ended is not None:
                return
            self.buffered -= size
            self.hub.note_buffered(-size)
            self._grant(size - granted)
            size = granted = 0

    def _grant(self, count: int) -> None:
        self._to_grant += count
        if self.ended is None and self._to_grant >= max(1, self.window // 4):
            grant, self._to_grant = self._to_grant, 0
            self.recv_allowed += grant
            self.send(T_CREDIT, grant)


class GatewayTunnels:
    """A gateway's tunnels across its links: the importing side's and the exporting side's.

    `links()` gives the link ends, `exports` the clusters this gateway exports, `node()` its
    node in its own mesh (which opens tunnels to the exported clusters' members)."""

    def __init__(
        self,
        *,
        links: Callable[[], Iterable[LinkEnd]],
        exports: Callable[[], Iterable[str]],
        node: Callable[[], Node],
        flush_soon: Callable[[], None],
        stats: Counter[str],
        window: int = DEFAULT_WINDOW,
        open_timeout: float = 5.0,
    ) -> None:
        self._links = links
        self._exports = exports
        self._node = node
        self.flush_soon = flush_soon
        self.stats = stats
        self.window = window  # what each relay lets the far one send before it grants more
        self.max_message = DEFAULT_MAX_MESSAGE
        self.open_timeout = open_timeout
        self.relays: dict[_Key, Relay] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._buffered = 0
        self._peak = 0
        self._closing = False
        self._unsent: dict[int, int] = {}  # id(link end) -> its frames_unsent when last seen
        self._checking: asyncio.TimerHandle | None = None

    def figures(self) -> dict[str, int]:
        """The tunnels' counters (shown even while 0) and gauges, for the gateway's stats."""
        return {
            **{name: self.stats[name] for name in _COUNTERS},
            "tunnels_open": len(self.relays),
            "tunnel_window": self.window,
            "tunnel_buffered_bytes": self._buffered,
            "tunnel_buffered_peak": self._peak,
        }

    def note_buffered(self, change: int) -> None:
        self._buffered += change
        self._peak = max(self._peak, self._buffered)

    def forget(self, relay: Relay) -> None:
        if self.relays.get(relay.key) is relay:
            del self.relays[relay.key]

    def _add(self, relay: Relay) -> None:
        self.relays[relay.key] = relay
        self._unsent.setdefault(id(relay.end), relay.end.stats["frames_unsent"])
        if self._checking is None:
            self._checking = asyncio.get_running_loop().call_later(_CHECK_EVERY, self._check)

    def _check(self) -> None:
        """Frames a link could not send (its socket full, or reconnecting) took their plain
        items with them: a tunnel whose item was lost cannot go on, and if the item was its
        last for a while (a grant, a FIN) nothing else would show it, so every tunnel on that
        link is reset."""
        self._checking = None
        ends = {id(r.end): r.end for r in self.relays.values()}
        for key, end in ends.items():
            unsent = end.stats["frames_unsent"]
            if unsent != self._unsent.get(key, unsent):
                for relay in [r for r in self.relays.values() if r.end is end]:
                    self.stats["tunnel_items_lost"] += 1
                    relay.abort("tunnel items were lost on the gateway link", tell_peer=True)
            self._unsent[key] = unsent
        self._unsent = {k: v for k, v in self._unsent.items() if k in ends}
        if self.relays and not self._closing:
            self._checking = asyncio.get_running_loop().call_later(_CHECK_EVERY, self._check)

    # ------------------------------------------------------------- importing side

    async def serve_import(self, cluster: str, local: Tunnel) -> None:
        """An import node's tunnel handler: a caller here opened a tunnel to `cluster`."""
        ends = [e for e in self._links() if e.up and cluster in e.peer_exports.clusters]
        if not ends or self._closing:
            self.stats["tunnels_refused_no_link"] += 1
            local.reset(f"{NO_MEMBER} of {cluster!r}: the gateway has no link up")
            return
        end = min(ends, key=lambda e: sum(1 for r in self.relays.values() if r.end is e))
        relay = Relay(self, end, next(self._ids), opener=True, cluster=cluster, window=self.window)
        self._add(relay)
        self.stats["tunnels_forwarded"] += 1
        # The cluster's name, and after a NUL the caller's trace context when it has one.
        opening = cluster.encode()
        trace = incoming_trace()
        if trace and len(opening) + 1 + len(trace) <= T_MAX_OPEN:
            opening += b"\x00" + trace
        if not relay.send(T_OPEN, self.window, opening):
            relay.abort("the gateway link went down", tell_peer=False)
        await relay.run(local)

    # ------------------------------------------------------------- exporting side

    def on_item(self, end: LinkEnd, item: Item) -> None:
        """A tunnel item from a link (kind `linkproto.TUNNEL`)."""
        try:
            checked = parse_tunnel_item(item)
        except ProtocolError as exc:
            self.stats["tunnel_items_" + exc.reason.removeprefix("tunnel_")] += 1
            return
        # An item from the far opener concerns a tunnel this gateway did not open.
        key = (id(end), checked.tunnel_id, not checked.from_opener)
        relay = self.relays.get(key)
        if relay is not None:
            relay.on_item(checked)
        elif checked.op == T_OPEN:
            self._open(end, checked)
        elif checked.op != T_RESET:  # a reset of a tunnel already gone needs no answer
            self.stats["tunnel_items_late"] += 1

    def _open(self, end: LinkEnd, item: TunnelItem) -> None:
        name, _, trace = item.data.partition(b"\x00")
        try:
            cluster = name.decode()
        except UnicodeDecodeError:
            self.stats["tunnel_items_malformed"] += 1
            return
        relay = Relay(self, end, item.tunnel_id, opener=False, cluster=cluster, window=self.window)
        relay.trace = trace
        relay.seq_in = item.seq
        relay.credit = item.arg
        if cluster not in self._exports() or self._closing:
            self.stats["tunnels_refused_not_exported"] += 1
            relay.send(T_RESET, 0, f"{NO_MEMBER} of {cluster!r}: not exported there".encode())
            return
        if end.peer_grant is not None and not end.far_may_import_cluster(cluster):
            self.stats["tunnels_refused_far_grant"] += 1
            relay.send(T_RESET, 0, f"{NO_MEMBER} of {cluster!r}: not exported to it".encode())
            return
        self._add(relay)
        self.stats["tunnels_served"] += 1
        task = asyncio.get_running_loop().create_task(self._serve_export(relay))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_export(self, relay: Relay) -> None:
        if relay.trace:  # this task's context: the far caller's trace goes on here
            continue_trace(relay.trace)
        try:
            local = await self._node().tunnel(
                relay.cluster, timeout=self.open_timeout, window=self.window
            )
        except NoResponders:
            self.stats["tunnels_refused_no_member"] += 1
            relay.abort(f"{NO_MEMBER} of {relay.cluster!r} across the gateway", tell_peer=True)
            return
        except MeshError as exc:  # none accepted in time, or the member refused
            self.stats["tunnels_refused_no_member"] += 1
            relay.abort(f"{type(exc).__name__}: {exc}", tell_peer=True)
            return
        if relay.ended is not None:  # reset while it was opening
            local.reset(relay.ended)
            return
        relay.send(T_ACCEPT, self.window)
        await relay.run(local)

    # ------------------------------------------------------------- going away

    def link_down(self, end: LinkEnd) -> None:
        """A link went down: every tunnel across it is reset at this end."""
        mesh = end.peer_mesh or "?"
        for relay in [r for r in self.relays.values() if r.end is end]:
            relay.abort(f"the gateway link to mesh {mesh!r} went down", tell_peer=False)

    async def close(self) -> None:
        """The gateway closes: every tunnel through it is reset at both ends."""
        self._closing = True
        if self._checking is not None:
            self._checking.cancel()
        for relay in list(self.relays.values()):
            relay.abort("the gateway closed", tell_peer=True)
        tasks = list(self._tasks)  # relays of this side's mesh, and tunnels still opening
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
