"""Publish/subscribe: the part of the Node API for messages on topics.

`Node` inherits it; the node's `PubSub` (`patterns.pubsub`) does the work. `publish` is a hot
path: a message sent at once costs one call into `PubSub` and a share of a turn of the loop;
one that waits for a subscriber's room waits in `publish_later`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from irismesh._core.priority import Priority, check_priority
from irismesh._nodestate import NodeState
from irismesh.errors import ConfigurationError, MeshError
from irismesh.memory import MAX_LATEST
from irismesh.patterns.pubsub import Message, Policy, Subscription
from irismesh.patterns.reqrep import as_bytes

if TYPE_CHECKING:
    from irismesh.telemetry.tracing import Tracing


class PubSubApi(NodeState):
    """Node's methods for publish/subscribe."""

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        timeout: float | None = None,
        retain: bool = False,
        priority: int = Priority.NORMAL,
    ) -> int:
        """Send `payload` to every subscription matching `topic`, here and on other nodes.

        Returns how many nodes it went to (this one included when it has a matching
        subscription); 0 is not an error. A subscriber whose policy is "block" and whose buffer
        is full makes this wait for room, up to `timeout`, then raise SlowConsumer. The payload
        is sealed under the key of the topic's first segment (else the default key).

        `retain=True` first stores the message with the mesh's memory under its path (the
        topic), for `reread`: it is sent once `replicas` memory members (or every one there
        is, if fewer) hold it, and raises NoResponders at once when there is none.

        `priority` (as in `request`): publishes that wait for a subscriber's room go in the
        order of their priority (and of their arrival within one), so a higher one overtakes
        lower ones that wait. A subscriber gets each publisher's messages in the order they
        were sent, so messages of one topic stay in order when they share a priority.
        """
        turns = self._caller.turns
        try:
            if self._closing or self._core is None:
                self._caller.running()  # raises Closed, saying why
            if timeout is not None and not timeout > 0:
                raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
            if priority:
                priority = check_priority(priority)
            if type(payload) is not bytes:
                payload = as_bytes(payload)
            msg_id = b""
            if retain:
                msg_id = await self._retain(topic, payload, timeout)
            pubsub = self._pubsub
            if self.tracing is not None:
                return await self._publish_traced(
                    self.tracing, topic, payload, timeout, msg_id, priority
                )
            sent = pubsub.publish_now(topic, payload, msg_id, priority)  # the common case
        except MeshError:
            if turns.spend():  # refused at once: a retry loop must not keep the loop
                await turns.pause()
            raise
        if sent is not None:
            # Sent without waiting (or to nobody): a publishing loop still lets its loop run
            # (`Turns.spend` inlined: the publisher's hot path).
            credit = turns.credit - 1
            if credit > 0:
                turns.credit = credit
            elif turns.due():
                await turns.pause()
            return sent
        return await pubsub.publish_later(
            topic, payload, self._default_timeout if timeout is None else timeout, msg_id, priority
        )

    async def _publish_traced(
        self,
        tracing: Tracing,
        topic: str,
        payload: bytes,
        timeout: float | None,
        msg_id: bytes,
        priority: int,
    ) -> int:
        """`publish` with tracing on: in a PRODUCER span, whose context goes with the message."""
        span, trace = tracing.publish(topic)
        try:
            pubsub = self._pubsub
            sent = pubsub.publish_now(topic, payload, msg_id, priority, trace)
            if sent is None:
                wait = self._default_timeout if timeout is None else timeout
                sent = await pubsub.publish_later(topic, payload, wait, msg_id, priority, trace)
            else:
                turns = self._caller.turns
                if turns.spend():
                    await turns.pause()
        except BaseException as exc:
            tracing.end(span, exc)
            raise
        span.set_attribute("irismesh.subscribers", sent)
        tracing.end(span)
        return sent

    def subscribe(
        self,
        pattern: str,
        *,
        policy: Policy = "block",
        maxsize: int = 1024,
        callback: Callable[[Message], object] | None = None,
        reread: bool | int = False,
    ) -> Subscription:
        """Receive messages on topics matching `pattern` (`*` one segment, `#` any number).

        `async with node.subscribe("feeds.#") as sub: async for msg in sub: ...`. When the
        reader falls behind, `policy` decides: "block" the publishers (nothing lost) or
        "drop_oldest" beyond `maxsize` (and count what was missed in `Message.missed`).

        With `callback`, each message is handed to `callback(msg)` as it arrives, on the
        event loop, instead of being buffered (the fastest way to receive; `policy` and
        `maxsize` do not apply). It must not block; an exception it raises is logged and
        counted in `sub.errors`, and the messages after it still come. `sub.close()` ends it.

        `reread=True` (or a number N) first delivers what the mesh's memory holds for the
        pattern (each path's newest message, or N newest, oldest first, with `Message.id`
        and an empty `publisher`), then the live messages, with no gap and no duplicate
        between them: live messages wait while the memory is read, a retained message comes
        once whether it was reread or live, and the memory is read again once the new
        interest has had time to reach every publisher. Without a memory member the
        subscription is live only and `sub.reread_error` says why.
        """
        self._caller.running()
        if type(reread) is not bool and (type(reread) is not int or not 1 <= reread <= MAX_LATEST):
            raise ConfigurationError(f"reread must be a bool or 1 to {MAX_LATEST}, not {reread!r}")
        sub = self._pubsub.subscribe(pattern, policy, maxsize, callback, priming=bool(reread))
        if reread:
            latest = 1 if reread is True else int(reread)
            task = asyncio.get_running_loop().create_task(self._prime(sub, latest))
            self._priming.add(task)
            task.add_done_callback(self._priming.discard)
        return sub

    async def wait_for_subscribers(
        self, topic: str, count: int = 1, *, timeout: float = 10.0
    ) -> int:
        """Wait until at least `count` other nodes subscribe to `topic`; returns how many."""
        self._caller.running()
        return await self._pubsub.wait_for_subscribers(topic, count, timeout)

    def flush_telemetry(self) -> None:
        """Hand the publishes and deliveries tallied so far to `recorder` (the node does this
        every 1024 messages, every gauge interval, and as it closes)."""
        self._pubsub.flush_tally()
