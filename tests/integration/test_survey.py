"""SurveyDiscovery over real UDP multicast, pinned to 127.0.0.1.

Every test picks its own group and a free port, so parallel runs do not hear each other, and
waits on conditions with deadlines rather than sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import itertools
import os
import random
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from helpers import (
    Discovering,
    all_started,
    candidate_recorder,
    deadline,
    realms_kept_apart,
    run_with_deadline,
    wait_until,
)
from wiretap import group_listener, multicast_sender

from irismesh.discovery.sealed import SLOT_LEN, SLOTS
from irismesh.discovery.survey import (
    SurveyConfig,
    SurveyDiscovery,
    SurveyKind,
    decode,
    encode_answer,
    encode_question,
    survey_config,
)
from irismesh.errors import Closed, ConfigurationError
from irismesh.security.keyring import Keyring, ScopeKey

LOOPBACK = "127.0.0.1"
TEST_TIMEOUT = 20.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def fresh_config(**overrides: Any) -> SurveyConfig:
    group = f"239.255.73.{random.randint(2, 254)}"
    return SurveyConfig(group=group, port=free_port(), interface=LOOPBACK, **overrides)


@pytest.fixture(scope="module", autouse=True)
def multicast_on_loopback() -> None:
    """Probe once: without multicast on lo these tests cannot say anything, so skip them."""
    config = fresh_config()
    try:
        with group_listener(config) as listener, multicast_sender() as sender:
            sender.sendto(b"probe", (config.group, config.port))
            readable, _, _ = select.select([listener], [], [], 2.0)
            if not readable or listener.recv(64) != b"probe":
                pytest.skip("multicast on 127.0.0.1 delivers nothing in this environment")
    except OSError as exc:
        pytest.skip(f"multicast on 127.0.0.1 is not usable here: {exc}")


@dataclass
class Node(Discovering):
    survey: SurveyDiscovery


def new_survey(
    config: SurveyConfig, on_candidate: Callable[[bytes, str], None], **options: Any
) -> tuple[bytes, str, SurveyDiscovery]:
    """A survey for a node of a fresh id on a random loopback endpoint: (id, endpoint, survey).
    `options` go to SurveyDiscovery (a keyring, clusters, membership's stand-ins)."""
    node_id = os.urandom(16)
    endpoint = f"tcp://{LOOPBACK}:{random.randint(20000, 60000)}"
    survey = SurveyDiscovery(
        node_id=node_id,
        endpoint=endpoint,
        config=config,
        on_candidate=on_candidate,
        rng=random.Random(node_id),
        **options,
    )
    return node_id, endpoint, survey


def make_node(config: SurveyConfig, *, raising: bool = False) -> Node:
    seen, on_candidate = candidate_recorder(raising=raising)
    node_id, endpoint, survey = new_survey(config, on_candidate)
    return Node(node_id=node_id, endpoint=endpoint, survey=survey, seen=seen)


def started(*nodes: Node) -> contextlib.AbstractAsyncContextManager[None]:
    return all_started(node.survey for node in nodes)


@deadline(TEST_TIMEOUT)
async def test_three_nodes_discover_each_other() -> None:
    config = fresh_config()
    nodes = [make_node(config) for _ in range(3)]
    async with started(*nodes):
        expected = [{n.me for n in nodes if n is not node} for node in nodes]
        await wait_until(
            lambda: all(n.seen >= e for n, e in zip(nodes, expected, strict=True)),
            3.0,
            "each node sees the two others",
        )
        for node, others in zip(nodes, expected, strict=True):
            assert node.seen == others, "a node reported itself or a stranger"
            assert node.survey.stats["dropped_self"] >= 1


@deadline(TEST_TIMEOUT)
async def test_a_lone_node_ignores_itself() -> None:
    node = make_node(fresh_config(fast_interval=0.02))
    async with started(node):
        await wait_until(lambda: node.survey.stats["dropped_self"] >= 3, 3.0, "own questions heard")
        stats = node.survey.stats
        assert node.seen == set()
        assert stats["candidates"] == 0
        assert stats["answers_sent"] == 0


@deadline(TEST_TIMEOUT)
async def test_a_node_in_another_realm_is_not_discovered() -> None:
    config = fresh_config(realm=b"blue")
    blue_a, blue_b = make_node(config), make_node(config)
    green = make_node(
        SurveyConfig(group=config.group, port=config.port, interface=LOOPBACK, realm=b"green")
    )
    async with started(blue_a, blue_b, green):
        # Silence is not luck once each side has heard the other realm's questions.
        await realms_kept_apart(
            blue_a, blue_b, green, lambda n: n.survey.stats["dropped_realm"], (2, 1), 3.0
        )
        assert green.survey.stats["answers_sent"] == 0


@deadline(TEST_TIMEOUT)
async def test_malformed_datagrams_are_counted_and_discovery_goes_on() -> None:
    # Slow polling, so that every question after the first is one this test asked for.
    config = fresh_config(fast_period=0.0, slow_interval=60.0)
    a, b = make_node(config), make_node(config)
    valid = encode_question(node_id=os.urandom(16), endpoint="tcp://127.0.0.1:1")
    garbage = [b"", b"hello", b"IMSV\x09" + valid[5:], valid[:-2], valid + b"x" * 1100]
    async with started(a, b):
        await wait_until(lambda: a.seen == {b.me}, 3.0, "a sees b")
        with multicast_sender() as sender:
            for datagram in garbage:
                sender.sendto(datagram, (config.group, config.port))
            sender.sendto(b"\x00" * 7, a.survey.local_addresses[1])
        n = len(garbage)
        await wait_until(
            lambda: (
                a.survey.stats["dropped_malformed"] >= n + 1
                and b.survey.stats["dropped_malformed"] >= n
            ),
            3.0,
            "every malformed datagram counted",
        )
        a.seen.clear()
        b.seen.clear()
        a.survey.poll_now()
        await wait_until(
            lambda: a.seen == {b.me} and b.seen == {a.me}, 3.0, "rediscovery after garbage"
        )


@deadline(TEST_TIMEOUT)
async def test_questions_to_the_unicast_socket_are_not_answered() -> None:
    config = fresh_config(fast_period=0.0, slow_interval=60.0)
    node = make_node(config)
    stranger = (os.urandom(16), "tcp://127.0.0.1:2")
    async with started(node):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((LOOPBACK, 0))
            sock.setblocking(False)
            sock.sendto(
                encode_question(node_id=stranger[0], endpoint=stranger[1]),
                node.survey.local_addresses[1],
            )
            sock.sendto(
                encode_answer(node_id=stranger[0], endpoint=stranger[1]),
                (config.group, config.port),
            )
            await wait_until(
                lambda: node.survey.stats["dropped_malformed"] >= 2, 3.0, "both dropped"
            )
            with pytest.raises(BlockingIOError):
                sock.recv(2048)
        assert node.survey.stats["answers_sent"] == 0
        assert node.seen == set()


@deadline(TEST_TIMEOUT)
async def test_a_node_multicast_cannot_reach_is_found_by_a_unicast_question() -> None:
    config = fresh_config()
    # Another group on the same port, from another loopback address: its multicast
    # questions never reach the first node, and its own question socket (on 127.0.0.2) is
    # not where its unicast questions to 127.0.0.1 land. The group lies outside the range
    # fresh_config draws from, so the two never share one by chance.
    elsewhere = SurveyConfig(
        group="239.255.72.99",
        port=config.port,
        interface="127.0.0.2",
        unicast_targets=(LOOPBACK,),
    )
    there, asker = make_node(config), make_node(elsewhere)
    async with started(there, asker):
        await wait_until(lambda: there.me in asker.seen, 3.0, "the answer to a unicast question")
        assert asker.survey.stats["unicast_questions_sent"] >= 1
        assert there.survey.stats["answers_sent"] >= 1
        assert asker.me in there.seen  # the question announced the asker too


@deadline(TEST_TIMEOUT)
async def test_candidate_callback_errors_are_counted_and_discovery_goes_on() -> None:
    config = fresh_config(fast_interval=0.02)
    clumsy, b = make_node(config, raising=True), make_node(config)
    async with started(clumsy, b):
        await wait_until(
            lambda: clumsy.survey.stats["callback_errors"] >= 3, 3.0, "repeated errors"
        )
        await wait_until(lambda: b.seen == {clumsy.me}, 3.0, "b sees the clumsy node")
        assert clumsy.seen == {b.me}


@deadline(TEST_TIMEOUT)
async def test_poll_now_asks_at_once() -> None:
    node = make_node(fresh_config(fast_period=0.0, slow_interval=60.0))
    async with started(node):
        await wait_until(lambda: node.survey.stats["questions_sent"] == 1, 1.0, "first ask")
        node.survey.poll_now()
        await wait_until(
            lambda: node.survey.stats["questions_sent"] == 2, 1.0, "ask after poll_now"
        )


def test_the_schedule_is_fast_while_new_then_doubles_up_to_slow() -> None:
    # Binary fractions, so that the sums below are exact.
    config = fresh_config(fast_interval=0.125, fast_period=1.0, slow_interval=2.0, jitter=0.1)
    asked, interval, waits = 0.0, config.fast_interval, []
    while asked < 8.0:
        interval = config.next_interval(asked, interval)
        waits.append(interval)
        asked += interval
    assert waits[:8] == [0.125] * 8  # 1 s of asking every 0.125 s
    assert waits[8:12] == [0.25, 0.5, 1.0, 2.0]  # then doubling
    assert set(waits[12:]) == {2.0}  # capped at slow_interval
    # News (a node it had not heard of) brings the fast pace back at once.
    assert config.next_interval(0.5, 2.0) == 0.125


def test_questions_come_fast_then_slow() -> None:
    """The live node follows that schedule; a loaded machine only delays questions, so the
    assertions are on what delays cannot fake: fast questions first, long gaps at the end."""

    async def scenario() -> None:
        config = fresh_config(fast_interval=0.05, fast_period=0.4, slow_interval=0.8, jitter=0.1)
        node = make_node(config)
        arrivals: list[float] = []
        loop = asyncio.get_running_loop()
        with group_listener(config) as listener:
            listener.setblocking(False)

            def on_readable() -> None:
                listener.recv(2048)
                arrivals.append(loop.time())

            loop.add_reader(listener, on_readable)
            try:
                async with started(node):
                    await wait_until(lambda: len(arrivals) >= 13, 8.0, "thirteen questions")
            finally:
                loop.remove_reader(listener)
        gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
        # At most 9 questions can fall in the first 0.4 s (8 waits of at least 0.045 s)...
        assert sum(1 for t in arrivals if t - arrivals[0] < 0.4) <= 9, gaps
        # ...and the pace slows: the 12 gaps span at least 0.4 s of fast asking plus waits of
        # 0.1, 0.2, 0.4 and 0.8 (each less 10% jitter), and the last is a slow one.
        assert sum(gaps) >= 0.9 * (0.4 + 0.1 + 0.2 + 0.4 + 0.8) - 0.05, gaps
        assert max(gaps[-2:]) >= 0.6, gaps
        assert min(gaps[:3]) < 0.3, gaps  # the first questions were not slow ones


@deadline(TEST_TIMEOUT)
async def test_a_newcomer_makes_a_stable_node_ask_fast_again() -> None:
    config = fresh_config(fast_interval=0.05, fast_period=0.3, slow_interval=1.0, jitter=0.1)
    old, new = make_node(config), make_node(config)
    arrivals: list[float] = []
    loop = asyncio.get_running_loop()
    with group_listener(config) as listener:
        listener.setblocking(False)

        def on_readable() -> None:
            if decode(listener.recv(2048)).node_id == old.node_id:
                arrivals.append(loop.time())

        loop.add_reader(listener, on_readable)
        try:
            async with started(old):
                # Stable: backed off to intervals of at least 0.4 s.
                await wait_until(
                    lambda: len(arrivals) > 2 and arrivals[-1] - arrivals[-2] >= 0.4,
                    5.0,
                    "the old node to back off",
                )
                async with started(new):
                    await wait_until(lambda: old.me in new.seen, 3.0, "the newcomer heard")
                    joined = loop.time()
                    await wait_until(
                        lambda: sum(1 for t in arrivals if t > joined) >= 4,
                        3.0,
                        "fast questions again",
                    )
        finally:
            loop.remove_reader(listener)
    after = [t for t in arrivals if t > joined][:4]
    gaps = [later - earlier for earlier, later in itertools.pairwise(after)]
    assert all(gap < 0.1 for gap in gaps), gaps


@deadline(TEST_TIMEOUT)
async def test_close_is_idempotent_and_releases_the_port() -> None:
    def exclusive_bind(config: SurveyConfig) -> None:
        # No SO_REUSEADDR/SO_REUSEPORT: succeeds only if no socket holds (group, port).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((config.group, config.port))

    config = fresh_config()
    first = make_node(config)
    await first.survey.start()
    with pytest.raises(OSError, match="in use") as info:
        exclusive_bind(config)
    assert info.value.errno == errno.EADDRINUSE
    await first.survey.close()
    await first.survey.close()
    assert first.survey.local_addresses == ()
    exclusive_bind(config)
    with pytest.raises(Closed):
        await first.survey.start()
    a, b = make_node(config), make_node(config)
    async with started(a, b):
        await wait_until(
            lambda: a.seen == {b.me} and b.seen == {a.me}, 3.0, "new nodes on the same port"
        )


@deadline(TEST_TIMEOUT)
async def test_start_fails_clearly_when_the_port_is_held_exclusively() -> None:
    config = fresh_config()
    node = make_node(config)
    before = socket_inodes()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
        holder.bind((config.group, config.port))
        with pytest.raises(ConfigurationError, match=f"{config.group}:{config.port}"):
            await node.survey.start()
    await node.survey.close()
    assert socket_inodes() == before, "a failed start leaked a socket"


def socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def udp_sockets() -> dict[str, tuple[str, int]]:
    """inode -> local (address, port) of every IPv4 UDP socket, from /proc/net/udp."""
    table = {}
    with open("/proc/net/udp") as lines:
        next(lines)
        for line in lines:
            fields = line.split()
            address, port = fields[1].split(":")
            ip = socket.inet_ntoa(struct.pack("=I", int(address, 16)))
            table[fields[9]] = (ip, int(port, 16))
    return table


def igmp_devices(group: str) -> set[str]:
    """Devices on which this host is a member of `group`, from /proc/net/igmp."""
    wanted = struct.unpack("=I", socket.inet_aton(group))[0]
    devices, device = set(), ""
    with open("/proc/net/igmp") as lines:
        next(lines)
        for line in lines:
            if line[:1].isdigit():
                device = line.split()[1]
            elif int(line.split()[0], 16) == wanted:
                devices.add(device)
    return devices


def test_every_socket_is_on_loopback_or_the_group() -> None:
    if not os.path.exists("/proc/net/igmp"):
        pytest.skip("needs Linux /proc to see which sockets the engine opened")

    async def scenario() -> None:
        config = fresh_config()
        node = make_node(config)
        before = socket_inodes()
        async with started(node):
            opened = socket_inodes() - before
            udp = udp_sockets()
            assert len(opened) == 3
            assert opened <= udp.keys(), "the engine opened a socket that is not IPv4 UDP"
            bound = sorted(udp[inode] for inode in opened)
            assert sorted(node.survey.local_addresses) == bound
            for host, _port in bound:
                assert host in (LOOPBACK, config.group)
            assert (config.group, config.port) in bound
            assert (LOOPBACK, config.port) in bound  # unicast questions, on loopback too
            assert igmp_devices(config.group) == {"lo"}
            # The send options are not API, so reach into the engine for them.
            transport = node.survey._unicast_transport
            assert transport is not None
            sender = transport.get_extra_info("socket")
            ip = socket.IPPROTO_IP
            pinned = sender.getsockopt(ip, socket.IP_MULTICAST_IF, 4)
            assert socket.inet_ntoa(pinned) == LOOPBACK
            assert sender.getsockopt(ip, socket.IP_MULTICAST_TTL) == 1
            assert sender.getsockopt(ip, socket.IP_MULTICAST_LOOP) == 1
        assert socket_inodes() == before

    run_with_deadline(scenario(), TEST_TIMEOUT)


@pytest.mark.parametrize(
    "overrides",
    [
        {"group": "10.1.2.3"},
        {"group": "not-an-address"},
        {"interface": "0.0.0.0"},
        {"interface": "255.255.255.255"},
        {"interface": "239.255.73.1"},
        {"port": 0},
        {"fast_interval": 0.0},
        {"jitter": 1.0},
        {"mesh_interval": 0.0},
        {"merge_after": 0.0},
        {"answer_spread": -0.1},
        {"realm": b"r" * 33},
    ],
)
def test_unsafe_or_nonsense_config_is_refused(overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        SurveyConfig(**overrides)


def test_bad_own_identity_is_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError):
        SurveyDiscovery(
            node_id=b"short",
            endpoint="tcp://127.0.0.1:1",
            config=SurveyConfig(),
            on_candidate=lambda _id, _endpoint: None,
        )


# ------------------------------------------- sealed cluster names, replays

STAR, DB, OTHER = (ScopeKey(scope=s, secret=os.urandom(32)) for s in ("*", "db", "*"))


def make_keyed(
    config: SurveyConfig, keyring: Keyring | None = None, clusters: Sequence[str] = ()
) -> Node:
    seen, on_candidate = candidate_recorder()
    if keyring is not None:  # the realm a node with this keyring would have
        realm = survey_config(True, keyring)
        assert realm is not None
        config = dataclasses.replace(
            config, realm=realm.realm, accepted_realms=realm.accepted_realms
        )
    node_id, endpoint, survey = new_survey(config, on_candidate, keyring=keyring, clusters=clusters)
    return Node(node_id=node_id, endpoint=endpoint, survey=survey, seen=seen)


def heard(node: Node) -> dict[str, set[bytes]]:
    return {name: set(ids) for name, ids in node.survey.clusters_heard().items()}


@deadline(TEST_TIMEOUT)
async def test_a_star_keyring_lists_every_cluster_and_a_cluster_key_its_cluster_alone() -> None:
    config = fresh_config()
    member_keys = Keyring([STAR, DB])  # db has a key of its own; echo uses '*'
    db = make_keyed(config, member_keys, ["db"])
    echo = make_keyed(config, member_keys, ["echo"])
    star_lister = make_keyed(config, Keyring([STAR]))
    db_lister = make_keyed(config, Keyring([DB]))  # another realm: no '*' key
    stranger = make_keyed(config, Keyring([OTHER]))
    async with started(db, echo, star_lister, db_lister, stranger):
        want_all = {"db": {db.node_id}, "echo": {echo.node_id}}
        await wait_until(lambda: heard(star_lister) == want_all, 5.0, "'*' lists both")
        await wait_until(lambda: heard(db_lister) == {"db": {db.node_id}}, 5.0, "db's key lists db")
        await wait_until(lambda: heard(db) == {"echo": {echo.node_id}}, 5.0, "db sees echo")
        # The holder of db's key only is not of this mesh: answered, never a candidate.
        assert db_lister.seen == set()
        assert db_lister.me not in db.seen | echo.seen
        assert db.survey.stats["heard_outside_realm"] >= 1
        assert heard(stranger) == {}
        assert stranger.seen == set()
        assert star_lister.seen == {db.me, echo.me}
        # echo holds db's key too: it answers db_lister, whose key opens none of its names.
        await wait_until(lambda: echo.survey.stats["heard_outside_realm"] >= 3, 5.0, "echo answers")
        await wait_until(lambda: db_lister.survey.stats["received"] >= 6, 5.0, "answers in")
        assert heard(db_lister) == {"db": {db.node_id}}


@deadline(TEST_TIMEOUT)
async def test_a_node_with_more_slots_than_a_datagram_holds_sends_them_in_turn() -> None:
    config = fresh_config(fast_interval=0.02)
    keys = [ScopeKey(scope=f"c{i}", secret=os.urandom(32)) for i in range(6)]
    names = [key.scope for key in keys]
    busy = make_keyed(config, Keyring([STAR, *keys]), names)  # 7 slots: '*' and one per key
    star = make_keyed(config, Keyring([STAR]))
    last = make_keyed(config, Keyring([keys[-1]]))
    async with started(busy, star, last):
        everyone = {name: {busy.node_id} for name in names}
        await wait_until(lambda: heard(star) == everyone, 5.0, "'*' lists all six")
        await wait_until(lambda: heard(last) == {"c5": {busy.node_id}}, 5.0, "c5 in turn")


def recorded_question(listener: socket.socket, of: Node) -> bytes:
    """A question of `of` as it crossed the group."""
    while True:
        readable, _, _ = select.select([listener], [], [], 3.0)
        assert readable, "no question heard"
        data = listener.recv(2048)
        if decode(data).node_id == of.node_id:
            return data


@deadline(TEST_TIMEOUT)
async def test_a_recorded_datagram_sent_again_is_dropped_and_counted() -> None:
    # Slow polling, so that every answer after the first ones is to a datagram sent here.
    config = fresh_config(fast_period=0.0, slow_interval=60.0)
    keys = Keyring([STAR])
    a, b = make_keyed(config, keys, ["db"]), make_keyed(config, keys)
    loop = asyncio.get_running_loop()
    with group_listener(config) as listener:
        async with started(b, a):
            question = await loop.run_in_executor(None, recorded_question, listener, a)
            await wait_until(lambda: b.seen == {a.me}, 3.0, "b hears a's question")
            await wait_until(lambda: a.seen == {b.me}, 3.0, "a hears b's answer")
            answered = b.survey.stats["answers_sent"]
            with multicast_sender() as sender:
                for _ in range(3):
                    sender.sendto(question, (config.group, config.port))
            await wait_until(
                lambda: b.survey.stats["dropped_replay"] >= 3, 3.0, "three replays dropped"
            )
            assert b.survey.stats["answers_sent"] == answered, "a replay was answered"


@deadline(TEST_TIMEOUT)
async def test_stale_and_old_datagrams_are_dropped_and_counted() -> None:
    config = fresh_config(fast_period=0.0, slow_interval=60.0, freshness=5.0)
    node = make_keyed(config, Keyring([STAR]))
    realm = survey_config(True, Keyring([STAR]))
    assert realm is not None
    stranger = os.urandom(16)
    wall_ms = int(time.time() * 1000)
    stale = encode_question(
        node_id=stranger,
        endpoint="tcp://127.0.0.1:1",
        realm=realm.realm,
        timestamp_ms=wall_ms - 6000,
    )
    future = encode_question(
        node_id=stranger,
        endpoint="tcp://127.0.0.1:1",
        realm=realm.realm,
        timestamp_ms=wall_ms + 6000,
    )
    packed: bytes = msgpack.packb([stranger, "tcp://127.0.0.1:1", b""], use_bin_type=True)
    old = b"IMSV\x01" + bytes([SurveyKind.QUESTION]) + packed
    async with started(node):
        with multicast_sender() as sender:
            for data in (stale, future, old):
                sender.sendto(data, (config.group, config.port))
        await wait_until(
            lambda: (
                node.survey.stats["dropped_stale"] >= 2
                and node.survey.stats["dropped_old_version"] >= 1
            ),
            3.0,
            "stale and old datagrams counted",
        )
        assert node.survey.stats["answers_sent"] == 0
        assert node.seen == set()


@deadline(TEST_TIMEOUT)
async def test_a_forged_slot_or_tag_is_neither_a_candidate_nor_a_name() -> None:
    config = fresh_config(fast_period=0.0, slow_interval=60.0)
    node = make_keyed(config, Keyring([STAR]))
    forged = encode_question(
        node_id=os.urandom(16),
        endpoint="tcp://127.0.0.1:1",
        realm=os.urandom(16),
        slots=[os.urandom(SLOT_LEN)] * SLOTS,
    )
    async with started(node):
        with multicast_sender() as sender:
            sender.sendto(forged, (config.group, config.port))
            await wait_until(
                lambda: node.survey.stats["dropped_realm"] >= 1, 3.0, "forgery dropped"
            )
        assert node.survey.stats["answers_sent"] == 0
        assert node.survey.clusters_heard() == {}


# ------------------------------------------- once joined: with membership's answers
# Stand-ins for membership (`live_peers`, `alive`) that each test sets as it needs.


@dataclass
class Member:
    """A survey whose node's membership is a set of (node id, endpoint) this test controls."""

    node_id: bytes
    endpoint: str
    survey: SurveyDiscovery
    mesh: set[tuple[bytes, str]] = field(default_factory=set)
    passed: list[tuple[bytes, str]] = field(default_factory=list)

    @property
    def me(self) -> tuple[bytes, str]:
        return (self.node_id, self.endpoint)

    def stat(self, name: str) -> int:
        return self.survey.stats[name]


def make_member(config: SurveyConfig, keyring: Keyring | None = None) -> Member:
    mesh: set[tuple[bytes, str]] = set()
    passed: list[tuple[bytes, str]] = []
    node_id, endpoint, survey = new_survey(
        config,
        lambda i, e: passed.append((i, e)),
        live_peers=lambda: len(mesh),
        alive=lambda i, e: (i, e) in mesh,
        keyring=keyring,
    )
    return Member(node_id=node_id, endpoint=endpoint, survey=survey, mesh=mesh, passed=passed)


def joined(*members: Member) -> None:
    """Each of `members` holds the others alive: one mesh."""
    for member in members:
        member.mesh.update(m.me for m in members if m is not member)


class Questions:
    """The questions each node sends to the group, as a listener of the group hears them."""

    def __init__(self, config: SurveyConfig) -> None:
        self._listener = group_listener(config)
        self._listener.setblocking(False)
        self.times: dict[bytes, list[float]] = {}

    def __enter__(self) -> Questions:
        loop = asyncio.get_running_loop()

        def on_readable() -> None:
            message = decode(self._listener.recv(2048))
            self.times.setdefault(message.node_id, []).append(loop.time())

        loop.add_reader(self._listener, on_readable)
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.get_running_loop().remove_reader(self._listener)
        self._listener.close()

    def of(self, member: Member) -> list[float]:
        return self.times.get(member.node_id, [])


def quiet_config(**overrides: Any) -> SurveyConfig:
    """Fast timings, so that the schedules below fit in a few seconds."""
    timings: dict[str, Any] = {
        "fast_interval": 0.05,
        "fast_period": 0.5,
        "slow_interval": 0.5,
        "mesh_interval": 0.25,
        "merge_after": 0.2,
        "jitter": 0.1,
    }
    return fresh_config(**{**timings, **overrides})


@deadline(TEST_TIMEOUT)
async def test_a_joined_node_asks_once_per_mesh_interval_times_the_mesh() -> None:
    config = quiet_config()
    member, alone = make_member(config), make_member(config)
    # A mesh of 8 as member's membership has it: it asks every 8 x 0.25 = 2 s.
    member.mesh.update((os.urandom(16), f"tcp://{LOOPBACK}:{port}") for port in range(7))
    assert config.joined_interval(7) == 2.0
    loop = asyncio.get_running_loop()
    with Questions(config) as questions:
        async with started(member, alone):
            began = loop.time()
            await wait_until(lambda: len(questions.of(alone)) >= 12, 3.0, "a lone node asks")
            # The lone node asked fast; meanwhile the joined one asked once, at its start.
            assert len(questions.of(member)) == 1
            assert loop.time() - began < 0.9 * 2.0
            # Left alone again, it asks at once (within a slow interval) and fast.
            member.mesh.clear()
            await wait_until(lambda: len(questions.of(member)) >= 4, 2.0, "fast again")


@deadline(TEST_TIMEOUT)
async def test_a_question_from_a_node_of_the_mesh_is_not_answered() -> None:
    config = quiet_config(fast_period=5.0)  # every node asks every 50 ms throughout
    a, b = make_member(config), make_member(config)
    stranger = make_node(config)  # no membership: answers all, passes all on
    joined(a, b)
    async with started(a, b, stranger):
        await wait_until(
            lambda: a.stat("answers_withheld") >= 3 and b.stat("answers_withheld") >= 3,
            3.0,
            "questions of the mesh heard and not answered",
        )
        # A node neither knows is answered, by both (it is not of their mesh).
        await wait_until(lambda: {a.me, b.me} <= stranger.seen, 3.0, "the stranger answered")
        answered = a.stat("answers_sent") + b.stat("answers_sent")
        stranger_asked = stranger.survey.stats["questions_sent"]
        assert 0 < answered <= 2 * stranger_asked
        # Nor is a member of the mesh ever a candidate of the other.
        assert a.me not in b.passed
        assert b.me not in a.passed


@deadline(TEST_TIMEOUT)
async def test_a_newcomer_the_mesh_learns_is_dialled_by_none_of_its_members() -> None:
    # A newcomer alone passes on at most one node per fast interval; a member reviews what
    # it heard after merge_after: both long enough that this test sees the policy, not a
    # race with its own bookkeeping.
    config = quiet_config(fast_interval=0.5, fast_period=5.0, merge_after=0.6)
    members = [make_member(config) for _ in range(3)]
    joined(*members)
    newcomer = make_member(config)
    async with started(*members):
        await wait_until(lambda: all(m.stat("questions_sent") for m in members), 2.0, "asked")
        async with started(newcomer):
            # Alone: it passes on the first member that answers, at once.
            await wait_until(lambda: newcomer.passed, 1.0, "the newcomer to pass one on")
            assert newcomer.passed[0] in {m.me for m in members}
            # It joins through that member: membership brings it the rest, before any
            # review would pass them on.
            joined(*members, newcomer)
            await wait_until(
                lambda: all(m.stat("answers_withheld") for m in members), 3.0, "known now"
            )
            await asyncio.sleep(1.5 * config.merge_after)
        assert len(newcomer.passed) == 1, newcomer.passed
        for member in members:  # the members heard it ask, and left the dialling to it
            assert member.passed == []
            assert member.stat("candidates") >= 1


@deadline(TEST_TIMEOUT)
async def test_nodes_alone_together_pass_on_one_candidate_at_a_time() -> None:
    config = quiet_config(fast_interval=0.5, fast_period=5.0, merge_after=5.0)
    nodes = [make_member(config) for _ in range(6)]
    async with started(*nodes):
        await wait_until(
            lambda: all(n.stat("candidates") >= 5 for n in nodes), 3.0, "everyone heard"
        )
        # Each heard five others, and passed on the first it heard alone: one a node, not
        # all five (nodes that start together must not all dial all).
        assert all(len(n.passed) <= 2 for n in nodes), [len(n.passed) for n in nodes]
        assert all(n.passed for n in nodes)


@deadline(TEST_TIMEOUT)
async def test_two_meshes_on_one_network_find_each_other_through_the_background_poll() -> None:
    """Two meshes formed apart (each node's membership holds its own mesh alone): every
    question of one is answered by the other, whose nodes are then passed on to be dialled,
    again at every background question, within the joined schedule's bound."""
    config = quiet_config(slow_interval=1.0, mesh_interval=0.25)
    blue = [make_member(config) for _ in range(2)]
    green = [make_member(config) for _ in range(2)]
    joined(*blue)
    joined(*green)
    greens = {g.me for g in green}

    def blue_found_green() -> bool:
        return any(greens & set(b.passed) for b in blue)

    async with started(*blue, *green):
        await wait_until(blue_found_green, 3.0, "blue to pass a green node on")
        for b in blue:
            b.passed.clear()
        # The next background question (each asks every 1 s, jittered by 10%), then a
        # review of the answers (0.2 s, jittered): a bound with room for a loaded machine.
        bound = 1.1 * config.joined_interval(1) + 1.1 * config.merge_after + 1.0
        await wait_until(blue_found_green, bound, "blue to find green again")
        assert all(not (set(g.passed) & {b.me for b in green}) for g in green)


@deadline(TEST_TIMEOUT)
async def test_what_a_member_announced_is_listed_while_membership_holds_it_alive() -> None:
    keys = Keyring([STAR])
    db = make_keyed(quiet_config(), keys, ["db"])
    lister = make_member(db.survey.config, keyring=keys)
    async with started(db, lister):
        await wait_until(lambda: "db" in lister.survey.clusters_heard(), 3.0, "db heard")
    # Long after db was last heard, it is listed while membership holds it alive...
    lister.mesh.add(db.me)
    assert set(lister.survey.clusters_heard(max_age=0.0)["db"]) == {db.node_id}
    # ...and not once membership does not.
    lister.mesh.clear()
    assert lister.survey.clusters_heard(max_age=0.0) == {}
