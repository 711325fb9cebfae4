"""The grants' part of the Node API: this node's grant, its peers', and revocations.

`Node` inherits it. A node takes its grant as it takes its keyring: `Node(grant=...)` (a
`Grant`, or the path of a file `mesh grant --out` wrote), else ``IRISMESH_GRANT``, else the
default grant beside the default keyring when the node's identity is the default identity.
Whether grants are required, and which authorities are trusted, is the keyring's to say
(``@require-grants``, ``@authority``); a keyring reread takes a new trust at once.

A watch runs every `GRANT_POLL` seconds while the node runs: it polls the grant file (a new
grant is taken without a restart, as the keyring is) and has the core recheck grants
(`MeshCore.recheck_grants`), so an expired grant, this node's or a peer's, stops working
within `GRANT_POLL` of its expiry, and a revocation applies as soon as it is heard.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from irismesh import _env
from irismesh._core.rights import MEMORY_CLUSTER, REVOCATIONS, UNCHECKED, UNGRANTED
from irismesh._nodestate import cancel_and_wait
from irismesh.errors import ConfigurationError, MeshError
from irismesh.security.grants import Grant, GrantFile, NodeGrants, Revocation
from irismesh.security.identity import Identity
from irismesh.security.keyring import Keyring

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from irismesh._core.engine import MeshCore
    from irismesh._driver import Driver
    from irismesh.memory.store import Stored

_log = logging.getLogger("irismesh.grants")

GRANT_POLL = 0.25  # seconds: expiries apply within this, a changed grant file within twice it
REVOCATION_WAIT = 5.0  # seconds a starting node looks for the memory's revocations

GrantSource = Grant | str | os.PathLike[str] | None


def _grant_path(grant: GrantSource, identity: Identity) -> str | None:
    """The file a node's grant comes from, if any (see the module's docstring)."""
    if isinstance(grant, Grant):
        return None
    if grant is not None:
        return os.fspath(grant)
    path = _env.grant_file()
    if path is not None:
        return path
    default = _env.default_grant_file()
    if identity.path is not None and os.path.abspath(identity.path) == os.path.abspath(
        _env.default_identity_file()
    ):
        return str(default) if default.exists() else None
    return None


class GrantsApi:
    """Node's methods for grants and revocations."""

    identity: Identity
    keyring: Keyring
    _core: MeshCore | None
    _driver: Driver | None
    grants: NodeGrants
    _grant_file: GrantFile | None
    _grant_task: asyncio.Task[None] | None

    if TYPE_CHECKING:  # the node's own
        known_members: Callable[[str], int]
        reread: Callable[..., Awaitable[list[Stored]]]
        publish: Callable[..., Awaitable[int]]

    def _init_grants(self, grant: GrantSource) -> None:
        """Called by the node's constructor: load its grant (ConfigurationError if unusable)."""
        path = _grant_path(grant, self.identity)
        loaded = grant if isinstance(grant, Grant) else None
        if path is not None:
            loaded = Grant.load(path)
        if loaded is not None and loaded.node != self.identity.public:
            raise ConfigurationError(
                f"the grant names key {loaded.node.hex()[:16]}..., not this node's identity "
                f"({self.identity.public.hex()[:16]}...): pass the identity it was made for"
            )
        self.grants = NodeGrants(
            public=self.identity.public,
            authorities=self.keyring.authorities,
            required=self.keyring.require_grants,
            grant=loaded,
        )
        self._grant_file = None if path is None else GrantFile(path, loaded)
        self._grant_task = None

    def _start_grants(self, loop: asyncio.AbstractEventLoop) -> None:
        self._grant_task = loop.create_task(self._watch_grants())

    async def _stop_grants(self) -> None:
        task, self._grant_task = self._grant_task, None
        await cancel_and_wait(task)

    async def _watch_grants(self) -> None:
        me = self._grant_task
        # A node that starts late takes the revocations the memory keeps (gossip spread
        # them before it was there), once it knows a memory member (if one shows up soon).
        reread_until = time.monotonic() + REVOCATION_WAIT
        while self._grant_task is me:  # also ends the watch should a cancellation get lost
            await asyncio.sleep(GRANT_POLL)
            try:
                watched = self._grant_file
                if watched is not None:
                    grant = watched.poll()
                    if grant is not None:
                        self._take_grant(grant, watched.path)
                self._recheck_grants()
                if reread_until and self.grants.required:
                    if self.known_members(MEMORY_CLUSTER):
                        reread_until = 0.0
                        await self._reread_revocations()
                    elif time.monotonic() > reread_until:
                        reread_until = 0.0
            except Exception:  # a bug must not end the watch: expiries must still apply
                _log.exception("grants not rechecked")

    async def _reread_revocations(self) -> None:
        try:
            kept = await self.reread(REVOCATIONS + ".#", latest=1, timeout=REVOCATION_WAIT)
        except MeshError as exc:  # no key for its topics, the memory went: gossip alone
            _log.debug("no revocations reread from the memory: %s", exc)
            return
        for message in kept:
            self.revoke(message.payload)

    async def keep_revocation(self, revocation: Revocation | bytes, timeout: float = 5.0) -> None:
        """Have the mesh's memory keep a revocation for nodes that start later (retained
        under the revoked key); NoResponders without a memory member."""
        token = revocation.token if isinstance(revocation, Revocation) else revocation
        node = Revocation.decode(token).node
        await self.publish(f"{REVOCATIONS}.{node.hex()}", token, retain=True, timeout=timeout)

    def _take_grant(self, grant: Grant, source: str) -> None:
        if grant.node != self.identity.public:
            _log.warning("grant %s names another node's key: keeping the grant in use", source)
            return
        self.grants.grant = grant
        _log.info("grant %s reread: expires at %d", source, grant.expires)

    def _recheck_grants(self) -> None:
        core, driver = self._core, self._driver
        if core is not None and driver is not None:
            core.recheck_grants(time.monotonic())
            driver.process()

    def _trust_changed(self, keyring: Keyring) -> None:
        """The keyring was reread: its authorities and `@require-grants` apply now."""
        self.grants.configure(keyring.authorities, keyring.require_grants)
        self._recheck_grants()

    def use_grant(self, grant: Grant) -> None:
        """Present `grant` from now on (new links get it; rights it drops apply at once)."""
        if grant.node != self.identity.public:
            raise ConfigurationError("the grant names another node's key")
        self.grants.grant = grant
        self._recheck_grants()

    def revoke(self, revocation: Revocation | bytes) -> bool:
        """Apply a revocation (an authority's token) here and gossip it to the mesh: True if
        it is new and trusted. Every node that hears it closes the revoked node's links and
        refuses it until it holds a grant issued after the revocation."""
        token = revocation.token if isinstance(revocation, Revocation) else revocation
        core, driver = self._core, self._driver
        if core is None or driver is None:
            return self.grants.learn(token)
        learnt = core.announce_revocation(token, time.monotonic())
        driver.process()
        return learnt

    def grant_figures(self) -> dict[str, int]:
        """The policy's counters (grants refused, revocations applied, ...)."""
        return dict(self.grants.stats)

    async def gather_grants(self, timeout: float) -> list[dict[str, Any]]:
        """Link to every live node (as far as `timeout` allows) and return `peer_grants()`:
        what each presented at its handshake, as this node verified it."""
        core, driver = self._core, self._driver
        if core is None or driver is None:
            return []
        deadline = time.monotonic() + timeout
        while True:
            live = core.link_members(time.monotonic())
            driver.process()
            if len(core.linked_peers()) >= live or time.monotonic() >= deadline:
                return self.peer_grants()
            await asyncio.sleep(0.05)

    def peer_grants(self) -> list[dict[str, Any]]:
        """What this node knows of its linked peers' grants: for each peer linked either way,
        its node id, public key and rights (None: grants are not required here)."""
        core = self._core
        if core is None:
            return []
        found: dict[bytes, dict[str, Any]] = {}
        for link in core.linked_grants():
            peer_id, public, grant = link
            if grant is UNCHECKED:
                rights = None
            elif grant is UNGRANTED:
                rights = {}
            else:
                rights = grant.rights.summary()
            found[peer_id] = {
                "node_id": peer_id.hex(),
                "public": public.hex(),
                "rights": rights,
                "expires": None if grant.expires == float("inf") else grant.expires,
            }
        return list(found.values())
