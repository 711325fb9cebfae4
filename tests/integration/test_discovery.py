"""Nodes that find each other with no seeds: multicast survey on 127.0.0.1, then peer exchange."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import socket

import pytest
from helpers import wait_until

import irismesh
import irismesh.sync
from irismesh._core.records import MembershipConfig


def survey_config() -> irismesh.SurveyConfig:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    group = f"239.255.74.{random.randint(2, 254)}"
    return irismesh.SurveyConfig(group=group, port=port, interface="127.0.0.1")


def test_nodes_find_each_other_by_survey_alone(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        config = survey_config()
        members = [await irismesh.Node("db", keyring=keys, survey=config).start() for _ in range(3)]
        for i, member in enumerate(members):
            member.on_request(lambda payload, i=i: b"%d" % i)
        client = await irismesh.Node(keyring=keys, survey=config).start()
        try:
            taken = await wait_until(
                lambda: len(client.members("db")) == 3, 3.0, "the client to find 3 members"
            )
            print(f"client found 3 members by survey in {taken * 1000:.0f} ms")
            await wait_until(lambda: all(len(m.peers()) == 3 for m in members), 3.0, "a full mesh")
            replies = {await client.request("db", b"x") for _ in range(60)}
            assert replies == {b"0", b"1", b"2"}
        finally:
            await asyncio.gather(*(n.close() for n in [client, *members]))

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_mesh_found_by_survey_goes_quiet_and_a_late_node_joins_it_at_once(
    keys: irismesh.Keyring,
) -> None:
    """Once joined, members ask in the background only and answer no member's question; a
    node that starts later is answered (nobody knows it yet) and joins through one of them."""

    async def main() -> None:
        # The background poll every 0.5 s rather than 5 s, so that this test sees a few.
        config = dataclasses.replace(survey_config(), slow_interval=0.5, mesh_interval=0.1)
        nodes = [await irismesh.Node("db", keyring=keys, survey=config).start() for _ in range(3)]
        late: irismesh.Node | None = None
        try:
            await wait_until(lambda: all(len(n.peers()) == 2 for n in nodes), 5.0, "a mesh of 3")

            async def more_withheld(what: str) -> None:
                withheld = [n.stats["survey_answers_withheld"] for n in nodes]
                await wait_until(
                    lambda: all(
                        n.stats["survey_answers_withheld"] >= w + 2
                        for n, w in zip(nodes, withheld, strict=True)
                    ),
                    5.0,
                    what,
                )

            # Answers to questions asked before the mesh formed may still go out (each after
            # up to answer_spread): a whole round of questions with no answer is what counts.
            for _ in range(3):
                answered = [n.stats["survey_answers_sent"] for n in nodes]
                await more_withheld("each member to hear two more questions of the others")
                if [n.stats["survey_answers_sent"] for n in nodes] == answered:
                    break
            else:
                pytest.fail("members kept answering each other's questions")
            late = await irismesh.Node(keyring=keys, survey=config).start()
            taken = await wait_until(
                lambda: len(late.peers()) == 3 and all(len(n.peers()) == 3 for n in nodes),
                5.0,
                "the late node and the mesh to know each other",
            )
            print(f"a late node joined a quiet mesh of 3 in {taken * 1000:.0f} ms")
            await wait_until(
                lambda: sum(n.stats["survey_answers_sent"] for n in nodes) > sum(answered),
                3.0,
                "the members to answer the late node's question",
            )
            # It dialled one of those that answered, not each: membership brought the rest.
            assert late.stats["survey_candidates_passed"] <= 2, dict(late.stats)
        finally:
            await asyncio.gather(*(n.close() for n in [*nodes, *([late] if late else [])]))

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_node_that_knows_one_peer_soon_knows_the_mesh(keys: irismesh.Keyring) -> None:
    """Seeds form a chain; peer exchange turns it into a full mesh."""

    async def main() -> None:
        nodes = [await irismesh.Node("db", keyring=keys).start()]
        for _ in range(4):
            nodes.append(
                await irismesh.Node("db", keyring=keys, seeds=[nodes[-1].endpoint]).start()
            )
        try:
            # Usually about a second: joins spread piggybacked on probes. That gossip is best
            # effort (each update is retransmitted a bounded number of times); what it misses,
            # the next whole-table exchange repairs, which comes within 1.5 push-pull intervals
            # (jittered). So the deadline is that bound, plus room for a loaded machine: a full
            # run has seen a missed update outlast a 10 s deadline.
            bound = 1.5 * MembershipConfig().push_pull_interval + 5.0
            taken = await wait_until(
                lambda: all(len(n.peers()) == 4 for n in nodes), bound, "every node to know 4 peers"
            )
            print(f"a chain of 5 seeds became a full mesh in {taken * 1000:.0f} ms")
        finally:
            await asyncio.gather(*(n.close() for n in nodes))

    asyncio.run(asyncio.wait_for(main(), 60))


def test_nodes_find_each_other_by_mdns_alone(keys: irismesh.Keyring) -> None:
    """No seeds, no survey: mDNS records tagged with the mesh key on 127.0.0.1."""

    async def main() -> None:
        # A service type of this test's own, so parallel runs and other meshes stay apart.
        config = irismesh.MdnsConfig(
            service_type=f"_im{random.randint(0, 99999):05d}._tcp.local.",
            realm_key=keys.accepted("*")[0].secret,
        )
        member = await irismesh.Node("db", keyring=keys, mdns=config).start()
        member.on_request(lambda payload: b"found")
        client = await irismesh.Node(keyring=keys, mdns=config).start()
        try:
            taken = await wait_until(
                lambda: len(client.members("db")) == 1, 5.0, "the client to find the member"
            )
            print(f"client found the member by mDNS in {taken * 1000:.0f} ms")
            assert await client.request("db", b"x") == b"found"
        finally:
            await asyncio.gather(client.close(), member.close())

    asyncio.run(asyncio.wait_for(main(), 30))


def test_survey_realm_comes_from_the_mesh_key(keys: irismesh.Keyring) -> None:
    """survey=True tags questions with the mesh key: a node of another mesh is not a candidate."""
    from irismesh.discovery.survey import survey_config as _survey_config

    ours = _survey_config(True, keys)
    theirs = _survey_config(True, irismesh.Keyring.generate())
    assert ours is not None
    assert theirs is not None
    assert len(ours.realm) == 16
    assert ours.realm != theirs.realm
    assert ours.realm == _survey_config(True, keys).realm  # stable for one key
    assert _survey_config(True, irismesh.Keyring.generate(["db"])) == irismesh.SurveyConfig()


def test_wait_for_peers_counts_membership_and_opens_no_link(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        first = await irismesh.Node("db", keyring=keys).start()
        others = [
            await irismesh.Node(cluster, keyring=keys, seeds=[first.endpoint]).start()
            for cluster in ("db", "search", None)
        ]
        watcher = others[-1]
        try:
            assert await watcher.wait_for_peers(3, timeout=5.0) == 3
            assert {p.node_id for p in watcher.peers()} == {
                n.node_id.hex() for n in (first, *others[:2])
            }
            # Membership only: the watcher linked to nobody but the seed it joined through.
            assert sum(p.linked for p in watcher.peers()) <= 1
            with pytest.raises(irismesh.MembershipTimeout, match="the mesh has 3 live"):
                await watcher.wait_for_peers(4, timeout=0.2)
        finally:
            await asyncio.gather(*(n.close() for n in [*others, first]))

    asyncio.run(asyncio.wait_for(main(), 30))


def test_names_reach_peers_that_never_linked_and_stay_after_a_leave(
    keys: irismesh.Keyring,
) -> None:
    async def main() -> None:
        seed = await irismesh.Node("db", keyring=keys, name="seed-1").start()
        member = await irismesh.Node("db", keyring=keys, seeds=[seed.endpoint], name="db-2").start()
        watcher = await irismesh.Node(keyring=keys, seeds=[seed.endpoint], name="watcher").start()
        try:

            def names() -> dict[str, tuple[str, bool]]:
                return {p.node_id: (p.name, p.linked) for p in watcher.peers()}

            expected = {seed.node_id.hex(): "seed-1", member.node_id.hex(): "db-2"}
            await wait_until(
                lambda: (
                    {k: name for k, (name, _) in names().items()} == expected
                    and sorted(p.name for p in member.peers()) == ["seed-1", "watcher"]
                ),
                10,
                "the watcher and db-2 to know each other by name",
            )
            # They reached each other by membership alone: the two never linked.
            assert names()[member.node_id.hex()] == ("db-2", False)
            await member.close()
            await wait_until(
                lambda: watcher.peer_state(member.node_id.hex()) == "left", 10, "the leave"
            )
            [gone] = [p for p in watcher.peers(departed=True) if p.state == "left"]
            assert (gone.node_id, gone.name) == (member.node_id.hex(), "db-2")
        finally:
            await asyncio.gather(*(n.close() for n in (watcher, member, seed)))

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_node_is_named_by_its_host_and_pid_unless_told(keys: irismesh.Keyring) -> None:
    node = irismesh.Node(keyring=keys)
    host, pid = socket.gethostname().partition(".")[0], f"-{os.getpid()}"
    assert node.name.endswith(pid)
    assert host.startswith(node.name.removesuffix(pid))  # cut short for a long host name
    assert len(node.name) <= 64
    assert irismesh.Node(keyring=keys, name="bée-7").name == "bée-7"
    for bad in ("", "w 1", "tab\t", "\x1b[2J", "x" * 65, b"w1", 7):
        with pytest.raises(irismesh.ConfigurationError, match="bad node name"):
            irismesh.Node(keyring=keys, name=bad)  # type: ignore[arg-type]
    with pytest.raises(irismesh.ConfigurationError, match="bad node name"):
        irismesh.sync.Node(keyring=keys, name="two words")


def test_peer_state_follows_a_member_from_alive_to_left(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        first = await irismesh.Node("db", keyring=keys).start()
        second = await irismesh.Node("db", keyring=keys, seeds=[first.endpoint]).start()
        try:
            await first.wait_for_peers(1, timeout=5.0)
            await second.wait_for_peers(1, timeout=5.0)  # its leave goes to those it knows
            key = second.node_id.hex()
            assert first.peer_state(key) == "alive"
            assert first.peer_state("00" * 16) is None
            with pytest.raises(irismesh.ConfigurationError, match="bad node id"):
                first.peer_state("not hex")
            await second.close()
            await wait_until(
                lambda: first.peer_state(key) == "left", 3.0, f"the leave {dict(first.stats)}"
            )
        finally:
            await asyncio.gather(first.close(), second.close())

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_first_request_to_a_cluster_not_linked_yet_dials_once(keys: irismesh.Keyring) -> None:
    """Membership knows the members, no link is open: the request opens the links and waits
    for one; every HELLO goes out at once (none waits for a handshake timeout and a redial)."""

    async def main() -> None:
        members = [await irismesh.Node("db", keyring=keys).start()]
        for _ in range(3):
            members.append(
                await irismesh.Node("db", keyring=keys, seeds=[members[0].endpoint]).start()
            )
        for member in members:
            member.on_request(lambda payload: payload)
        client = await irismesh.Node(keyring=keys, seeds=[members[0].endpoint]).start()
        try:
            await client.wait_for_peers(4, timeout=5.0)
            assert await client.request("db", b"first", timeout=5.0) == b"first"
            await wait_until(lambda: len(client.members("db")) == 4, 3.0, "links to all")
            assert client.stats.get("dials_failed", 0) == 0, dict(client.stats)
            assert client.stats.get("frames_for_closed_links", 0) == 0
        finally:
            await asyncio.gather(*(n.close() for n in [client, *members]))

    asyncio.run(asyncio.wait_for(main(), 30))
