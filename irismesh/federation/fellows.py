"""A gateway and the other gateways of its mesh (members of the cluster `_gateway`).

Redundant gateways. Several gateways of a mesh may export the same topics (for when one
dies): for each mesh they send to, they elect one forwarder, and the others keep what it has
not yet delivered and send it on when they take over (`irismesh.federation.redundancy`). Such
resends come marked (`RESENT`): the gateway receiving them asks the other gateways of its
mesh which of them they have republished already, and drops those.

The gateways of a mesh tell each other, by broadcasts to `_gateway`, which links they have up
and what the far side has acknowledged (`_sync`, `_tell`); they answer `mesh top`'s survey of
`_gateway` with their stats, and a fellow's question about a takeover's resends with a bitmap
of those they republished (`_on_gateway_survey`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgpack

# The gateways of a mesh ("_gateway"): they answer it with their stats.
from irismesh._core.rights import GATEWAY_CLUSTER as GATEWAY_CLUSTER
from irismesh.errors import MeshError, NoResponders
from irismesh.federation.crossing import CROSSING, RESENT, Crossing
from irismesh.federation.linkproto import LinkEnd
from irismesh.federation.redundancy import Redundancy
from irismesh.federation.state import GatewayState

log = logging.getLogger("irismesh.federation")

_SYNC_EVERY = 0.05  # redundant gateways: delivered ids told this often
_STATE_EVERY = 0.2  # and each one's links this often (a fellow silent for 3 s is gone)
_TOLD_BOUND = 1024  # messages for the other gateways waiting to be sent
_MERGED_IDS = 4096  # delivered ids one message to them carries at most (16 bytes each)
_ACKED_PENDING_BOUND = 65_536  # delivered ids held back (`_report_delivered`); past it, told
_WARM_UP = 0.6  # a gateway holds what it would export this long: fellows make themselves known
_ASK_TIMEOUT = 1.0  # how long a takeover's resends wait for the other gateways' answers
_ASKED = 2  # a question to the other gateways (STATE and DELIVERED are 0 and 1): which of
# these origin ids have you republished?


class FellowGateways(GatewayState):
    """Gateway's methods for the other gateways of its mesh: redundancy and their questions."""

    def _on_sync(self, payload: bytes) -> None:
        """A broadcast from another gateway of this mesh (see `redundancy`)."""
        if self._redundancy is None:
            return
        try:
            body = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            self.stats_counter["sync_malformed"] += 1
            return
        self._redundancy.on_message(body, time.monotonic())

    async def _sync(self) -> None:
        """Tell this mesh's other gateways what was delivered and which links are up; elect
        the forwarder for each mesh linked to, and take over where this gateway becomes it."""
        redundancy = self._redundancy
        assert redundancy is not None
        warm_until = time.monotonic() + _WARM_UP
        while True:
            try:
                warm_until = await self._sync_once(redundancy, warm_until)
            except Exception:  # the election outlives an error (logged with its traceback)
                self.stats_counter["sync_errors"] += 1
                log.exception("gateway: redundant gateways' sync failed")
            await asyncio.sleep(_SYNC_EVERY)

    async def _sync_once(self, redundancy: Redundancy, warm_until: float) -> float:
        now = time.monotonic()
        redundancy.forget_stale(now)
        for fellow_id in list(redundancy.fellows):
            # Membership's verdict (a SIGKILLed gateway's broken links make it probe at once)
            # comes well before the fellow's silence reaches STALE_AFTER.
            redundancy.judge(fellow_id, self.node.peer_state(fellow_id), now)
        self._shared = redundancy.shared(now)
        ends = [e for e in self.transport.ends if e.peer_mesh]
        if now - self._state_at >= _STATE_EVERY:
            self._state_at = now
            up = {e.peer_mesh for e in ends if e.up}
            known = {e.peer_mesh for e in ends}
            self._tell(redundancy.state_message(up, known))
        await self._report_delivered()
        for mesh in {e.peer_mesh for e in ends}:
            own_up = any(e.up for e in ends if e.peer_mesh == mesh)
            since = self._linked_since.setdefault(mesh, now)
            decided = redundancy.elect(mesh, own_up=own_up, since=since, now=now)
            if decided is None:  # until the fellows have told their links, as it was
                decided = redundancy.forwarding.get(mesh, False)
            elected = now >= warm_until and decided
            if elected and not redundancy.forwarding.get(mesh, False):
                self._take_over(mesh, ends)
            if elected != redundancy.forwarding.get(mesh, not elected):
                self.stats_counter["forwarding_changes"] += 1
            redundancy.forwarding[mesh] = elected
        if now >= warm_until and self._warm is not None:
            self._warm.set()
        return warm_until

    async def _report_delivered(self) -> None:
        """Tell the standbys which of this mesh's messages the far side has acknowledged."""
        redundancy = self._redundancy
        assert redundancy is not None
        now = time.monotonic()
        pending, keep = self._acked_pending, self._link_config.keep_acked
        for end in self.transport.ends:
            if end.acked_items is None:
                end.acked_items = []
                continue
            if end.acked_items:
                items, end.acked_items = end.acked_items, []
                if redundancy.fellows:
                    ids = [i[2] for i in items if i[0] in (CROSSING, RESENT) and i[1] == self.mesh]
                    if ids:
                        pending.append((now, end.peer_mesh, ids))
                        self._acked_pending_ids += len(ids)
        # Told only `keep_acked` after the far side acknowledged them: a far gateway SIGKILLed
        # just after its acknowledgement may not have passed them on, and a standby that takes
        # over from this one then still holds them (they are asked about there, not doubled).
        delivered: dict[str, list[bytes]] = {}
        while pending and (
            now - pending[0][0] >= keep or self._acked_pending_ids > _ACKED_PENDING_BOUND
        ):
            _at, mesh, ids = pending.popleft()
            self._acked_pending_ids -= len(ids)
            delivered.setdefault(mesh, []).extend(ids)
        for mesh, ids in delivered.items():
            self._tell(redundancy.delivered_message(mesh, ids))

    def _take_over(self, mesh: str, ends: list[LinkEnd]) -> None:
        assert self._redundancy is not None
        resend = self._redundancy.take_over(mesh)
        if resend:
            log.info("gateway forwards to mesh %r now; resends %d messages", mesh, len(resend))
        for crossing in resend:
            # Marked RESENT: the far side asks its gateways if they have it already.
            wire = self._marked(crossing, mesh, self._reach(crossing), RESENT)
            for end in ends:
                if end.peer_mesh == mesh and self._send(end, wire):
                    self.stats_counter["messages_sent"] += 1
        self.transport.flush_soon()

    async def _republished_elsewhere(self, origin: str, run: list[Crossing]) -> list[bool]:
        """Which of these crossings, resent by a takeover on the far side, another gateway of
        this mesh has republished (received from the forwarder that died, before it died):
        those are not republished again. A survey of `_gateway`; a gateway that does not
        answer in time is taken to have none of them (what is republished then may be a
        double: counted, `resends_unchecked`, as when no other gateway is here to ask)."""
        no = [False] * len(run)
        if GATEWAY_CLUSTER not in self.node.clusters:
            self.stats_counter["resends_unchecked"] += len(run)
            return no
        ids = [c.origin_id for c in run]
        question = msgpack.packb([_ASKED, self.node.node_id.hex(), origin, ids])
        try:
            result = await self.node.survey(GATEWAY_CLUSTER, question, timeout=_ASK_TIMEOUT)
        except NoResponders:  # no other gateway here now: one that died may have had them
            self.stats_counter["resends_unchecked"] += len(run)
            return no
        except MeshError as exc:
            log.debug("gateway could not ask its fellows about resends: %s", exc)
            self.stats_counter["resends_unchecked"] += len(run)
            return no
        own = self.node.node_id.hex()
        there = no
        for member, answer in result.answers.items():
            try:
                body = msgpack.unpackb(answer, raw=False)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
                body = None
            if member == own or not isinstance(body, list) or len(body) != 2:
                continue
            kind, bitmap = body
            if kind != _ASKED or type(bitmap) is not bytes or len(bitmap) != (len(run) + 7) // 8:
                continue
            bits = int.from_bytes(bitmap, "little")
            there = [had or bool(bits >> i & 1) for i, had in enumerate(there)]
        if result.errors or result.missing:
            self.stats_counter["resends_unchecked"] += there.count(False)
        return there

    async def _on_gateway_survey(self, payload: bytes) -> bytes:
        """A survey of `_gateway`: `mesh top` asks for the stats (an empty payload); a fellow
        gateway asks which of a takeover's resends this one has republished, and gets a
        bitmap ([_ASKED, bits]) once what this gateway had queued to republish is done."""
        try:
            body = msgpack.unpackb(payload, raw=False) if payload else None
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            body = None
        if not (isinstance(body, list) and len(body) == 4 and body[0] == _ASKED):
            return self._describe(payload)
        _, _, origin, ids = body
        if type(origin) is not str or not isinstance(ids, list):
            self.stats_counter["sync_malformed"] += 1
            return b""  # the asker finds no answer in it
        progress, target = self._progress, self._queued
        while progress is not None and self._done < target:  # the caller's deadline bounds the wait
            progress.clear()
            await progress.wait()
        bits = 0
        for i, origin_id in enumerate(ids):
            key = (origin, origin_id)
            if (
                type(origin_id) is bytes
                and self._barrier.holds(*key)
                and key not in self._not_republished
            ):
                bits |= 1 << i
        self.stats_counter["resends_asked"] += len(ids)
        bitmap = bits.to_bytes((len(ids) + 7) // 8, "little")
        return msgpack.packb([_ASKED, bitmap], use_bin_type=True)  # type: ignore[no-any-return]

    def _tell(self, body: list[Any]) -> None:
        """Broadcast to this mesh's other gateways, in order, without holding up the caller."""
        if len(self._told) >= _TOLD_BOUND:
            self._told.popleft()
            self.stats_counter["sync_dropped"] += 1
        self._told.append(body)
        if self._telling is None or self._telling.done():
            self._telling = asyncio.get_running_loop().create_task(self._send_told())

    async def _send_told(self) -> None:
        while self._told:
            waiting = Redundancy.merged(self._told, _MERGED_IDS)
            self._told.clear()
            for body in waiting:
                await self._broadcast_told(body)

    async def _broadcast_told(self, body: list[Any]) -> None:
        payload = msgpack.packb(body, use_bin_type=True)
        try:
            await self.node.broadcast(GATEWAY_CLUSTER, payload, timeout=1.0)
        except NoResponders:
            pass  # no other gateway here (yet)
        except MeshError as exc:
            self.stats_counter["sync_not_sent"] += 1
            log.debug("gateway could not tell its fellows: %s", exc)
