"""Node.clusters(): what a keyring can open of the clusters that nodes announce, over real UDP
on 127.0.0.1 (each test on a group and port of its own), and what a capture of it all shows."""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable

import pytest
from helpers import run_with_deadline, wait_until
from wiretap import LOOPBACK, LoopbackCapture

import irismesh
import irismesh.sync
from irismesh.discovery.sealed import ClusterSeal
from irismesh.discovery.survey import SurveyConfig, decode, survey_config
from irismesh.errors import ProtocolError
from irismesh.security.keyring import Keyring, ScopeKey

TEST_TIMEOUT = 30.0


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    run_with_deadline(scenario(), TEST_TIMEOUT)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


class Place:
    """A survey group and port of this test's own; each node's realm from its keyring."""

    def __init__(self) -> None:
        self.group = f"239.255.{random.randint(74, 254)}.{random.randint(2, 254)}"
        self.port = free_udp_port()

    def survey(self, keyring: Keyring) -> SurveyConfig:
        config = survey_config(True, keyring)
        assert config is not None
        return dataclasses.replace(config, group=self.group, port=self.port, interface=LOOPBACK)


def listing(node: irismesh.Node) -> dict[str, set[str]]:
    return {name: {p.node_id for p in members} for name, members in node.clusters().items()}


def keyrings() -> tuple[Keyring, Keyring, Keyring]:
    """The members' (a '*' key, and db's own key), a '*' keyring, a keyring of db's key."""
    star, db = (
        ScopeKey(scope="*", secret=os.urandom(32)),
        ScopeKey(scope="db", secret=os.urandom(32)),
    )
    return Keyring([star, db]), Keyring([star]), Keyring([db])


def test_a_star_keyring_lists_echo_and_db_and_db_s_key_lists_db_alone() -> None:
    async def main() -> None:
        members, star, db_only = keyrings()
        place = Place()
        echo = irismesh.Node("echo", keyring=members, survey=place.survey(members))
        db = irismesh.Node("db", keyring=members, survey=place.survey(members))
        lister = irismesh.Node(keyring=star, survey=place.survey(star))
        outsider = irismesh.Node(keyring=db_only, survey=place.survey(db_only))
        async with echo, db, lister, outsider:
            both = {"db": {db.node_id.hex()}, "echo": {echo.node_id.hex()}}
            await wait_until(lambda: listing(lister) == both, 10, "'*' lists echo and db")
            await wait_until(
                lambda: all(p.state == "alive" for ps in lister.clusters().values() for p in ps),
                10,
                "the members as peers of the lister's mesh",
            )
            await wait_until(
                lambda: listing(outsider) == {"db": {db.node_id.hex()}}, 10, "db's key: db"
            )
            [member] = outsider.clusters()["db"]
            assert member.state == "announced"  # not a peer: db's key is not the mesh key
            assert member.endpoint == db.endpoint
            assert outsider.peers() == []
            # Members list each other, not themselves.
            await wait_until(lambda: listing(db) == {"echo": {echo.node_id.hex()}}, 10, "db")
            assert echo.served_clusters == ("echo",)
            assert echo.clusters == ("echo",)  # the attribute it always was, too
            # The survey's counters in node.stats: db heard the outsider, who is not of its mesh;
            # the outsider drops the lister's questions (no key in common) as they come.
            assert db.stats["survey_announcements"] >= 1
            await wait_until(
                lambda: outsider.stats["survey_dropped_realm"] >= 1, 10, "the lister's, dropped"
            )

    run(main)


@pytest.mark.skipif(
    LoopbackCapture.available() is not None, reason=str(LoopbackCapture.available())
)
def test_a_capture_of_the_announcements_shows_no_cluster_name() -> None:
    suffix = os.urandom(4).hex()
    echo_name, db_name = f"echo-{suffix}", f"db-{suffix}"

    async def main() -> None:
        star, db = (
            ScopeKey(scope="*", secret=os.urandom(32)),
            ScopeKey(scope=db_name, secret=os.urandom(32)),
        )
        members, star_only, db_only = Keyring([star, db]), Keyring([star]), Keyring([db])
        place = Place()
        capture = LoopbackCapture([]).start()
        try:
            echo = irismesh.Node(echo_name, keyring=members, survey=place.survey(members))
            dbm = irismesh.Node(db_name, keyring=members, survey=place.survey(members))
            lister = irismesh.Node(keyring=star_only, survey=place.survey(star_only))
            outsider = irismesh.Node(keyring=db_only, survey=place.survey(db_only))
            async with echo, dbm, lister, outsider:
                both = {db_name: {dbm.node_id.hex()}, echo_name: {echo.node_id.hex()}}
                await wait_until(lambda: listing(lister) == both, 10, "'*' lists both")
                await wait_until(
                    lambda: listing(outsider) == {db_name: {dbm.node_id.hex()}}, 10, "db alone"
                )
        finally:
            capture.stop()
        ours = []
        for data in capture.udp:
            try:
                message = decode(data)
            except ProtocolError:
                continue
            if message.node_id in {echo.node_id, dbm.node_id}:
                ours.append((data, message))
        assert ours, "no announcement captured"
        captured = b"".join(capture.udp)
        assert echo_name.encode() not in captured
        assert db_name.encode() not in captured
        assert suffix.encode() not in captured
        # Every datagram has one size, whatever its sender serves.
        assert len({len(data) for data, _ in ours}) == 1
        # The names are there, sealed: a holder of the key opens them from the capture.
        opened = set()
        for _, m in ours:
            opened |= set(
                ClusterSeal(star_only).open(m.node_id, m.endpoint, m.timestamp_ms, m.slots).names
            )
        assert opened == {echo_name, db_name}

    run(main)


def test_the_blocking_node_lists_clusters_too() -> None:
    members, star, _ = keyrings()
    place = Place()
    with (
        irismesh.sync.Node("db", keyring=members, survey=place.survey(members)) as db,
        irismesh.sync.Node(keyring=star, survey=place.survey(star)) as lister,
    ):
        deadline = time.monotonic() + 10
        while "db" not in lister.clusters():
            assert time.monotonic() < deadline, "db never listed"
            time.sleep(0.02)
        [member] = lister.clusters()["db"]
        assert member.endpoint == db._node.endpoint


def test_a_rotated_cluster_key_lists_the_cluster_for_a_holder_of_the_new_key_alone() -> None:
    """A member whose keyring changes (a rotation of db's key) seals db's name under the new
    key at once: a holder of only the new key lists db, without a restart."""

    async def main() -> None:
        members, _star, old_db = keyrings()
        new_db = Keyring([ScopeKey(scope="db", secret=os.urandom(32))])
        place = Place()
        db = irismesh.Node("db", keyring=members, survey=place.survey(members))
        newcomer = irismesh.Node(keyring=new_db, survey=place.survey(new_db))
        async with db, newcomer:
            star = members.accepted("*")[0]
            db.use_keyring(Keyring([star, new_db.accepted("db")[0], old_db.accepted("db")[0]]))
            await wait_until(
                lambda: listing(newcomer) == {"db": {db.node_id.hex()}}, 10, "the new key: db"
            )

    run(main)
