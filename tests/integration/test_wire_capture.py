"""What a real run puts on the loopback: no payload, no reply, no cluster name in clear.

The bytes are recorded where an eavesdropper would take them: by a TCP proxy between a client
and a member (the client is seeded with the proxy), by a capture of every packet on `lo` (root
only: it also sees the member's dial-back link, which no proxy sits on), and by a socket joined
to the survey's multicast group. Each confidentiality test has a control that runs the same
exchange with `sealing=False` and finds the payload, so a capture that saw nothing cannot pass.
Cluster names are what a request names, and they never travel at all: members prove them with
keyed offer tags. Node names travel, sealed under the mesh key (handshakes carry them sealed
apart), so no capture shows them either.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from helpers import run_with_deadline, wait_until
from wiretap import (
    LOOPBACK,
    LoopbackCapture,
    RecordingProxy,
    free_tcp_port,
    group_listener,
    multicast_sender,
    proxied_client,
)

import irismesh
from irismesh.discovery.survey import (
    SurveyConfig,
    SurveyKind,
    decode,
    encode_question,
)

CLUSTER = "vault-7f3a"
MEMBER_NAME, CLIENT_NAME = "keeper-of-the-vault", "visitor-of-the-vault"  # the nodes' names
MARK = b"TOPSECRET"  # every payload, reply, broadcast and survey below starts with it
REQUESTS = 20
TEST_TIMEOUT = 30.0


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    run_with_deadline(scenario(), TEST_TIMEOUT)


def secrets_in(captured: bytes) -> list[bytes]:
    """The secrets of `exchange` (and the cluster's name) found in `captured`."""
    needles = [
        MARK,
        b"PAYLOAD-0000",
        b"REPLY-0000",
        b"BROADCAST-LINE",
        b"SURVEY-QUESTION",
        b"SURVEY-ANSWER",
        CLUSTER.encode(),
        CLUSTER.encode("utf-16-le"),
        MEMBER_NAME.encode(),
        CLIENT_NAME.encode(),
    ]
    return [needle for needle in needles if needle in captured]


async def exchange(client: irismesh.Node, member: irismesh.Node) -> None:
    """Requests, replies, a broadcast and a survey from `client` to `member`, all checked."""
    await client.wait_for_members(CLUSTER, timeout=10)
    assert client.members(CLUSTER) == [member.node_id.hex()]
    for i in range(REQUESTS):
        reply = await client.request(CLUSTER, MARK + b"-PAYLOAD-%04d" % i, timeout=5)
        assert reply == MARK + b"-REPLY-%04d" % i
    assert await client.broadcast(CLUSTER, MARK + b"-BROADCAST-LINE", timeout=5) == [
        member.node_id.hex()
    ]
    survey = await client.survey(CLUSTER, MARK + b"-SURVEY-QUESTION", timeout=5)
    assert survey.answers == {member.node_id.hex(): MARK + b"-SURVEY-ANSWER"}


def member_of_the_vault(keys: irismesh.Keyring, **options: Any) -> irismesh.Node:
    member = irismesh.Node(CLUSTER, keyring=keys, name=MEMBER_NAME, **options)

    @member.on_request
    def answer(payload: bytes) -> bytes:
        if payload.endswith(b"-SURVEY-QUESTION"):
            return MARK + b"-SURVEY-ANSWER"
        return payload.replace(b"-PAYLOAD-", b"-REPLY-")

    member.on_broadcast(lambda payload: None)
    return member


# ---------------------------------------------------------------------- through a proxy


async def proxied_run(keys: irismesh.Keyring, *, sealing: bool) -> RecordingProxy:
    async with (
        member_of_the_vault(keys, sealing=sealing) as member,
        proxied_client(member, CLUSTER, keyring=keys, sealing=sealing, name=CLIENT_NAME) as (
            client,
            proxy,
        ),
    ):
        await exchange(client, member)
    return proxy


def test_a_proxied_run_shows_no_payload_reply_or_cluster_name(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        proxy = await proxied_run(keys, sealing=True)
        captured = proxy.captured
        assert secrets_in(captured) == []
        # The capture is real: the handshake (node ids travel in clear) and every message.
        [conn] = proxy.connections
        assert len(conn.messages(upstream=True)) >= REQUESTS + 2
        assert len(conn.messages(upstream=False)) >= REQUESTS + 2
        assert len(captured) > REQUESTS * 2 * (14 + 16 + 13)

    run(main)


def test_the_control_run_without_sealing_shows_the_payload(keys: irismesh.Keyring) -> None:
    """`sealing=False` (benchmarks only) puts payloads in clear; cluster names stay hidden."""

    async def main() -> None:
        captured = (await proxied_run(keys, sealing=False)).captured
        found = secrets_in(captured)
        assert MARK in found
        assert b"PAYLOAD-0000" in found
        assert b"REPLY-0000" in found
        assert CLUSTER.encode() not in found  # offer tags, not names, even without sealing
        assert MEMBER_NAME.encode() in found  # node names are sealed, or in clear like the rest

    run(main)


# ---------------------------------------------------------------------- every packet on lo


@pytest.mark.skipif(
    LoopbackCapture.available() is not None, reason=str(LoopbackCapture.available())
)
@pytest.mark.parametrize("sealing", [True, False], ids=["sealed", "control-unsealed"])
def test_a_capture_of_every_packet_on_lo_shows_no_secret(
    keys: irismesh.Keyring, sealing: bool
) -> None:
    """The link to the member, the survey datagrams and the membership datagrams."""

    async def main() -> None:
        member_port, client_port = free_tcp_port(), free_tcp_port()
        survey = fresh_survey_config()
        capture = LoopbackCapture([member_port, client_port]).start()
        try:
            member = member_of_the_vault(
                keys, bind=f"tcp://{LOOPBACK}:{member_port}", sealing=sealing, survey=survey
            )
            client = irismesh.Node(  # found by the multicast survey: no seed at all
                keyring=keys,
                bind=f"tcp://{LOOPBACK}:{client_port}",
                sealing=sealing,
                survey=survey,
                name=CLIENT_NAME,
            )
            async with member, client:
                await exchange(client, member)
        finally:
            await asyncio.sleep(0.05)  # the last packets of the goodbyes
            capture.stop()
        streams = capture.streams()
        # Both directions of the client's link to the member.
        assert any(dst == member_port and data for (_src, dst), data in streams.items())
        assert any(src == member_port and data for (src, _dst), data in streams.items())
        assert any(d.startswith(b"IMSV") for d in capture.udp), "no survey datagram seen"
        # Membership's datagrams (magic "S", version 1) are in the scan below too.
        assert any(d.startswith(b"S\x02") for d in capture.udp), "no membership datagram seen"
        found = secrets_in(capture.captured)
        if sealing:
            assert found == []
        else:
            assert MARK in found
            assert CLUSTER.encode() not in found

    if not multicast_works():
        pytest.skip("multicast on 127.0.0.1 delivers nothing in this environment")
    run(main)


# ---------------------------------------------------------------------- the survey's datagrams


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def fresh_survey_config() -> SurveyConfig:
    group = f"239.255.{random.randint(74, 254)}.{random.randint(2, 254)}"
    return SurveyConfig(group=group, port=free_udp_port(), interface=LOOPBACK)


def multicast_works() -> bool:
    config = fresh_survey_config()
    try:
        with (
            group_listener(config, blocking=False) as listener,
            multicast_sender(blocking=False) as sender,
        ):
            sender.sendto(b"probe", (config.group, config.port))
            readable, _, _ = select.select([listener], [], [], 2.0)
            return bool(readable) and listener.recv(64) == b"probe"
    except OSError:
        return False


def drain(sock: socket.socket, into: list[bytes]) -> None:
    while True:
        try:
            into.append(sock.recv(2048))
        except BlockingIOError:
            return


def test_survey_datagrams_carry_no_cluster_name(keys: irismesh.Keyring) -> None:
    """Questions to the group and the answers to an asker: ids and endpoints, no names."""
    if not multicast_works():
        pytest.skip("multicast on 127.0.0.1 delivers nothing in this environment")
    config = fresh_survey_config()

    async def main() -> None:
        questions: list[bytes] = []
        answers: list[bytes] = []
        with (
            group_listener(config, blocking=False) as listener,
            multicast_sender(blocking=False) as asker,
        ):
            members = [
                member_of_the_vault(keys, survey=config),
                irismesh.Node("other-cluster-9c1d", keyring=keys, survey=config),
            ]
            client = irismesh.Node(keyring=keys, survey=config)
            async with members[0], members[1], client:
                nodes = [*members, client]
                # Ask as a node would, so that every node answers this socket.
                asking = encode_question(node_id=os.urandom(16), endpoint="tcp://127.0.0.1:9")
                asker.sendto(asking, (config.group, config.port))

                def heard_everyone() -> bool:
                    drain(listener, questions)
                    drain(asker, answers)
                    asked = {decode(q).node_id for q in questions}
                    answered = {decode(a).node_id for a in answers}
                    return {n.node_id for n in nodes} <= asked & answered

                await wait_until(heard_everyone, 10, "a question and an answer from each")
                await client.wait_for_members(CLUSTER, timeout=10)
                assert await client.request(CLUSTER, MARK + b"-PAYLOAD-0000") == (
                    MARK + b"-REPLY-0000"
                )
        assert {decode(q).kind for q in questions} == {SurveyKind.QUESTION}
        assert {decode(a).kind for a in answers} == {SurveyKind.ANSWER}
        for datagram in questions + answers:
            assert b"vault" not in datagram
            assert b"other-cluster" not in datagram
            assert secrets_in(datagram) == []
            # What a survey datagram does reveal: a node id and an endpoint, in clear.
            message = decode(datagram)
            assert message.node_id in datagram
            assert message.endpoint.encode() in datagram

    run(main)
