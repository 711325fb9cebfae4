"""What the survey and mDNS discovery share: a service starts once and a closed one never
again (a new one is made instead), and an address they are told to use is one IPv4 host (not
0.0.0.0, a multicast group or a reserved address, which name no one interface or host). Both
give each candidate to the node's callback the same way: a callback that raises is counted and
logged, and discovery goes on."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable

from irismesh.errors import Closed, ConfigurationError


def check_startable(name: str, *, closed: bool, started: bool) -> None:
    """Raise `Closed` if the service `name` was closed, `ConfigurationError` if it was started."""
    if closed:
        raise Closed(f"this {name} is closed; create a new one")
    if started:
        raise ConfigurationError(f"{name}.start() was already called")


def ipv4_host(text: str, *, not_ipv4: str, not_host: str) -> ipaddress.IPv4Address:
    """`text` as an IPv4 host address, or `ConfigurationError` with the message that fits."""
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:
        raise ConfigurationError(not_ipv4) from None
    if address.is_unspecified or address.is_multicast or address.is_reserved:
        raise ConfigurationError(not_host)
    return address


def offer(
    on_candidate: Callable[[bytes, str], None],
    node_id: bytes,
    endpoint: str,
    *,
    stats: dict[str, int],
    what: str,
    log: logging.Logger,
) -> None:
    """Give a candidate to `on_candidate`. If it raises, count `callback_errors` in `stats` and
    log it (the first time as a warning, then quietly): a node's bug does not stop discovery."""
    try:
        on_candidate(node_id, endpoint)
    except Exception:
        stats["callback_errors"] += 1
        level = logging.WARNING if stats["callback_errors"] == 1 else logging.DEBUG
        log.log(level, "%s candidate callback raised; discovery goes on", what, exc_info=True)
