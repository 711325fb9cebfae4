"""The memory's part of the Node API: rereads, durable queues, rereading subscriptions.

`Node` inherits it; it works through the node's `memory` (a `NodeMemory`), its pub/sub and its
request path, which the node provides (declared below for the type checker). A node that is
no memory member makes its `NodeMemory` when it first uses the memory: until then neither the
memory's protocol nor its store (SQLite) is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar, overload

from irismesh._core.frames import Kind
from irismesh._nodestate import NodeState
from irismesh.errors import ConfigurationError, Forbidden, MembershipTimeout, MeshError
from irismesh.memory import MEMORY_CLUSTER
from irismesh.patterns.pubsub import Message, Subscription
from irismesh.patterns.reqrep import RequestHandler, as_bytes, incoming_trace

if TYPE_CHECKING:
    from irismesh.memory.service import MemoryMember, NodeMemory
    from irismesh.memory.store import Stored as Remembered

CATCH_UP_WAIT = 2.0  # seconds a starting memory member waits to find another to copy from
# A rereading subscription reads the memory again after this long: its interest has reached
# every publisher by then (membership spreads a record change in about a second).
REREAD_AGAIN_AFTER = 2.0
_log = logging.getLogger("irismesh.node")
_KIND_JOB = int(Kind.JOB)
H = TypeVar("H", bound=RequestHandler)


class MemoryApi(NodeState):
    """Node's methods for the mesh's memory."""

    if TYPE_CHECKING:  # the node's own, with their signatures there
        request: Callable[..., Awaitable[bytes]]
        _queued_request: Callable[..., Awaitable[bytes]]
        _check_cluster: Callable[[str], None]

    @property
    def memory(self) -> NodeMemory:
        """This node's side of the mesh's memory (its retained publishes, rereads and queued
        jobs; on a memory member, its store too)."""
        memory = self._memory
        if memory is None:
            memory = self._memory = self._node_memory()
        return memory

    def _node_memory(self, member: MemoryMember | None = None) -> NodeMemory:
        from irismesh.memory.service import NodeMemory

        memory = NodeMemory(
            self.node_id,
            self._memory_survey,
            replicas=self._replicas,
            member=member,
            max_payload=self._config.max_payload,
        )
        if self._newest_live_id:
            memory.observe(self._newest_live_id)
        return memory

    def _observe_live_id(self, msg_id: bytes) -> None:
        """A live retained message's id: this node's next retained write or job orders after
        it. Before the memory side is made, the newest is kept for its clock to take in."""
        memory = self._memory
        if memory is not None:
            memory.observe(msg_id)
        elif msg_id > self._newest_live_id:
            self._newest_live_id = msg_id

    async def reread(
        self, pattern: str, *, latest: int = 1, timeout: float | None = None
    ) -> list[Remembered]:
        """What the mesh's memory holds for `pattern` (the grammar of `subscribe`): for every
        stored path that matches, its `latest` newest retained messages, newest first, each
        with its topic, payload, publish time and unique id. Ids come from the publishers'
        hybrid logical clocks: a message published after its publisher saw another (reread
        it, or heard from a memory member that held it) is newer, whatever the clocks say;
        this node's clock takes in the ids reread here. NoResponders when no memory member is
        running."""
        try:
            core = self._core
            if core is not None and not core.pubsub.rights.may_subscribe(pattern):
                raise Forbidden(pattern, "subscribe", "this node's grant does not allow it")
            return await self.memory.reread(pattern, latest, timeout)
        except MeshError:
            await self._caller.turns.maybe_pause()  # refused at once: still fair
            raise

    async def _memory_catch_up(self) -> None:
        """A memory member that starts copies what the others hold, once membership has had a
        moment to find them (those that join later copy from it in turn)."""
        with contextlib.suppress(MembershipTimeout):
            await self.wait_for_members(MEMORY_CLUSTER, 1, timeout=CATCH_UP_WAIT)
        try:
            await self.memory.catch_up(timeout=self._default_timeout)
            await self.memory.catch_up_jobs(timeout=self._default_timeout)
        except MeshError as exc:
            self.memory.stats["catch_up_failed"] += 1
            _log.warning("memory catch-up failed: %s", exc)

    async def enqueue(
        self,
        cluster: str,
        payload: bytes,
        *,
        expiry: float = 3600.0,
        timeout: float | None = None,
    ) -> bytes:
        """Queue `payload` for `cluster` with the mesh's memory (a durable work queue): it
        returns once `replicas` memory members (or every one there is, if fewer) hold it,
        with the job's id. A memory member hands each job to a live member of the cluster as
        a request (its `on_request` handler runs it), waiting while the cluster has none, and
        the memory forgets the job only once a member has answered; a job whose handler
        fails goes again, five times in all; one still unhandled after `expiry` seconds is
        dropped. Delivery is at least once. NoResponders at once without a memory member."""
        try:
            self._check_cluster(cluster)
            if type(payload) is not bytes:
                payload = as_bytes(payload)
            self.keyring.require(cluster)  # the job is sealed under the cluster's key
            core = self._core
            if core is not None and not core.calls.rights.may_call(cluster):
                # A job is a call into its cluster: the grant must allow it (the memory
                # member that hands it out must be allowed to call the cluster too).
                raise Forbidden(cluster, "call", "this node's grant does not allow it")
            # The job's run continues the trace it was queued in.
            trace = self.tracing.current() if self.tracing is not None else incoming_trace()
            return await self.memory.enqueue(cluster, payload, expiry, timeout, trace)
        except MeshError:
            await self._caller.turns.maybe_pause()  # refused at once: still fair
            raise

    async def _dispatch_job(
        self, cluster: str, job_id: bytes, payload: bytes, timeout: float, trace: bytes = b""
    ) -> bytes:
        return await self._queued_request(
            cluster, job_id + payload, timeout, None, _KIND_JOB, trace=trace
        )

    def _memory_peer_ids(self) -> list[bytes]:
        """The other live memory members, as membership knows them."""
        if self._core is None:
            return []
        return list(self._core.directory.servers(MEMORY_CLUSTER))

    async def _memory_survey(
        self, payload: bytes, timeout: float | None
    ) -> tuple[dict[str, bytes], dict[str, MeshError], list[str]]:
        timeout = await self._linked(MEMORY_CLUSTER, timeout)
        return await self._caller.fanout(Kind.SURVEY, MEMORY_CLUSTER, payload, timeout)

    async def _prime(self, sub: Subscription, latest: int) -> None:
        """Reread the memory into a new subscription, then let its live messages through;
        read again once the subscription's interest has spread (a retained message published
        before a publisher knew of it is in the memory by then)."""
        try:
            found = await self.memory.reread(sub.pattern, latest, None)
        except MeshError as exc:
            found = []
            sub.reread_error = exc
            self.memory.stats["rereads_failed"] += 1
        except BaseException:  # cancelled (the node closes): the live messages go through
            self._pubsub.end_priming(sub, [])
            raise
        remembered = sorted(found, key=lambda m: m.id)
        newest = {m.topic: m.id for m in remembered}  # ascending: the last is the newest
        self._pubsub.end_priming(sub, [_remembered(m) for m in remembered])
        if sub.reread_error is not None or sub.closed:
            return
        await asyncio.sleep(REREAD_AGAIN_AFTER)
        try:
            again = await self.memory.reread(sub.pattern, latest, None)
        except MeshError:
            self.memory.stats["rereads_failed"] += 1
            return
        for m in sorted(again, key=lambda m: m.id):
            if not sub.closed and m.id > newest.get(m.topic, b""):
                sub._put(_remembered(m), None, 0)
        sub._wake()

    @overload
    def on_queued(self, handler: H, *, blocking: bool = False) -> H: ...

    @overload
    def on_queued(self, handler: None = None, *, blocking: bool = False) -> Callable[[H], H]: ...

    def on_queued(
        self, handler: H | None = None, *, blocking: bool = False
    ) -> H | Callable[[H], H]:
        """Decorator: `handler(payload) -> bytes` (sync or async) runs the jobs queued for this
        node's cluster with `enqueue` (default: the request handler runs them);
        `@node.on_queued` or `@node.on_queued(blocking=True)`.

        A job is the mesh memory's until the handler's answer reaches it, so a job whose member
        dies mid-run runs again elsewhere (at least once); a repeat that reaches this member
        after it answered is answered again without running (`jobs_absorbed` in `stats()`).
        Jobs have an admission of their own, next to the requests'.
        """
        if not self.clusters:
            raise ConfigurationError("a node without a cluster runs no queued jobs: pass cluster=")

        def register(handler: H) -> H:
            pool = None
            if blocking:
                threads, admission = self._handler_threads, self._queued.runner.admission
                pool = self._runner.handler_pool(threads, admission)
            self._queued.handle(handler, blocking=blocking, pool=pool)
            return handler

        return register if handler is None else register(handler)

    async def caught_up(self) -> None:
        """Until this memory member, once started, has copied what the other memory members
        stored while it was away (returns at once on other nodes)."""
        if self._catching_up is not None:
            await asyncio.shield(self._catching_up)

    async def _retain(self, topic: str, payload: bytes, timeout: float | None) -> bytes:
        """Store a retained publish with the memory members: its id (`publish(retain=True)`)."""
        core = self._core
        if core is not None and not core.pubsub.rights.may_publish(topic):
            raise Forbidden(topic, "publish", "this node's grant does not allow it")
        return await self.memory.retain(topic, payload, timeout)


def _remembered(stored: Remembered) -> Message:
    """A message reread from the memory, as a subscription delivers it."""
    return Message(stored.topic, stored.payload, "", 0, stored.id)
