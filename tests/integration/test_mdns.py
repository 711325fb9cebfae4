"""MdnsDiscovery over real zeroconf, pinned to 127.0.0.1.

Every zeroconf instance here, the module's and the tests' own, runs with
``interfaces=["127.0.0.1"]`` and IPv4 only. Most tests browse a service type of their own, so
parallel runs (and other engineers' nodes) stay out of their candidate sets, and every wait is
a condition with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import zeroconf.asyncio
from helpers import (
    Discovering,
    all_started,
    candidate_recorder,
    deadline,
    end_child,
    realms_kept_apart,
    run_with_deadline,
    wait_until,
)
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from irismesh.discovery.mdns import (
    DEFAULT_SERVICE_TYPE,
    MdnsAdvert,
    MdnsConfig,
    MdnsDiscovery,
    advert_properties,
    parse_advert,
    realm_tag,
    verified_endpoints,
)
from irismesh.errors import Closed, ConfigurationError, ProtocolError
from irismesh.security.keyring import Keyring

LOOPBACK = "127.0.0.1"
TEST_TIMEOUT = 20.0
DISCOVERY = 5.0  # NETLAB: a browser sees a new service in 0.03-1.2 s


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    run_with_deadline(scenario(), TEST_TIMEOUT)


def fresh_type() -> str:
    return f"_im{os.urandom(3).hex()}._tcp.local."


def loopback_zeroconf() -> AsyncZeroconf:
    """A test's own zeroconf, pinned to loopback like the module's."""
    return AsyncZeroconf(interfaces=[LOOPBACK], ip_version=IPVersion.V4Only)


@pytest.fixture(scope="module")
def mdns_on_loopback() -> None:
    """Probe once: one zeroconf must see another's service on 127.0.0.1, or nothing can pass."""

    async def probe() -> str | None:
        service_type = fresh_type()
        seen = asyncio.Event()

        def on_change(**_: object) -> None:
            seen.set()

        try:
            announcer, listener = loopback_zeroconf(), loopback_zeroconf()
        except OSError as exc:
            return f"zeroconf cannot open 127.0.0.1:5353 here: {exc}"
        try:
            browser = AsyncServiceBrowser(listener.zeroconf, service_type, handlers=[on_change])
            info = AsyncServiceInfo(
                service_type,
                f"probe.{service_type}",
                port=9,
                parsed_addresses=[LOOPBACK],
                server="irismesh-probe.local.",
            )
            await announcer.async_register_service(info, cooperating_responders=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3.0):
                    await seen.wait()
            await browser.async_cancel()
        finally:
            await announcer.async_close()
            await listener.async_close()
        return None if seen.is_set() else "mDNS multicast on 127.0.0.1 delivers nothing here"

    reason = asyncio.run(probe())
    if reason is not None:
        pytest.skip(reason)


needs_mdns = pytest.mark.usefixtures("mdns_on_loopback")


@pytest.fixture
def zeroconf_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The arguments of every AsyncZeroconf the module creates during the test."""
    calls: list[dict[str, Any]] = []
    real = AsyncZeroconf

    def spy(*args: Any, **kwargs: Any) -> AsyncZeroconf:
        calls.append({"args": args, **kwargs})
        return real(*args, **kwargs)

    # The module imports zeroconf when it first opens it: patch where it imports from.
    monkeypatch.setattr(zeroconf.asyncio, "AsyncZeroconf", spy)
    return calls


@dataclass
class Peer(Discovering):
    discovery: MdnsDiscovery


_next_port = iter(range(21000, 60000, 7))


def make_peer(config: MdnsConfig, *, raising: bool = False) -> Peer:
    node_id = os.urandom(16)
    endpoint = f"tcp://{LOOPBACK}:{next(_next_port)}"
    seen, on_candidate = candidate_recorder(raising=raising)
    discovery = MdnsDiscovery(
        node_id=node_id, endpoint=endpoint, config=config, on_candidate=on_candidate
    )
    return Peer(node_id=node_id, endpoint=endpoint, discovery=discovery, seen=seen)


def started(*peers: Peer) -> contextlib.AbstractAsyncContextManager[None]:
    return all_started(peer.discovery for peer in peers)


@contextlib.asynccontextmanager
async def watching(service_type: str) -> AsyncIterator[list[tuple[str, ServiceStateChange]]]:
    """A plain zeroconf browser, as any mDNS tool would run one: its events, in order."""
    events: list[tuple[str, ServiceStateChange]] = []

    def on_change(
        zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        events.append((name, state_change))

    aiozc = loopback_zeroconf()
    browser = AsyncServiceBrowser(aiozc.zeroconf, service_type, handlers=[on_change])
    try:
        yield events
    finally:
        await browser.async_cancel()
        await aiozc.async_close()


# ---------------------------------------------------------------------------------------------
# records and configuration: no network


def test_an_advert_round_trips_and_its_tag_verifies_only_under_the_key() -> None:
    key, other = os.urandom(32), os.urandom(32)
    node_id = os.urandom(16)
    props = advert_properties(node_id=node_id, address=LOOPBACK, port=4567, realm_key=key)
    assert set(props) == {"v", "id", "r"}
    wire = {k.encode(): v.encode() for k, v in props.items()}
    advert = parse_advert(wire, [LOOPBACK], 4567)
    assert advert.node_id == node_id
    endpoint = f"tcp://{LOOPBACK}:4567"
    assert verified_endpoints(advert, [key]) == (endpoint,)
    assert verified_endpoints(advert, [other]) == ()
    assert verified_endpoints(advert, [other, key]) == (endpoint,), "a rotation accepts either"
    assert verified_endpoints(advert, []) == (endpoint,), "no key: any irismesh node"
    # The tag covers the endpoint: copied onto another port or address it no longer verifies.
    assert verified_endpoints(parse_advert(wire, [LOOPBACK], 4568), [key]) == ()
    assert verified_endpoints(parse_advert(wire, ["127.0.0.2"], 4567), [key]) == ()


def test_an_untagged_advert_is_foreign_to_a_keyed_node() -> None:
    node_id = os.urandom(16)
    props = advert_properties(node_id=node_id, address=LOOPBACK, port=1, realm_key=None)
    assert set(props) == {"v", "id"}
    advert = parse_advert({k.encode(): v.encode() for k, v in props.items()}, [LOOPBACK], 1)
    assert advert.tag is None
    assert verified_endpoints(advert, [os.urandom(32)]) == ()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({b"v": b"2"}, "bad_version"),
        ({b"v": None}, "bad_version"),
        ({b"id": b"zz" * 16}, "bad_id"),
        ({b"id": b"AB" * 16}, "bad_id"),
        ({b"id": b"ab" * 8}, "bad_id"),
        ({b"id": None}, "bad_id"),
        ({b"r": b"00" * 15}, "bad_tag"),
        ({b"r": None}, "bad_tag"),
    ],
)
def test_malformed_txt_is_a_protocol_error(change: dict[bytes, bytes | None], reason: str) -> None:
    good: dict[bytes, bytes | None] = {b"v": b"1", b"id": b"ab" * 16, b"r": b"cd" * 16}
    with pytest.raises(ProtocolError, match=reason):
        parse_advert({**good, **change}, [LOOPBACK], 80)


@pytest.mark.parametrize(
    ("addresses", "port", "reason"),
    [
        ([LOOPBACK], 0, "bad_port"),
        ([LOOPBACK], None, "bad_port"),
        ([], 80, "bad_address"),
        (["0.0.0.0", "224.0.0.251", "255.255.255.255", "::1"], 80, "bad_address"),
    ],
)
def test_unusable_addresses_and_ports_are_protocol_errors(
    addresses: list[str], port: int | None, reason: str
) -> None:
    with pytest.raises(ProtocolError, match=reason):
        parse_advert({b"v": b"1", b"id": b"ab" * 16}, addresses, port)


def test_only_usable_addresses_are_kept() -> None:
    advert = parse_advert({b"v": b"1", b"id": b"ab" * 16}, ["0.0.0.0", "10.1.2.3", "fe80::1"], 9)
    assert advert == MdnsAdvert(node_id=b"\xab" * 16, addresses=("10.1.2.3",), port=9, tag=None)


def test_realm_tags_depend_on_every_input() -> None:
    key, node_id = os.urandom(32), os.urandom(16)
    base = realm_tag(key, node_id, LOOPBACK, 80)
    assert len(base) == 16
    assert realm_tag(key, node_id, LOOPBACK, 80) == base
    assert realm_tag(os.urandom(32), node_id, LOOPBACK, 80) != base
    assert realm_tag(key, os.urandom(16), LOOPBACK, 80) != base
    assert realm_tag(key, node_id, "127.0.0.2", 80) != base
    assert realm_tag(key, node_id, LOOPBACK, 81) != base


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"interfaces": ("0.0.0.0",)}, "one interface"),
        ({"interfaces": ("255.255.255.255",)}, "one interface"),
        ({"interfaces": ("224.0.0.251",)}, "one interface"),
        ({"interfaces": ()}, "non-empty"),
        ({"interfaces": "127.0.0.1"}, "non-empty tuple"),
        ({"interfaces": ("lo",)}, "not an IPv4 address"),
        ({"interfaces": ("::1",)}, "not an IPv4 address"),
        ({"service_type": "_irismesh._udp.local."}, "service type"),
        ({"service_type": "_this-is-far-too-long._tcp.local."}, "service type"),
        ({"service_type": "irismesh._tcp.local."}, "service type"),
        ({"realm_key": b"short"}, "32 bytes"),
        ({"realm_key": os.urandom(32), "accepted_realm_keys": (b"x",)}, "32 bytes"),
        ({"accepted_realm_keys": (os.urandom(32),)}, "needs a realm_key"),
        ({"resolve_timeout": 0}, "resolve_timeout"),
    ],
)
def test_bad_configs_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        MdnsConfig(**kwargs)


def test_defaults_stay_on_loopback() -> None:
    config = MdnsConfig()
    assert config.interfaces == (LOOPBACK,)
    assert config.service_type == DEFAULT_SERVICE_TYPE == "_irismesh._tcp.local."
    assert config.realm_key is None


@pytest.mark.parametrize(
    ("endpoint", "match"),
    [
        ("tcp://0.0.0.0:5000", "0.0.0.0"),
        ("tcp://127.0.0.2:5000", "not on an mdns interface"),
        ("tcp://localhost:5000", "IPv4 address"),
        ("udp://127.0.0.1:5000", "not tcp://"),
        ("tcp://127.0.0.1", "not tcp://"),
        ("tcp://127.0.0.1:0", "port 0"),
        ("tcp://127.0.0.1:70000", "port 70000"),
    ],
)
def test_bad_endpoints_are_refused(endpoint: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        MdnsDiscovery(
            node_id=os.urandom(16),
            endpoint=endpoint,
            config=MdnsConfig(),
            on_candidate=lambda _id, _ep: None,
        )


@deadline(TEST_TIMEOUT)
async def test_close_before_start_is_harmless() -> None:
    peer = make_peer(MdnsConfig(service_type=fresh_type()))
    await peer.discovery.close()
    await peer.discovery.close()
    with pytest.raises(Closed):
        await peer.discovery.start()


def test_an_interface_this_host_lacks_is_refused_before_zeroconf_opens(
    zeroconf_calls: list[dict[str, Any]],
) -> None:
    async def scenario() -> None:
        # 192.0.2.1 is TEST-NET-1: documentation only, never an address of this host.
        discovery = MdnsDiscovery(
            node_id=os.urandom(16),
            endpoint="tcp://192.0.2.1:4000",
            config=MdnsConfig(interfaces=("192.0.2.1",)),
            on_candidate=lambda _id, _ep: None,
        )
        with pytest.raises(ConfigurationError, match=r"192\.0\.2\.1 is not an address"):
            await discovery.start()
        assert discovery.zeroconf is None
        await discovery.close()

    run(scenario)
    assert zeroconf_calls == [], "zeroconf was opened on an interface that is not here"


# ---------------------------------------------------------------------------------------------
# over zeroconf on 127.0.0.1


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_two_nodes_discover_each_other() -> None:
    config = MdnsConfig(service_type=fresh_type(), realm_key=os.urandom(32))
    a, b = make_peer(config), make_peer(config)
    async with started(a, b):
        await wait_until(
            lambda: a.seen == {b.me} and b.seen == {a.me}, DISCOVERY, "a and b see each other"
        )
        for peer in (a, b):
            stats = peer.discovery.stats
            assert stats["registered"] == 1
            assert stats["candidates"] >= 1
            assert stats["dropped_realm"] == stats["dropped_malformed"] == 0


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_found_nodes_are_offered_again_so_a_mesh_that_forgot_them_redials() -> None:
    config = MdnsConfig(service_type=fresh_type(), realm_key=os.urandom(32), reoffer_interval=0.2)
    a, b = make_peer(config), make_peer(config)
    async with started(a, b):
        await wait_until(lambda: b.me in a.seen, DISCOVERY, "a sees b")
        a.seen.clear()  # as if the mesh had forgotten b after failed dials
        await wait_until(lambda: b.me in a.seen, 2.0, "b offered again")
        assert a.discovery.stats["reoffered"] >= 1


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_three_nodes_discover_each_other_and_ignore_themselves() -> None:
    config = MdnsConfig(service_type=fresh_type(), realm_key=os.urandom(32))
    peers = [make_peer(config) for _ in range(3)]
    async with started(*peers):
        expected = [{p.me for p in peers if p is not peer} for peer in peers]
        await wait_until(
            lambda: all(p.seen == e for p, e in zip(peers, expected, strict=True)),
            DISCOVERY,
            "each node sees exactly the two others",
        )
        for peer in peers:
            assert peer.discovery.stats["dropped_self"] >= 1


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_a_node_in_another_process_is_discovered_both_ways() -> None:
    """Processes share port 5353: the case where unicast replies go astray on loopback."""
    child_code = """
import asyncio, os, sys
from irismesh.discovery.mdns import MdnsConfig, MdnsDiscovery

async def main() -> None:
    config = MdnsConfig(service_type=sys.argv[1], realm_key=bytes.fromhex(sys.argv[2]))
    node_id = bytes.fromhex(sys.argv[3])
    def on_candidate(peer: bytes, endpoint: str) -> None:
        print(peer.hex(), endpoint, flush=True)
    discovery = MdnsDiscovery(
        node_id=node_id, endpoint="tcp://127.0.0.1:4999", config=config, on_candidate=on_candidate
    )
    await discovery.start()
    print("started", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await discovery.close()

asyncio.run(main())
"""
    key, child_id = os.urandom(32), os.urandom(16)
    config = MdnsConfig(service_type=fresh_type(), realm_key=key)
    here = make_peer(config)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        child_code,
        config.service_type,
        key.hex(),
        child_id.hex(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        assert await child.stdout.readline() == b"started\n"
        async with started(here):
            line = await asyncio.wait_for(child.stdout.readline(), DISCOVERY)
            assert line.decode().split() == [here.node_id.hex(), here.endpoint]
            await wait_until(
                lambda: here.seen == {(child_id, "tcp://127.0.0.1:4999")},
                DISCOVERY,
                "this process sees the child",
            )
    finally:
        await end_child(child, 5.0)
    assert child.returncode == 0


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_nodes_of_another_realm_are_not_candidates() -> None:
    service_type = fresh_type()
    blue = MdnsConfig(service_type=service_type, realm_key=os.urandom(32))
    blue_a, blue_b = make_peer(blue), make_peer(blue)
    green = make_peer(MdnsConfig(service_type=service_type, realm_key=os.urandom(32)))
    keyless = make_peer(MdnsConfig(service_type=service_type))
    async with started(blue_a, blue_b, green, keyless):
        # Silence is not luck once each side has resolved the other realm's records.
        await realms_kept_apart(
            blue_a, blue_b, green, lambda p: p.discovery.stats["dropped_realm"], (3, 2), DISCOVERY
        )
        assert keyless.me not in blue_a.seen | blue_b.seen | green.seen
        # Without a key every irismesh node is a candidate; the handshake sorts them out.
        await wait_until(
            lambda: keyless.seen == {blue_a.me, blue_b.me, green.me},
            DISCOVERY,
            "the keyless node sees every node",
        )


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_a_rotated_key_still_admits_peers_tagging_with_the_old_one() -> None:
    old, new = os.urandom(32), os.urandom(32)
    service_type = fresh_type()
    lagging = make_peer(
        MdnsConfig(service_type=service_type, realm_key=old, accepted_realm_keys=(new,))
    )
    switched = make_peer(
        MdnsConfig(service_type=service_type, realm_key=new, accepted_realm_keys=(old,))
    )
    async with started(lagging, switched):
        await wait_until(
            lambda: lagging.seen == {switched.me} and switched.seen == {lagging.me},
            DISCOVERY,
            "mid-rotation nodes see each other",
        )


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_a_plain_browser_sees_a_node_and_nothing_about_its_clusters() -> None:
    # A keyring like a deployment's: the realm key is its '*' key, and it has a cluster.
    keyring = Keyring.generate(["*", "payments-db"])
    star = keyring.require("*").secret
    config = MdnsConfig(realm_key=star)  # the default service type, as deployed
    peer = make_peer(config)
    async with watching(DEFAULT_SERVICE_TYPE) as events, started(peer):
        name = peer.discovery.service_info.name
        assert name == f"{peer.node_id.hex()[:16]}.{DEFAULT_SERVICE_TYPE}"
        await wait_until(
            lambda: (name, ServiceStateChange.Added) in events, DISCOVERY, "browser sees it"
        )
        async with contextlib.AsyncExitStack() as stack:
            aiozc = loopback_zeroconf()
            stack.push_async_callback(aiozc.async_close)
            info = await aiozc.async_get_service_info(DEFAULT_SERVICE_TYPE, name, 3000)
        assert info is not None
        assert info.port == int(peer.endpoint.rsplit(":", 1)[1])
        assert info.parsed_addresses() == [LOOPBACK]
        properties = info.properties
        assert set(properties) == {b"v", b"id", b"r"}
        assert properties[b"v"] == b"1"
        assert properties[b"id"] == peer.node_id.hex().encode()
        # The whole TXT record, as it travels: no cluster name and no key in any encoding.
        raw = info.text.lower()
        secrets = [k.secret for k in keyring]
        forbidden = [b"payments", b"cluster", b"*"]
        forbidden += [s.hex().encode() for s in secrets]
        forbidden += [base64.b64encode(s) for s in secrets]
        forbidden += [s[:8] for s in secrets]
        forbidden += [k.key_id.encode() for k in keyring]
        for needle in forbidden:
            assert needle.lower() not in raw, f"{needle!r} leaks into the TXT record"
        # What it does carry proves realm membership only to holders of the key.
        advert = parse_advert(properties, info.parsed_addresses(), info.port)
        assert verified_endpoints(advert, [star]) == (peer.endpoint,)
        assert verified_endpoints(advert, [keyring.require("payments-db").secret]) == ()


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_close_unregisters_and_is_idempotent() -> None:
    config = MdnsConfig(service_type=fresh_type())
    peer = make_peer(config)
    async with watching(config.service_type) as events:
        await peer.discovery.start()
        name = peer.discovery.service_info.name
        await wait_until(
            lambda: (name, ServiceStateChange.Added) in events, DISCOVERY, "browser sees it"
        )
        # Concurrent and repeated closes all return once the goodbyes are out.
        await asyncio.gather(peer.discovery.close(), peer.discovery.close())
        assert peer.discovery.zeroconf is None
        await wait_until(
            lambda: (name, ServiceStateChange.Removed) in events,
            DISCOVERY,
            "the browser sees the service removed",
        )
        await peer.discovery.close()
    with pytest.raises(Closed):
        await peer.discovery.start()


@needs_mdns
def test_zeroconf_is_pinned_to_loopback(zeroconf_calls: list[dict[str, Any]]) -> None:
    async def scenario() -> None:
        peer = make_peer(MdnsConfig(service_type=fresh_type()))
        async with started(peer):
            aiozc = peer.discovery.zeroconf
            assert aiozc is not None
            senders = aiozc.zeroconf.engine.senders
            assert senders, "zeroconf has no sender at all"
            for sender in senders:
                sock = sender.sock
                assert sock.family == socket.AF_INET
                assert sock.getsockname()[0] == LOOPBACK
                pinned = sock.getsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, 4)
                assert socket.inet_ntoa(pinned) == LOOPBACK

    run(scenario)
    assert zeroconf_calls == [
        {"args": (), "interfaces": [LOOPBACK], "ip_version": IPVersion.V4Only}
    ], "the module opened zeroconf with other arguments"


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_malformed_and_impostor_records_are_counted_and_discovery_goes_on() -> None:
    config = MdnsConfig(service_type=fresh_type())
    peer, friend = make_peer(config), make_peer(config)
    stype = config.service_type

    def forged(label: str, properties: dict[str, str], port: int = 7) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            stype,
            f"{label}.{stype}",
            port=port,
            properties=properties,
            server=f"{label}.forger.local.",
            parsed_addresses=[LOOPBACK],
        )

    bad = [
        forged("noversion", {"id": "ab" * 16}),
        forged("badid", {"v": "1", "id": "not-hex"}),
        forged("future", {"v": "9", "id": "cd" * 16}),
    ]
    impostor = forged("impostor", {"v": "1", "id": peer.node_id.hex()})
    forger = loopback_zeroconf()
    try:
        async with started(peer, friend):
            for info in [*bad, impostor]:
                await forger.async_register_service(info, cooperating_responders=True)
            await wait_until(
                lambda: (
                    peer.discovery.stats["dropped_malformed"] >= len(bad)
                    and peer.discovery.stats["dropped_self"] >= 2  # itself, the impostor
                ),
                DISCOVERY,
                "forged records dropped and counted",
            )
            await wait_until(lambda: peer.seen == {friend.me}, DISCOVERY, "friend still seen")
            # Without a realm key the impostor is a candidate to others: only the handshake
            # can tell it from the node whose id it claims.
            assert friend.seen == {peer.me, (peer.node_id, f"tcp://{LOOPBACK}:7")}
    finally:
        await forger.async_close()


@needs_mdns
@deadline(TEST_TIMEOUT)
async def test_candidate_callback_errors_are_counted_and_discovery_goes_on() -> None:
    config = MdnsConfig(service_type=fresh_type())
    clumsy = make_peer(config, raising=True)
    others = [make_peer(config) for _ in range(2)]
    async with started(clumsy, *others):
        await wait_until(
            lambda: clumsy.seen == {o.me for o in others}, DISCOVERY, "clumsy sees both"
        )
        assert clumsy.discovery.stats["callback_errors"] >= len(clumsy.seen)
        await wait_until(
            lambda: all(clumsy.me in o.seen for o in others), DISCOVERY, "both see clumsy"
        )
