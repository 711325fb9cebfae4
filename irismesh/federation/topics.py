"""A gateway's topics: messages crossing from mesh to mesh, and republished.

Topics. The gateway subscribes in its mesh to the topics it exports and sends each message
published there, as a `Crossing`, over every link to a mesh the message has not been in; the
link keeps it until acknowledged (see `linkproto`). A gateway receiving a crossing republishes
it in its own mesh, once (`crossing.Barrier`), and passes it on to its other links. The
republished message carries its origin id (as `Message.id`): a subscriber delivers each id
once within its window of the last `pubsub.SEEN_IDS` ids, so a message that two gateways of
its mesh republish (one died before it acknowledged, or a restarted one was sent it again)
reaches each subscriber once (`Subscription.duplicates`, the node's
`messages_duplicates_dropped`).
Messages a gateway republished are not exported again by the gateways of that mesh (they know
each other as members of the cluster `_gateway`): a crossing carries its history only from
gateway to gateway, so a message crosses from mesh to mesh through one gateway process at a
time.

Carry-over. What a link to a mesh holds unacknowledged is sent on another link to that mesh
too, marked resent, when a link comes up beside it or goes down (`_carry_over`): the far
gateway asks its fellows which of them it republished, and the subscribers deliver each once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from irismesh._core.topics import topic_matches
from irismesh.errors import MeshError, NoKey, SlowConsumer
from irismesh.federation.crossing import CROSSING, RESENT, Crossing
from irismesh.federation.fellows import GATEWAY_CLUSTER
from irismesh.federation.linkproto import Item, LinkEnd
from irismesh.federation.state import GatewayState
from irismesh.node import Node
from irismesh.patterns.pubsub import Message, Subscription

log = logging.getLogger("irismesh.federation")

_ASK_BATCH = 4096  # resent crossings one question to the other gateways covers, at most
_NOT_REPUBLISHED_KEPT = 4096  # crossings let through but not republished, remembered
_NATIVE_PUBLISHERS_KEPT = 4096  # publishers of this mesh known not to be gateways
_MESH_WAIT = 3.0  # a gateway waits at most this long to know its mesh before it republishes
_MESH_SETTLED = 0.3  # ... and until the number of peers it knows has stayed the same this long


class TopicCrossings(GatewayState):
    """Gateway's methods that export its mesh's topics and republish what crosses in."""

    def _carry_over(self, end: LinkEnd, to: LinkEnd | None) -> None:
        """Messages a link to a mesh holds unacknowledged are sent on another link to that
        mesh too, marked resent, before any new one: when a link comes up (`to`: a gateway
        restarted there dialled in as a new peer, while the link to the one that died may not
        know yet) from every other link to that mesh, and when a link goes down (`to` None)
        from it, to a link up. The far gateway asks its fellows which of them it republished,
        and the subscribers deliver each once. The source link keeps its copies (its peer may
        come back); each message is carried over once (`_carried`)."""
        mesh = end.peer_mesh
        ends = self.transport.ends
        live = {id(e) for e in ends}
        for gone in [k for k in self._carried if k not in live]:  # forgotten ends
            del self._carried[gone]
        if to is None:
            to = next((e for e in ends if e.up and e.peer_mesh == mesh), None)
            sources = [end]
        else:
            sources = [e for e in ends if e is not to and e.peer_mesh == mesh]
        if to is None:
            return
        now = time.monotonic()
        for source in sources:
            if source.peer_id == to.peer_id:
                continue
            # With what its peer acknowledged a moment ago: that peer may have died with the
            # messages still in its node's buffers (`LinkConfig.keep_acked`). The far side
            # asks its fellows about resends, and the subscribers deliver each id once.
            items, next_seq = source.unacknowledged(self._carried.get(id(source), 0), now)
            self._carried[id(source)] = next_seq
            for item in items:
                if item[0] in (CROSSING, RESENT) and self._send(to, [RESENT, *item[1:]]):
                    self.stats_counter["messages_carried_over"] += 1
        self.transport.flush_soon()

    def _send(self, end: LinkEnd, wire: Item) -> bool:
        """A reliable item (a crossing) on `end`; counted as carried over already if `end` is
        the source of a carry-over (it was sent on every other link to its mesh too). Not
        sent if the far gateway's grant, where it is checked, does not let it import the
        topic (counted `crossings_withheld_far_grant`), whichever way it is sent: new,
        carried over, or resent by a takeover."""
        if end.peer_grant is not None and not end.far_may_import_topic(wire[4]):
            self.stats_counter["crossings_withheld_far_grant"] += 1
            return False
        if not end.send(wire):
            return False
        carried = self._carried
        if carried and id(end) in carried:
            carried[id(end)] += 1
        return True

    async def _export_topic(self, sub: Subscription, earlier: Sequence[str]) -> None:
        async for msg in sub:
            if any(topic_matches(p, msg.topic) for p in earlier):
                continue  # an earlier pattern's subscription has it
            if not self._native(msg):
                continue
            if self._warm is not None and not self._warm.is_set():
                await self._warm.wait()  # the publishers wait the while, as on a full window
            origin_id = self._origin_ids.origin_id(msg.publisher, msg.topic, msg.payload)
            crossing = Crossing(
                self.mesh, origin_id, (self.mesh,), msg.topic, msg.payload, msg.trace
            )
            self._barrier.first(crossing)  # a copy coming back by another way is dropped
            self.stats_counter["messages_exported"] += 1
            await self._cross(crossing, native=True)

    def _native(self, msg: Message) -> bool:
        """Published in this mesh, not republished by one of its gateways.

        The ids of the gateways are a snapshot, refreshed each second; a publisher met for the
        first time is looked up in membership at once, so a gateway that joined since (or
        before this one's first look) is known before its first republished message is taken
        for a native one: exported again under a new origin id, that message would reach the
        other meshes twice. A node that serves `_gateway` says so when it links to this one,
        and a message comes only over such a link. Publishers found not to be gateways are
        remembered (a bounded table), so the lookup is made once per publisher."""
        publisher = msg.publisher
        if publisher in self._gateway_ids:
            return False
        if publisher in self._native_publishers:
            self._native_publishers.move_to_end(publisher)
            return True
        if GATEWAY_CLUSTER in self.node.clusters:
            self._gateway_ids = self._gateway_ids | set(self.node.members(GATEWAY_CLUSTER))
            if publisher in self._gateway_ids:
                self.stats_counter["gateways_learned_from_messages"] += 1
                return False
        self._native_publishers[publisher] = None
        if len(self._native_publishers) > _NATIVE_PUBLISHERS_KEPT:
            self._native_publishers.popitem(last=False)
        return True

    async def _watch_gateways(self) -> None:
        """Keep the ids of this mesh's gateways (members of `_gateway`) a second fresh (and
        fresher where `_native` meets a publisher it does not know)."""
        own = self.node.node_id.hex()
        while True:
            self._gateway_ids = {own, *self.node.members(GATEWAY_CLUSTER)}
            await asyncio.sleep(1.0)

    async def _cross(self, crossing: Crossing, *, native: bool = False) -> None:
        """Send to every link towards a mesh the message has not been in. A message published
        here (`native`) waits while a link that is up has a full window (its publishers wait
        too); one passing on from another mesh does not: the republishing run that passes it
        on is what acknowledges the link it came by, and in meshes linked in a cycle each
        gateway's run would wait on the next one's window, for ever. Such a message goes into
        the link's buffer, past its window (`relayed_past_window`), and past the buffer's bound
        it is dropped and counted, as a link that is down keeps what it is sent up to that
        bound. A message published here goes only to the meshes this gateway is the forwarder
        for; for the others it is held (see `redundancy`).

        Such a message is marked, on each copy, as seen in the other meshes that this gateway
        and another gateway of this mesh both link to: the elected one of them sends it there,
        the others hold it for their takeover, so the receiver does not relay it there too
        (the copies would reach that mesh through two gateway processes, each republishing
        it, where one barrier sees them both when a single gateway links to it)."""
        reach = self._reach(crossing) if native else []
        plain = crossing.wire()
        known = False
        redundancy = self._redundancy if native else None
        for end in self.transport.ends:
            if not end.peer_mesh:
                continue  # a link never up: whose mesh it leads to is not known yet
            known = True
            if end.peer_mesh in crossing.seen:
                continue
            if redundancy is not None and not redundancy.forwarding.get(end.peer_mesh, False):
                redundancy.hold(end.peer_mesh, crossing)
                continue
            if end.buffered >= end.config.window * 2:
                if not native:
                    self.stats_counter["relayed_past_window"] += 1
                while native and end.up and end.buffered >= end.config.window * 2:
                    assert self._drained is not None
                    self.transport.flush_soon()  # what waits goes out while this waits
                    self._drained.clear()
                    await self._drained.wait()
            marked = reach and (len(reach) > 1 or reach[0] != end.peer_mesh)
            wire = self._marked(crossing, end.peer_mesh, reach) if marked else plain
            if self._send(end, wire):
                self.stats_counter["messages_sent"] += 1
        if not known:
            self.stats_counter["messages_no_link"] += 1  # no mesh to send it to yet
        self.transport.flush_soon()

    def _reach(self, crossing: Crossing) -> list[str]:
        """The meshes, not yet seen by `crossing`, this gateway links to (its link up or
        down: a link down keeps what it is sent, to replay in order) and so does another
        gateway of this mesh exporting the same topics (see `_cross`)."""
        shared = self._shared
        reach: list[str] = []
        for end in self.transport.ends:
            mesh = end.peer_mesh
            if mesh in shared and mesh not in crossing.seen and mesh not in reach:
                reach.append(mesh)
        return reach

    @staticmethod
    def _marked(crossing: Crossing, to: str, reach: list[str], kind: str = CROSSING) -> list[Any]:
        """`crossing` as sent to mesh `to`, marked as seen in the rest of `reach`."""
        return crossing.wire(kind, [m for m in reach if m != to])

    def _on_crossing(self, end: LinkEnd, crossing: Crossing, *, resent: bool = False) -> None:
        if end.peer_grant is not None and not end.far_may_export_topic(crossing.topic):
            self.stats_counter["crossings_refused_far_grant"] += 1
            end.consumed()
            return
        if self.mesh in crossing.seen:
            self.stats_counter["loops_dropped"] += 1
            end.consumed()
            return
        if not self._barrier.first(crossing):
            end.consumed()
            return
        self.stats_counter["messages_received"] += 1
        if resent:
            self.stats_counter["resends_received"] += 1
        assert self._inbound is not None
        self._inbound.put_nowait((end, crossing, resent))
        self._queued += 1

    async def _republish(self) -> None:
        """Publish crossings here one at a time, in the order they came, then pass them on.
        What a takeover resent is first checked with this mesh's other gateways (see
        `_republished_elsewhere`), a run of them at a time."""
        inbound, progress = self._inbound, self._progress
        assert inbound is not None
        assert progress is not None
        carried: tuple[LinkEnd, Crossing, bool] | None = None
        await self._know_the_mesh()
        while True:
            entry = carried if carried is not None else await inbound.get()
            carried = None
            end, crossing, resent = entry
            if not resent:
                await self._republish_one(end, crossing)
                self._done += 1
                progress.set()
                continue
            run = [(end, crossing)]
            while len(run) < _ASK_BATCH and not inbound.empty():
                following = inbound.get_nowait()
                if not following[2] or following[1].origin != crossing.origin:
                    carried = following
                    break
                run.append((following[0], following[1]))
            there = await self._republished_elsewhere(crossing.origin, [c for _, c in run])
            for (end, crossing), elsewhere in zip(run, there, strict=True):
                if elsewhere:
                    self.stats_counter["resends_dropped_republished_elsewhere"] += 1
                    end.consumed()
                    self.transport.flush_soon()
                else:
                    await self._republish_one(end, crossing)
                self._done += 1
                progress.set()

    async def _know_the_mesh(self) -> None:
        """Before the first republish: wait until this gateway's node knows its mesh. A node
        just started knows no subscriber yet, and what it published would reach nobody (a
        restarted gateway is sent at once what its link holds). Done when it has peers and
        their number has not changed for `_MESH_SETTLED`; at most `_MESH_WAIT` (a gateway
        alone in its mesh, or with its imports' nodes only). Crossings wait meanwhile,
        unacknowledged."""
        started = since = time.monotonic()
        count = -1
        while (now := time.monotonic()) - started < _MESH_WAIT:
            # Its own imports' nodes do not count: seeded with this node, they are the first
            # peers it knows, and a mesh of them alone has no subscriber in it.
            own = {node.node_id.hex() for node in self._imports.values()}
            known = sum(1 for peer in self.node.peers() if peer.node_id not in own)
            if known != count:
                count, since = known, now
            elif known and now - since >= _MESH_SETTLED:
                return
            await asyncio.sleep(0.05)
        self.stats_counter["republish_started_alone"] += 1

    async def _republish_one(self, end: LinkEnd, crossing: Crossing) -> None:
        if not self.grant.may_import_topic(crossing.topic):
            # Neither republished here nor passed on: this gateway may not bring it in.
            self.stats_counter["crossings_refused_forbidden"] += 1
            self._not_republished_here(crossing)
            end.consumed()
            self.transport.flush_soon()
            return
        while True:
            try:
                reached = await publish_identified(
                    self.node, crossing.topic, crossing.payload, crossing.origin_id, crossing.trace
                )
                self.stats_counter["messages_republished"] += 1
                if not reached:
                    self.stats_counter["republished_to_no_subscriber"] += 1
                break
            except SlowConsumer:
                # A subscriber here is slow (or its link lossy): wait on, as a publisher
                # whose subscribers block would; the messages after this one wait too.
                self.stats_counter["republish_waits"] += 1
            except NoKey:
                self.stats_counter["dropped_no_key"] += 1
                self._not_republished_here(crossing)
                break
            except MeshError as exc:
                log.warning("gateway could not republish on %r: %s", crossing.topic, exc)
                self.stats_counter["dropped_republish_failed"] += 1
                self._not_republished_here(crossing)
                break
        if any(topic_matches(p, crossing.topic) for p in self.export.topics):
            await self._cross(crossing.through(self.mesh))
        # Done with it: acknowledged now, so a mesh that reads slowly holds the sender
        # back by the link's window instead of filling this gateway's memory.
        end.consumed()
        self.transport.flush_soon()

    def _not_republished_here(self, crossing: Crossing) -> None:
        """Let through the barrier but not published: not among what this gateway tells its
        fellows it republished."""
        self._not_republished[(crossing.origin, crossing.origin_id)] = None
        if len(self._not_republished) > _NOT_REPUBLISHED_KEPT:
            self._not_republished.popitem(last=False)


async def publish_identified(
    node: Node, topic: str, payload: bytes, msg_id: bytes, trace: bytes = b""
) -> int:
    """`node.publish(topic, payload)`, the message carrying `msg_id` (its origin id) to the
    subscribers, which deliver each id once (`Subscription`: a bounded window of ids), and
    its publisher's `trace` context as it came; how many it went to."""
    if node._closing or node._core is None:
        node._caller.running()  # raises Closed, saying why
    # No turn of the loop given between publishes here, unlike `Node.publish`: a run
    # republishes what one read of its link brought (at most a batch), so it ends by itself,
    # and the turns it would give slow the republishing that the far publishers wait on.
    pubsub = node._pubsub
    sent = pubsub.publish_now(topic, payload, msg_id, 0, trace)
    if sent is None:
        sent = await pubsub.publish_later(topic, payload, node._default_timeout, msg_id, 0, trace)
    return sent
