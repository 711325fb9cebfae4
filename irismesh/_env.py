"""What irismesh takes from the environment, and where its files live unless told otherwise.

    IRISMESH_DISCOVERY  0 (also false, no, off) turns default discovery off; 1 (true, yes, on)
                        or unset leaves it on
    IRISMESH_SEEDS      endpoints added to every node's seeds, separated by commas or spaces
    IRISMESH_INTERFACE  the address of the interface discovery runs on (default 127.0.0.1)
    IRISMESH_TRANSPORT  what links run on where `Node(transport=...)` does not say: tcp (the
                        default: irismesh's framing over the event loop's TCP) or zmq
    IRISMESH_METRICS    HOST:PORT where every node of the process serves Prometheus metrics
                        (`Node(metrics=...)` comes first; HOST defaults to 127.0.0.1)
    IRISMESH_IDENTITY   the identity file (`mesh identity new`) of every node of the process
                        that `Node(identity=...)` does not give one (default: a fresh one)
    IRISMESH_GRANT      the grant file (`mesh grant`) of every node of the process that
                        `Node(grant=...)` does not give one
    IRISMESH_CONFIG     the `mesh` config file (default: config.toml in the config directory)
    XDG_CONFIG_HOME     the config directory is $XDG_CONFIG_HOME/irismesh (~/.config/irismesh)

The default keyring is mesh.keys in the config directory; `IRISMESH_KEYFILE` and
`IRISMESH_KEYS` (read by `Keyring.from_env`) come before it. The default identity file,
node.identity there, is where `mesh identity new` writes; a node takes it only when told
(`mesh node --identity`), since two nodes sharing one would share one id. The default grant,
node.grant there, goes with the default identity: a node given that identity file takes it
when no other grant is given. The default authority key, authority.key there, is where
`mesh authority new` writes and `mesh grant` and `mesh revoke` read.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

from irismesh.errors import ConfigurationError

DISCOVERY = "IRISMESH_DISCOVERY"
SEEDS = "IRISMESH_SEEDS"
INTERFACE = "IRISMESH_INTERFACE"
CONFIG = "IRISMESH_CONFIG"
TRANSPORT = "IRISMESH_TRANSPORT"
METRICS = "IRISMESH_METRICS"
IDENTITY = "IRISMESH_IDENTITY"
GRANT = "IRISMESH_GRANT"
TRANSPORTS = ("tcp", "zmq")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def discovery_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether discovery is on by default: unless IRISMESH_DISCOVERY says 0 (or false, ...)."""
    text = _environ(environ).get(DISCOVERY, "").strip().lower()
    if not text or text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigurationError(f"{DISCOVERY}={text!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def seeds(environ: Mapping[str, str] | None = None) -> list[str]:
    """The endpoints in IRISMESH_SEEDS, in order."""
    text = _environ(environ).get(SEEDS, "")
    return [seed for seed in text.replace(",", " ").split() if seed]


def transport(environ: Mapping[str, str] | None = None) -> str:
    """The link transport IRISMESH_TRANSPORT names, "tcp" when unset."""
    text = _environ(environ).get(TRANSPORT, "").strip().lower()
    if not text:
        return TRANSPORTS[0]
    if text not in TRANSPORTS:
        raise ConfigurationError(f"{TRANSPORT}={text!r}: expected one of {', '.join(TRANSPORTS)}")
    return text


def metrics(environ: Mapping[str, str] | None = None) -> str:
    """Where IRISMESH_METRICS asks nodes to serve their metrics ("": nowhere)."""
    return _environ(environ).get(METRICS, "").strip()


def metrics_address(text: str) -> tuple[str, int]:
    """A metrics address, HOST:PORT, :PORT or PORT, as (host, port); HOST is an IP address,
    127.0.0.1 unless given (metrics stay on loopback unless asked otherwise)."""
    given = text.strip()
    host, sep, port = given.rpartition(":")
    if not sep:
        host, port = "", given
    host = host.strip("[]") or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ConfigurationError(
            f"bad metrics address {text!r}: expected HOST:PORT with an IP address, e.g. "
            "127.0.0.1:9464"
        )
    return host, number


def interface(environ: Mapping[str, str] | None = None) -> str | None:
    """The discovery interface in IRISMESH_INTERFACE, if set: one interface's IPv4 address."""
    text = _environ(environ).get(INTERFACE, "").strip()
    if not text:
        return None
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:
        address = None
    if address is None or address.is_unspecified or address.is_multicast or address.is_reserved:
        raise ConfigurationError(
            f"{INTERFACE}={text!r}: expected the IPv4 address of one interface, e.g. 10.0.0.5"
        )
    return text


def config_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$XDG_CONFIG_HOME/irismesh, or ~/.config/irismesh."""
    base = _environ(environ).get("XDG_CONFIG_HOME", "")
    from pathlib import Path  # only for a file's place: a node that names its files needs none

    root = Path(base) if os.path.isabs(base) else Path.home() / ".config"
    return root / "irismesh"


def config_file(environ: Mapping[str, str] | None = None) -> Path:
    """The `mesh` config file: $IRISMESH_CONFIG, or config.toml in the config directory."""
    path = _environ(environ).get(CONFIG, "")
    if path:
        from pathlib import Path

        return Path(path).expanduser()
    return config_dir(environ) / "config.toml"


def default_keyfile(environ: Mapping[str, str] | None = None) -> Path:
    """Where `mesh keygen` writes, and nodes look last, for the keyring: mesh.keys there."""
    return config_dir(environ) / "mesh.keys"


def default_identity_file(environ: Mapping[str, str] | None = None) -> Path:
    """Where `mesh identity new` writes without a path: node.identity beside the keyring."""
    return config_dir(environ) / "node.identity"


def identity_file(environ: Mapping[str, str] | None = None) -> str | None:
    """$IRISMESH_IDENTITY (a path), if set."""
    path = _environ(environ).get(IDENTITY, "")
    return os.path.expanduser(path) if path else None


def default_grant_file(environ: Mapping[str, str] | None = None) -> Path:
    """The grant of the default identity: node.grant beside the keyring."""
    return config_dir(environ) / "node.grant"


def default_authority_file(environ: Mapping[str, str] | None = None) -> Path:
    """Where `mesh authority new` writes, and `mesh grant` reads, the authority's key."""
    return config_dir(environ) / "authority.key"


def grant_file(environ: Mapping[str, str] | None = None) -> str | None:
    """$IRISMESH_GRANT (a path), if set."""
    path = _environ(environ).get(GRANT, "")
    return os.path.expanduser(path) if path else None
