"""Tunnels: ordered, flow-controlled byte streams between a caller and one member.

Theory of operation
-------------------
A caller opens a tunnel on a link it dialled, to one member of a cluster, in that cluster's
scope slot (`open_tunnel`: OPEN with the window it grants); the member's end appears as a
TunnelArrived event, and its application answers ACCEPT with a window of its own or RESET. Both
ends then send DATA within the credit the other granted (bytes), and grant more with CREDIT as
their application reads; FIN closes a direction, RESET the whole tunnel at once.

Each end is a `TunnelEnd` under a handle of this node's own; the caller's handle is also the
tunnel's id on the wire, so a member finds the tunnels it serves by (link, wire id). A frame
for a tunnel this node has already forgotten is late, not an error: it is counted and dropped.
A peer that sends past the window it was granted gets its tunnel reset.

When the link under a tunnel goes (`link_down`, `inbound_gone`), or the node closes, the
tunnel is reset and its owner told, with the reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from random import Random

from irismesh._core import balancer
from irismesh._core.config import CoreConfig
from irismesh._core.events import TunnelArrived, TunnelFrame
from irismesh._core.frames import Kind, TunnelOp, decode_tunnel, encode_traced, encode_tunnel
from irismesh._core.links import InLink, LinkObserver, OutLink, TunnelEnd
from irismesh._core.outbox import Outbox
from irismesh.errors import Closed, NoResponders, ProtocolError, TunnelError

_TUNNEL, _TRACED = int(Kind.TUNNEL), int(Kind.TRACED)
_OPEN, _ACCEPT, _DATA = int(TunnelOp.OPEN), int(TunnelOp.ACCEPT), int(TunnelOp.DATA)
_CREDIT, _FIN, _RESET = int(TunnelOp.CREDIT), int(TunnelOp.FIN), int(TunnelOp.RESET)
_MAX_WINDOW = 1 << 30


class TunnelTable(LinkObserver):
    """This node's tunnel ends, at both the callers' side and the members'."""

    def __init__(
        self,
        *,
        config: CoreConfig,
        rng: Random,
        stats: Counter[str],
        outbox: Outbox,
        members_for: Callable[[str, int, int, float], list[OutLink]],
    ) -> None:
        self.config = config
        self.closed = False
        self._rng = rng
        self._stats = stats
        self._outbox = outbox
        self._members_for = members_for  # Calls.members_for: the calls' common prelude
        # handle -> this node's end; a served tunnel is also found by (link, wire id).
        self.ends: dict[int, TunnelEnd] = {}
        self._served: dict[tuple[bytes, int], TunnelEnd] = {}
        self._next_handle = 1

    # ----------------------------------------------------------------- the application's

    def open(self, cluster: str, window: int, now: float, trace: bytes = b"") -> int:
        """Open a tunnel to one member of `cluster`, granting it `window` bytes; a handle.

        A TunnelFrame ACCEPT (or RESET) follows; until ACCEPT nothing may be sent. A `trace`
        context (frames.TRACED) goes with the OPEN to a member that reads one.
        """
        if self.closed:
            raise Closed("node is closed")
        if not 0 < window <= _MAX_WINDOW:
            raise TunnelError(f"a tunnel window must be 1 byte to 1 GiB, not {window}")
        if len(self.ends) >= self.config.max_tunnels:
            raise TunnelError(f"{len(self.ends)} tunnels open, the limit is max_tunnels")
        members = self._members_for(cluster, 0, 0, now)
        if not members:  # known, not linked yet: the node waits for a link, then opens
            raise NoResponders(cluster)
        link = balancer.choose(members, self._rng, None, now)
        handle = self._next_handle
        self._next_handle += 1
        slot = link.clusters[cluster]
        end = TunnelEnd(handle, handle, cluster, link.peer_id, slot)
        end.out, end.recv_allowed = link, window
        self.ends[handle] = end
        body = encode_tunnel(handle, _OPEN, window)
        if trace and link.traces:
            self._outbox.stage_out(link, slot, _TRACED, encode_traced(_TUNNEL, trace, body))
        else:
            self._outbox.stage_out(link, slot, _TUNNEL, body)
        self._stats["tunnels_opened"] += 1
        return handle

    def accept(self, handle: int, window: int) -> None:
        """Accept a tunnel from TunnelArrived, granting the caller `window` bytes."""
        end = self._end(handle)
        if end.accepted or end.inlink is None:
            raise TunnelError("this tunnel is already accepted")
        end.accepted = True
        self.send(handle, _ACCEPT, window)

    def send(self, handle: int, op: int, arg: int = 0, data: bytes = b"") -> None:
        """Send an op on a tunnel: DATA needs `send_credit` for `data`; RESET forgets it."""
        end = self._end(handle)
        if op == _DATA:
            if len(data) > end.send_credit:
                raise TunnelError(f"{len(data)} bytes but a credit of {end.send_credit}")
            end.send_credit -= len(data)
        elif op in (_CREDIT, _ACCEPT):
            if not 0 < arg <= _MAX_WINDOW - end.recv_allowed:
                raise TunnelError(f"a grant of {arg} bytes is out of range")
            end.recv_allowed += arg
        body = encode_tunnel(end.wire_id, op, arg, data)
        if end.out is not None:
            self._outbox.stage_out(end.out, end.slot, _TUNNEL, body)
        elif end.inlink is not None:
            self._outbox.stage_in(end.inlink, end.slot, _TUNNEL, body)
        if op == _RESET:
            self._forget(end)

    def forget(self, handle: int) -> None:
        """Both ends are done (FIN each way): forget the tunnel without a word."""
        end = self.ends.get(handle)
        if end is not None:
            self._forget(end)

    def peer(self, handle: int) -> bytes:
        """The node id of the tunnel's other end."""
        return self._end(handle).peer_id

    def credit(self, handle: int) -> int:
        """Bytes this end may send on the tunnel now."""
        return self._end(handle).send_credit

    def close(self) -> None:
        """The node closes: every tunnel is reset, at the other end and here."""
        self.closed = True
        for end in list(self.ends.values()):
            self.send(end.handle, _RESET, 0, b"the other end closed its node")
            self._outbox.events.append(TunnelFrame(end.handle, _RESET, 0, b"node closed"))

    def _end(self, handle: int) -> TunnelEnd:
        end = self.ends.get(handle)
        if end is None:
            raise TunnelError("the tunnel is closed")
        return end

    def _forget(self, end: TunnelEnd) -> None:
        self.ends.pop(end.handle, None)
        if end.inlink is not None:
            self._served.pop((end.inlink.routing_id, end.wire_id), None)

    # ----------------------------------------------------------------- links going away

    def uses(self, link: OutLink) -> bool:
        """Whether a tunnel this node opened runs on `link`."""
        return any(end.out is link for end in self.ends.values())

    def link_down(self, link: OutLink, reason: str, now: float) -> None:
        # Tunnels this node serves for the same peer run on the peer's own link to us: they
        # end when that link goes (`inbound_gone`), when the peer is gone from membership.
        if self.ends:
            self._break(f"member {link.peer_id.hex()[:12]} is gone ({reason})", out=link)

    def inbound_gone(self, link: InLink) -> None:
        if self.ends:
            self._break(f"caller {link.peer_id.hex()[:12]} left", inlink=link)

    def _break(
        self,
        reason: str,
        *,
        out: OutLink | None = None,
        inlink: InLink | None = None,
    ) -> None:
        """The link under some tunnels died: they are reset, and their owners told."""
        for end in list(self.ends.values()):
            if (out is not None and end.out is out) or (
                inlink is not None and end.inlink is inlink
            ):
                self._forget(end)
                self._stats["tunnels_broken"] += 1
                self._outbox.events.append(TunnelFrame(end.handle, _RESET, 0, reason.encode()))

    # ----------------------------------------------------------------- frames in

    def on_out(self, link: OutLink, slot: int, body: bytes) -> None:
        """A TUNNEL frame on a link this node dialled: the member's end speaking."""
        wire_id, op, arg, data = decode_tunnel(body)
        end = self.ends.get(wire_id)
        if end is not None and (end.out is not link or end.slot != slot):
            raise ProtocolError("bad_scope", "TUNNEL")
        self._on_op(end, op, arg, data)

    def on_in(self, link: InLink, slot: int, body: bytes, trace: bytes = b"") -> None:
        """A TUNNEL frame on a link a peer dialled: a caller opening or using a tunnel (with
        its `trace` context, if it sent one)."""
        if slot == 0 or slot >= len(link.scopes) or link.scopes[slot] is None:
            raise ProtocolError("bad_scope", str(slot))
        wire_id, op, arg, data = decode_tunnel(body)
        key = (link.routing_id, wire_id)
        end = self._served.get(key)
        if op != _OPEN:
            if end is not None and end.slot != slot:
                raise ProtocolError("bad_scope", "TUNNEL")
            self._on_op(end, op, arg, data)
            return
        if end is not None:
            raise ProtocolError("bad_envelope", "TUNNEL OPEN twice")
        handle = self._next_handle
        self._next_handle += 1
        cluster = link.scopes[slot]
        assert cluster is not None
        end = TunnelEnd(handle, wire_id, cluster, link.peer_id, slot)
        end.inlink, end.send_credit = link, min(arg, _MAX_WINDOW)
        self.ends[handle] = end
        self._served[key] = end
        if link.refused and slot in link.refused:  # the caller's grant lacks `call` for it
            self._stats["refused_forbidden"] += 1
            self.send(handle, _RESET, 0, b"Forbidden: no right to call " + cluster.encode())
            return
        if self.closed or len(self.ends) > self.config.max_tunnels:
            self._stats["tunnels_refused"] += 1
            self.send(handle, _RESET, 0, b"too many tunnels at the member")
            return
        self._stats["tunnels_served"] += 1
        self._outbox.events.append(TunnelArrived(handle, cluster, link.peer_id, trace))

    def _on_op(self, end: TunnelEnd | None, op: int, arg: int, data: bytes) -> None:
        if end is None:  # reset or closed here already: frames in flight arrive late
            self._stats["tunnel_frames_late"] += 1
            return
        events = self._outbox.events
        if op == _DATA:
            end.recv_allowed -= len(data)
            if end.recv_allowed < 0:  # the peer ignored our window: the tunnel cannot go on
                self._stats["dropped_tunnel_over_credit"] += 1
                self.send(end.handle, _RESET, 0, b"window exceeded")
                events.append(TunnelFrame(end.handle, _RESET, 0, b"peer exceeded its window"))
                return
        elif op == _ACCEPT:
            if end.out is None or end.accepted:
                raise ProtocolError("bad_envelope", "TUNNEL ACCEPT")
            end.accepted = True
            end.send_credit = min(end.send_credit + arg, _MAX_WINDOW)
        elif op == _CREDIT:
            end.send_credit = min(end.send_credit + arg, _MAX_WINDOW)
        elif op == _RESET:
            self._forget(end)
        elif op == _OPEN:
            raise ProtocolError("bad_envelope", "TUNNEL OPEN on an open tunnel")
        events.append(TunnelFrame(end.handle, op, arg, data))
