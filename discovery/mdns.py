"""mDNS discovery: announce this node as an ``_irismesh._tcp`` service and browse for the others.

Theory of operation. Each node owns one `AsyncZeroconf` on its configured interfaces (loopback
by default, IPv4 only) running on the caller's event loop. It registers one service instance,
``<first 16 hex digits of the node id>._irismesh._tcp.local.``, whose records say only:

* SRV: the mesh port, on a host name of the node's own (``<same prefix>.irismesh.local.``);
* A: the one address the mesh endpoint listens on;
* TXT: ``v=1`` (record format), ``id=<node id, hex>`` and, when a realm key is configured,
  ``r=<realm tag, hex>``.

The realm tag is HMAC-SHA256(realm key, domain | node id | address | port), cut to 16 bytes.
It lets a node tell a peer of its own mesh from a foreign one, while a standard mDNS browser
sees that a mesh node is there and nothing else: no cluster names, no key ids, nothing a
keyless observer can check or forge. It covers the address and port as well as the id, so a
tag copied from the wire cannot point this mesh's nodes at some other address. During a key
rotation a node tags with its primary key and accepts tags under every accepted key.

The browser reports every added or updated instance of the service type; each is resolved
(SRV, TXT and A, nearly always straight from the cache the browse answer just filled) in a task
of its own, at most `MAX_RESOLVING` at once, then validated. What passes becomes a candidate,
``on_candidate(node_id, "tcp://<address>:<port>")``; everything else is counted and dropped,
never raised: malformed records (``dropped_malformed``), a foreign or missing realm tag
(``dropped_realm``), this node's own instance (``dropped_self``).

mDNS yields *candidates only*, never membership and never liveness. Membership comes from the
mesh handshake (a record may be forged by anyone on the link), liveness from the mesh's
heartbeats: zeroconf raises the lifetime of the records it caches to at least 1125 s, so after
a peer crashes (no goodbye sent) its records, and a browser's view of it, outlive it by
nearly 19 minutes. Only a clean shutdown, which sends goodbyes (``async_unregister_service``),
makes other browsers report the instance removed.

Registration uses zeroconf's *cooperating responders* mode where the installed zeroconf has it:
no probing for name conflicts, so a node is announced at once (a probed registration takes
about 1.7 s) and `start` returns in about a millisecond while the three announcements go out
over the next 0.45 s. Instance names come from random 64-bit id prefixes and never clash in
practice; without that mode zeroconf probes, and renames the instance on a clash
(``allow_name_change``, which cooperating mode ignores). Measured on loopback, processes apart:
running nodes see a new one 2-6 ms after its `start`; the new node sees them about 0.15 s
later (its first question waits 20-120 ms, their answers as long again), or about 1.1 s if they
had multicast their records within the last second, as RFC 6762 makes them wait.

Questions are multicast-response (QM) only. On loopback every zeroconf instance on the host
shares port 5353, and the kernel hands a unicast reply to a single one of them, usually not the
one that asked; zeroconf's default first question asks for a unicast reply, and the answer that
would have found a new peer in milliseconds then arrives only with the next query, a second or
more later.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import ipaddress
import logging
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from irismesh.discovery._common import check_startable, offer
from irismesh.discovery.config import (  # the settings: kept apart, loaded with the node
    DEFAULT_SERVICE_TYPE,
    MdnsConfig,
    mdns_config,
)
from irismesh.errors import ConfigurationError, ProtocolError

if TYPE_CHECKING:
    from zeroconf import ServiceStateChange, Zeroconf
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf


# zeroconf is imported when a node first starts mDNS, not with irismesh: it is a fifth of the
# import time of the package, and most nodes never use it.

__all__ = [
    "DEFAULT_SERVICE_TYPE",
    "MAX_RESOLVING",
    "MdnsAdvert",
    "MdnsConfig",
    "MdnsDiscovery",
    "advert_properties",
    "mdns_config",
    "parse_advert",
    "realm_tag",
    "verified_endpoints",
]

_log = logging.getLogger(__name__)

RECORD_VERSION = 1
NODE_ID_LEN = 16
REALM_TAG_LEN = 16
INSTANCE_PREFIX_LEN = 16  # hex digits of the node id in the instance name
MAX_RESOLVING = 64  # resolutions in flight at once; a flood of instances beyond is dropped
MAX_FOUND = 4096  # services remembered to offer again
MAX_ADDRESSES = 8  # addresses of one peer worth checking
_REALM_DOMAIN = b"irismesh/v1/mdns-realm\x00"
_HEX_ID = re.compile(rb"[0-9a-f]{%d}" % (2 * NODE_ID_LEN))
_HEX_TAG = re.compile(rb"[0-9a-f]{%d}" % (2 * REALM_TAG_LEN))


# ---------------------------------------------------------------------------------------------
# records: pure, no I/O


def realm_tag(key: bytes, node_id: bytes, address: str, port: int) -> bytes:
    """The keyed tag that ties a node id and its endpoint to the holders of ``key``."""
    message = _REALM_DOMAIN + node_id + socket.inet_aton(address) + port.to_bytes(2, "big")
    return hmac.new(key, message, hashlib.sha256).digest()[:REALM_TAG_LEN]


def advert_properties(
    *, node_id: bytes, address: str, port: int, realm_key: bytes | None
) -> dict[str, str]:
    """The TXT properties a node publishes: version, id and (with a key) its realm tag."""
    properties = {"v": str(RECORD_VERSION), "id": node_id.hex()}
    if realm_key is not None:
        properties["r"] = realm_tag(realm_key, node_id, address, port).hex()
    return properties


@dataclass(frozen=True, slots=True, kw_only=True)
class MdnsAdvert:
    """What a peer's resolved records claim, checked for form but not yet for realm."""

    node_id: bytes
    addresses: tuple[str, ...]
    port: int
    tag: bytes | None


def parse_advert(
    properties: Mapping[bytes, bytes | None], addresses: Sequence[str], port: int | None
) -> MdnsAdvert:
    """Check a resolved instance's TXT, A and SRV data; raise `ProtocolError` if malformed."""
    version = properties.get(b"v")
    if version != str(RECORD_VERSION).encode():
        raise ProtocolError("bad_version", repr(version)[:40])
    raw_id = properties.get(b"id")
    if raw_id is None or not _HEX_ID.fullmatch(raw_id):
        raise ProtocolError("bad_id", f"id is not {2 * NODE_ID_LEN} lowercase hex digits")
    raw_tag = properties.get(b"r")
    if raw_tag is not None and not _HEX_TAG.fullmatch(raw_tag):
        raise ProtocolError("bad_tag", f"r is not {2 * REALM_TAG_LEN} lowercase hex digits")
    if b"r" in properties and raw_tag is None:
        raise ProtocolError("bad_tag", "r has no value")
    if port is None or not 1 <= port <= 65535:
        raise ProtocolError("bad_port", str(port))
    usable: list[str] = []
    for text in addresses[:MAX_ADDRESSES]:
        try:
            address = ipaddress.IPv4Address(text)
        except ValueError:
            continue
        if not (address.is_unspecified or address.is_multicast or address.is_reserved):
            usable.append(str(address))
    if not usable:
        raise ProtocolError("bad_address", "no usable IPv4 address")
    return MdnsAdvert(
        node_id=bytes.fromhex(raw_id.decode()),
        addresses=tuple(usable),
        port=port,
        tag=None if raw_tag is None else bytes.fromhex(raw_tag.decode()),
    )


def verified_endpoints(advert: MdnsAdvert, keys: Sequence[bytes]) -> tuple[str, ...]:
    """The advert's endpoints whose realm tag verifies under one of ``keys`` (all if no keys)."""
    if not keys:
        return tuple(f"tcp://{a}:{advert.port}" for a in advert.addresses)
    if advert.tag is None:
        return ()
    return tuple(
        f"tcp://{address}:{advert.port}"
        for address in advert.addresses
        if any(
            hmac.compare_digest(advert.tag, realm_tag(key, advert.node_id, address, advert.port))
            for key in keys
        )
    )


# ---------------------------------------------------------------------------------------------
# asyncio engine


_STAT_NAMES = (
    "registered",
    "seen",
    "removed",
    "candidates",
    "unresolved",
    "dropped_realm",
    "dropped_malformed",
    "dropped_self",
    "dropped_busy",
    "callback_errors",
    "reoffered",
)


def _cooperating(aiozc: AsyncZeroconf) -> bool:
    """Every zeroconf that pyproject allows (>= 0.130) has the argument (added in 2020); the
    check keeps an older install working, with probing."""
    signature = inspect.signature(aiozc.async_register_service)
    return "cooperating_responders" in signature.parameters


class MdnsDiscovery:
    """Announce this node over mDNS and report every other irismesh node found as a candidate."""

    def __init__(
        self,
        *,
        node_id: bytes,
        endpoint: str,
        config: MdnsConfig,
        on_candidate: Callable[[bytes, str], None],
    ) -> None:
        if not isinstance(node_id, bytes) or len(node_id) != NODE_ID_LEN:
            raise ConfigurationError(f"an mdns node id is {NODE_ID_LEN} bytes")
        self._node_id = node_id
        self._config = config
        self._on_candidate = on_candidate
        self._address, self._port = _own_endpoint(endpoint, config.interfaces)
        self._endpoint = endpoint
        prefix = node_id.hex()[:INSTANCE_PREFIX_LEN]
        from zeroconf.asyncio import AsyncServiceInfo

        self._info = AsyncServiceInfo(
            config.service_type,
            f"{prefix}.{config.service_type}",
            port=self._port,
            properties=advert_properties(
                node_id=node_id, address=self._address, port=self._port, realm_key=config.realm_key
            ),
            server=f"{prefix}.irismesh.local.",
            parsed_addresses=[self._address],
        )
        self._keys = config.verifying_keys
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._announcing: asyncio.Future[Any] | None = None
        self._resolving: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()  # names updated while a resolution was in flight
        self._found: dict[str, tuple[bytes, tuple[str, ...]]] = {}  # name -> (id, endpoints)
        self._reoffering: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        self._close_done: asyncio.Event | None = None

    @property
    def stats(self) -> Mapping[str, int]:
        """A snapshot of the counters.

        ``registered``: 1 once announced; ``seen``: instances added or updated, this node's own
        included; ``removed``: goodbyes (and expiries) heard; ``candidates``: reported;
        ``unresolved``: no complete answer within ``resolve_timeout``; ``dropped_*``: see the
        module docstring, plus ``dropped_busy`` when `MAX_RESOLVING` resolutions were in flight;
        ``callback_errors``: exceptions from ``on_candidate``, logged and swallowed.
        """
        return dict(self._stats)

    @property
    def service_info(self) -> AsyncServiceInfo:
        """The records this node announces (the instance name is final once started)."""
        return self._info

    @property
    def zeroconf(self) -> AsyncZeroconf | None:
        """The zeroconf instance while running, for inspection; None before start or after close."""
        return self._aiozc

    async def start(self) -> None:
        """Open zeroconf, browse and register; raise `ConfigurationError` if that fails."""
        check_startable("MdnsDiscovery", closed=self._closed, started=self._started)
        self._started = True
        try:
            await self._open()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Unregister (goodbyes go out), stop browsing, close zeroconf; safe to call again."""
        if self._close_done is not None:
            # A second caller waits for the first one's close to finish.
            await self._close_done.wait()
            return
        self._closed = True
        self._close_done = asyncio.Event()
        try:
            await self._shut()
        finally:
            self._close_done.set()

    async def _open(self) -> None:
        from zeroconf import DNSQuestionType, IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

        cfg = self._config
        _check_local(cfg.interfaces)
        try:
            aiozc = AsyncZeroconf(interfaces=list(cfg.interfaces), ip_version=IPVersion.V4Only)
        except OSError as exc:
            raise ConfigurationError(
                f"mdns cannot open port 5353 on {', '.join(cfg.interfaces)}: {exc}"
            ) from exc
        self._aiozc = aiozc
        zc = aiozc.zeroconf
        await zc.async_wait_for_start()
        # zeroconf skips an interface it cannot join (logging at INFO) rather than failing:
        # insist that every configured interface, and nothing else, carries this node's mDNS.
        pinned = {str(t.sock_name[0]) for t in zc.engine.senders}
        if pinned != set(cfg.interfaces):
            raise ConfigurationError(
                f"mdns could join the multicast group on {sorted(pinned) or 'no interface'}, "
                f"not on all of {list(cfg.interfaces)}: check that each address is up and "
                "multicast-capable here"
            )
        self._browser = AsyncServiceBrowser(
            zc, cfg.service_type, handlers=[self._on_state_change], question_type=DNSQuestionType.QM
        )
        if _cooperating(aiozc):
            announcing = await aiozc.async_register_service(
                self._info, cooperating_responders=True, allow_name_change=True
            )
        else:  # pragma: no cover - zeroconf < 0.132
            announcing = await aiozc.async_register_service(self._info, allow_name_change=True)
        self._announcing = asyncio.ensure_future(announcing)
        self._count("registered")
        self._reoffering = asyncio.get_running_loop().create_task(
            self._reoffer(), name="irismesh-mdns-reoffer"
        )

    async def _reoffer(self) -> None:
        while True:
            await asyncio.sleep(self._config.reoffer_interval)
            for node_id, endpoints in list(self._found.values()):
                for endpoint in endpoints:
                    self._offer(node_id, endpoint)
                    self._count("reoffered")

    def _offer(self, node_id: bytes, endpoint: str) -> None:
        offer(self._on_candidate, node_id, endpoint, stats=self._stats, what="mdns", log=_log)

    async def _shut(self) -> None:
        tasks = list(self._resolving.values())
        if self._reoffering is not None:
            tasks.append(self._reoffering)
            self._reoffering = None
        self._resolving.clear()
        self._again.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        browser, self._browser = self._browser, None
        if browser is not None:
            await browser.async_cancel()
        aiozc, self._aiozc = self._aiozc, None
        if aiozc is None:
            return
        announcing, self._announcing = self._announcing, None
        try:
            if announcing is not None:
                # An announcement sent after the goodbye would put the records back into
                # every cache for another 1125 s.
                announcing.cancel()
                await asyncio.wait([announcing])
                with contextlib.suppress(TimeoutError):
                    goodbye = await aiozc.async_unregister_service(self._info)
                    await asyncio.wait_for(goodbye, timeout=2.0)
        finally:
            await aiozc.async_close()

    def _count(self, name: str) -> None:
        self._stats[name] += 1

    def _on_state_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        # Runs inside zeroconf's record processing on our loop: no awaiting, no raising.
        from zeroconf import ServiceStateChange

        if self._closed:
            return
        if state_change is ServiceStateChange.Removed:
            self._count("removed")
            self._again.discard(name)
            self._found.pop(name, None)
            task = self._resolving.pop(name, None)
            if task is not None:
                task.cancel()
            return
        self._count("seen")
        if name.lower() == self._info.name.lower():
            self._count("dropped_self")
            return
        if name in self._resolving:
            self._again.add(name)
            return
        if len(self._resolving) >= MAX_RESOLVING:
            self._count("dropped_busy")
            return
        self._resolving[name] = asyncio.get_running_loop().create_task(
            self._resolve(service_type, name), name="irismesh-mdns-resolve"
        )

    async def _resolve(self, service_type: str, name: str) -> None:
        try:
            while True:
                self._again.discard(name)
                await self._resolve_once(service_type, name)
                if name not in self._again:
                    return
        finally:
            if self._resolving.get(name) is asyncio.current_task():
                del self._resolving[name]

    async def _resolve_once(self, service_type: str, name: str) -> None:
        from zeroconf import BadTypeInNameException, DNSQuestionType, IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        aiozc = self._aiozc
        if aiozc is None:
            return
        try:
            info = AsyncServiceInfo(service_type, name)
        except BadTypeInNameException:
            self._count("dropped_malformed")
            return
        timeout_ms = self._config.resolve_timeout * 1000
        if not await info.async_request(
            aiozc.zeroconf, timeout_ms, question_type=DNSQuestionType.QM
        ):
            self._count("unresolved")
            return
        try:
            advert = parse_advert(
                info.properties, info.parsed_addresses(IPVersion.V4Only), info.port
            )
        except ProtocolError:
            self._count("dropped_malformed")
            return
        if hmac.compare_digest(advert.node_id, self._node_id):
            self._count("dropped_self")
            return
        endpoints = verified_endpoints(advert, self._keys)
        if not endpoints:
            self._count("dropped_realm")
            return
        if name in self._found or len(self._found) < MAX_FOUND:
            self._found[name] = (advert.node_id, endpoints)
        for endpoint in endpoints:
            self._count("candidates")
            self._offer(advert.node_id, endpoint)


def _own_endpoint(endpoint: str, interfaces: tuple[str, ...]) -> tuple[str, int]:
    """The address and port of a ``tcp://a.b.c.d:port`` endpoint on a configured interface."""
    host, sep, port_text = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port_text.isdigit():
        raise ConfigurationError(f"mdns endpoint {endpoint!r} is not tcp://<IPv4 address>:<port>")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigurationError(f"mdns endpoint {endpoint!r}: port {port} is not in 1..65535")
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigurationError(
            f"mdns endpoint {endpoint!r} must name an IPv4 address, not a host name"
        ) from None
    if address.is_unspecified:
        raise ConfigurationError(
            f"mdns cannot advertise {endpoint!r}: 0.0.0.0 is no address a peer can dial; "
            "advertise the address of one of the mdns interfaces instead"
        )
    if str(address) not in interfaces:
        raise ConfigurationError(
            f"mdns endpoint {endpoint!r} is not on an mdns interface ({', '.join(interfaces)}): "
            "peers that find it there could not reach it"
        )
    return str(address), port


def _check_local(interfaces: tuple[str, ...]) -> None:
    """Refuse addresses this host does not have, before zeroconf silently skips them."""
    for address in interfaces:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address, 0))  # sends nothing; fails unless the address is ours
            except OSError as exc:
                raise ConfigurationError(
                    f"mdns interface {address} is not an address of this host: {exc.strerror}"
                ) from None
