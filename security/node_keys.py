"""The keyring's part of the Node API: one place where a running node's keys change.

`Node` inherits it. A node whose keyring came from a file watches that file (`rotation`) and
takes what it finds through `use_keyring`, as does a program that calls it with a keyring of
its own making. `use_keyring` swaps the keys of the node's security in place (the same object
its handshakes, links, records and membership datagrams ask), then tells the core
(`MeshCore.keys_changed`), which re-announces this node's record and rekeys what must be.

`key_holders` reads what the live members' records say of the keys they hold (their key tags,
readable only with each key), which `mesh keys status` prints.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from irismesh._nodestate import cancel_and_wait
from irismesh.errors import ConfigurationError
from irismesh.security.keyring import Keyring
from irismesh.security.meshkey import ALSO, FIRST
from irismesh.security.rotation import POLL_INTERVAL, KeyringFile

if TYPE_CHECKING:
    from collections.abc import Callable

    from irismesh._core.engine import MeshCore
    from irismesh._driver import Driver
    from irismesh.security.linksecurity import KeyedLinkSecurity

_log = logging.getLogger("irismesh.keyring")


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyHolders:
    """What the live nodes this node knows say of one key of its keyring."""

    scope: str
    key_id: str
    primary: bool  # this node's primary for the scope
    holders: int  # live nodes (this one aside) whose record says they hold it
    first: int  # of which, how many use it first (their primary for the scope)


class KeyringApi:
    """Node's methods for its keyring: rereading it, and who holds which key."""

    keyring: Keyring
    node_id: bytes
    _served: tuple[str, ...]  # the clusters this node serves: each needs a key
    _core: MeshCore | None
    _driver: Driver | None
    _security: KeyedLinkSecurity | None
    _keyfile: KeyringFile | None
    _keyfile_task: asyncio.Task[None] | None

    if TYPE_CHECKING:  # the node's own
        _rediscover: Callable[[Keyring], None]  # discovery's tags follow the '*' key
        _trust_changed: Callable[[Keyring], None]  # grants' trust follows the keyring

    def _watch_keyring(self, keyring: Keyring, served: tuple[str, ...]) -> None:
        """Called by the node's constructor: watch the file the keyring came from, if any;
        a keyring without a key for one of the `served` clusters is refused."""
        self._served = served
        path = keyring.path
        self._keyfile = None if path is None else KeyringFile(path, keyring, check=self._usable)
        self._keyfile_task = None

    def _start_keyring_watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._keyfile is not None:
            self._keyfile_task = loop.create_task(self._poll_keyring(self._keyfile))

    async def _stop_keyring_watch(self) -> None:
        task, self._keyfile_task = self._keyfile_task, None
        await cancel_and_wait(task)

    async def _poll_keyring(self, keyfile: KeyringFile) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL)
            keyring = keyfile.poll()
            if keyring is None:
                continue
            try:
                self._apply_keyring(keyring)
            except Exception:  # a bug must not end the watch: later files may still apply
                _log.exception("keyring %s read but not applied", keyfile.path)

    def _usable(self, keyring: Keyring) -> None:
        """ConfigurationError if this node cannot work with `keyring`."""
        for cluster in self._served:
            if keyring.primary(cluster) is None:
                raise ConfigurationError(f"no key for cluster {cluster!r}, which this node serves")

    def reload_keyring(self) -> bool:
        """Read the keyring file now (what SIGHUP does to `mesh` commands): True if its keys
        are now in use, False if they were already or the file was refused (logged)."""
        if self._keyfile is None:
            raise ConfigurationError("this node's keyring came from no file: use use_keyring()")
        keyring = self._keyfile.reload()
        if keyring is None:
            return False
        self._apply_keyring(keyring)
        return True

    def use_keyring(self, keyring: Keyring) -> None:
        """Use `keyring` from now on, on new links and existing ones, in handshakes, records
        and membership datagrams, without dropping a request (see SECURITY.md, rotation).
        ConfigurationError, keeping the keys in use, if it lacks a key for a served cluster."""
        if not isinstance(keyring, Keyring):
            raise ConfigurationError(f"use_keyring takes a Keyring, not {type(keyring).__name__}")
        self._usable(keyring)
        if self._keyfile is not None:
            self._keyfile.keyring = keyring
        self._apply_keyring(keyring)

    def _apply_keyring(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self._rediscover(keyring)
        core, driver, security = self._core, self._driver, self._security
        if core is None or driver is None or security is None:
            return  # not started: start() takes self.keyring
        security.replace(keyring)
        core.keys_changed(time.monotonic())
        driver.process()
        self._trust_changed(keyring)

    def key_holders(self) -> list[KeyHolders]:
        """For each key of this node's keyring: how many live nodes hold it, and use it
        first. A node is counted for a key only if it says so under that very key."""
        core, security = self._core, self._security
        records = [] if core is None else core.directory.records()
        records = [r for r in records if r.node_id != self.node_id]
        found = []
        for scope in self.keyring.scopes:
            for index, key in enumerate(self.keyring.accepted(scope)):
                uses = [
                    security.key_use(r.node_id, r.tags, key) if security is not None else None
                    for r in records
                ]
                found.append(
                    KeyHolders(
                        scope=scope,
                        key_id=key.key_id,
                        primary=index == 0,
                        holders=sum(use in (FIRST, ALSO) for use in uses),
                        first=sum(use == FIRST for use in uses),
                    )
                )
        return found
