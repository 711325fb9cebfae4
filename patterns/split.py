"""Traffic splitting's part of the Node API: one split per cluster, set for the whole mesh.

`Node` inherits it. A member carries a version (`Node("db", version="v2")`); a split weighs the
versions of a cluster (`await node.set_split("db", {"v1": 95, "v2": 5})`): every caller in the
mesh then sends each request to a version drawn by those weights, and to a member of it by the
balancer's usual choice. How a split travels, survives its setter and is applied is the core's
(`irismesh._core.split`); this module stamps and checks what a program asks, and waits until
the cluster's members carry it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from irismesh.patterns.reqrep import Caller

if TYPE_CHECKING:
    from irismesh._core.split import Split

CARRIED_POLL = 0.02  # seconds between looks at the members' records while a split spreads


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitView:
    """What `Node.split_status` sees of one cluster's split."""

    cluster: str
    weights: dict[str, int] | None  # version -> weight; None: no split (or it was cleared)
    stamp: int  # when it was set or cleared, in ms since the epoch (0: never)
    members: dict[str, int]  # live members of each version the split names
    other_members: int  # live members of versions it does not name


class SplitApi:
    """Node's methods for traffic splits."""

    _caller: Caller

    if TYPE_CHECKING:  # the node's own
        _check_cluster: Callable[[str], None]

    async def set_split(
        self, cluster: str, weights: Mapping[str, int], *, timeout: float = 5.0
    ) -> int:
        """Set the traffic split of `cluster` for the whole mesh: with `{"v1": 95, "v2": 5}`
        every caller sends 95 of each 100 requests to members of version v1 and 5 to v2
        (whole-number weights, relative; "" names the members that have no version). A
        version with no live member has its share spread over the others; members of a
        version the split does not name get requests only when no named version has a live
        member. Returns, once every live member of `cluster` this node knows carries the
        split or `timeout` seconds have passed, how many do (they keep it after this node
        has gone). ConfigurationError for bad weights, NoKey without the cluster's key."""
        return await self._put_split(cluster, dict(weights), timeout)

    async def clear_split(self, cluster: str, *, timeout: float = 5.0) -> int:
        """Clear the traffic split of `cluster` for the whole mesh: callers go back to the
        usual choice among all its members. Returns as `set_split` does."""
        return await self._put_split(cluster, None, timeout)

    def split(self, cluster: str) -> dict[str, int] | None:
        """The traffic split of `cluster` in effect at this node (version -> weight), or None
        when it has none. A node that asks follows the cluster's split from then on."""
        core, _ = self._caller.running()
        found = core.split(cluster)
        return None if found is None or not found.weights else dict(found.weights)

    def split_status(self, cluster: str) -> SplitView:
        """The split of `cluster` at this node, and the live members of each version."""
        core, _ = self._caller.running()
        found = core.split(cluster)
        members, others = core.split_versions(cluster)
        return SplitView(
            cluster=cluster,
            weights=None if found is None or not found.weights else dict(found.weights),
            stamp=0 if found is None else found.stamp,
            members=members,
            other_members=others,
        )

    async def _put_split(self, cluster: str, weights: dict[str, int] | None, timeout: float) -> int:
        self._check_cluster(cluster)
        core, driver = self._caller.running()
        core.want(cluster, time.monotonic())  # follow it, as a caller does
        split = core.set_split(cluster, weights, _stamp(core.split(cluster)))
        driver.process()
        deadline = time.monotonic() + timeout
        while True:
            carrying, members = core.split_carriers(cluster, split.stamp)
            if (members and carrying >= members) or time.monotonic() >= deadline:
                return carrying
            await asyncio.sleep(CARRIED_POLL)


def _stamp(current: Split | None) -> int:
    """A stamp newer than the split this node knows: the time in ms, or one more than its
    stamp if that is later (clocks across machines need not agree)."""
    now = int(time.time() * 1000)
    return now if current is None else max(now, current.stamp + 1)
