"""Rereading a keyring file while the node runs: key rotation without restarts.

Theory of operation
-------------------
A node whose keyring came from a file (`Keyring.load`, `IRISMESH_KEYFILE`, `mesh --keys`, the
default keyring) keeps a `KeyringFile` for it and polls it every `POLL_INTERVAL` seconds. A poll
is one `os.stat`: the file's identity and shape (device, inode, size, modification and change
times) make its *signature*, and nothing is read while the signature stays the one last read.
When it changes, the file is read only once the same new signature is seen at two polls in a
row: an editor or a script still writing it (the file truncated, half its lines there) changes
it again in between, so a half-written file is not taken for a finished one. `reload()` (what
SIGHUP does) reads it at once: the operator says it is finished.

A file that cannot be used is refused whole and the keys in use stay: unreadable or missing,
open to group or others, not a keyring, a line cut short, a key for a served cluster missing
(`check`). The refusal is one logged line, once per signature: the same bad file is not read or
reported again until it changes. A file whose keys are those in use (a `touch`, say) changes
nothing.

What a new keyring then does to the node is the node's business (`Node.use_keyring`): this
module only decides when there is a new one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from irismesh.errors import ConfigurationError
from irismesh.security.keyring import Keyring

__all__ = ["POLL_INTERVAL", "KeyringFile"]

POLL_INTERVAL = 0.5  # seconds between two stats of the file: a change applies in 0.5-1 s
_log = logging.getLogger("irismesh.keyring")

Signature = tuple[int, int, int, int, int]


def _signature(path: str) -> Signature | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _ids(keyring: Keyring) -> str:
    return ", ".join(f"{key.scope}:{key.key_id}" for key in keyring) or "none"


class KeyringFile:
    """The keyring file behind a node's keys: when it holds a new keyring, and which."""

    def __init__(
        self,
        path: str,
        keyring: Keyring,
        *,
        check: Callable[[Keyring], None] = lambda keyring: None,
        log: logging.Logger = _log,
    ) -> None:
        self.path = path
        self.keyring = keyring  # the keys in use
        self._check = check  # raises ConfigurationError for keys the node cannot use
        self._log = log
        self._read = _signature(path)  # the signature last read (or refused)
        self._seen = self._read  # the signature seen at the last poll
        self.refused = 0  # files refused, for tests and stats

    def poll(self) -> Keyring | None:
        """One stat; the new keyring once the file has changed and then stayed unchanged for
        one poll; None otherwise."""
        now = _signature(self.path)
        seen, self._seen = self._seen, now
        if now == self._read or now != seen:
            return None
        return self._take(now)

    def reload(self) -> Keyring | None:
        """Read the file now (SIGHUP): its keyring if new and usable, else None."""
        now = self._seen = _signature(self.path)
        return self._take(now)

    def _take(self, signature: Signature | None) -> Keyring | None:
        self._read = signature
        try:
            keyring = Keyring.load(self.path)
            if keyring == self.keyring:
                return None
            self._check(keyring)
        except ConfigurationError as exc:
            self.refused += 1
            self._log.warning(
                "keyring %s not reloaded, keeping keys %s: %s", self.path, _ids(self.keyring), exc
            )
            return None
        self._log.info(
            "keyring %s reloaded: keys %s (were %s)", self.path, _ids(keyring), _ids(self.keyring)
        )
        self.keyring = keyring
        return keyring
