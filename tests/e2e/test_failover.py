"""Members in their own processes, killed for real while requests are in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MESH, ROOT, NumberedCalls, Workers, kill_all, wait_until

import irismesh


def test_sigkill_under_load_loses_no_request(keys: irismesh.Keyring, workers: Workers) -> None:
    """80 requests in flight, a member SIGKILLed: every request gets its own correct reply."""

    async def main() -> None:
        first = workers.start("w1", delay=0.005)
        workers.start("w2", [first], delay=0.005)
        workers.start("w3", [first], delay=0.005)
        async with irismesh.Node(keyring=keys, seeds=[first]) as client:
            await client.wait_for_members("work", 3, timeout=10)
            calls = NumberedCalls(client, "work", 1200)
            killed_with = -1

            async def killer() -> None:
                nonlocal killed_with
                # Once a third is served, kill w3 at a moment with at least 50 in flight.
                await wait_until(
                    lambda: (
                        calls.done >= calls.total // 3 and client.stats["requests_pending"] >= 50
                    ),
                    30,
                    "a third served with 50 in flight",
                )
                killed_with = client.stats["requests_pending"]
                workers.procs["w3"].send_signal(signal.SIGKILL)

            await calls.run(80, killer())
            assert calls.wrong == 0, calls.samples
            assert calls.done == calls.total
            assert killed_with >= 50, f"only {killed_with} requests were in flight at the kill"
            assert client.stats.get("requests_resent", 0) > 0, "nothing was in flight on w3"
            assert client.stats.get("requests_timed_out", 0) == 0
            assert len(client.members("work")) == 2

    asyncio.run(asyncio.wait_for(main(), 60))


def test_killed_member_stops_receiving_requests_within_two_seconds(
    keys: irismesh.Keyring, workers: Workers
) -> None:
    async def main() -> None:
        first = workers.start("w1")
        workers.start("w2", [first])
        async with irismesh.Node(keyring=keys, seeds=[first]) as client:
            await client.wait_for_members("work", 2, timeout=10)
            victim = workers.procs["w2"]
            victim.send_signal(signal.SIGKILL)
            taken = await wait_until(
                lambda: len(client.members("work")) == 1, 2.0, "the killed member to be dropped"
            )
            print(f"SIGKILLed member dropped from routing after {taken * 1000:.0f} ms")
            # Found by the dropped TCP connection, not by waiting for membership's verdict
            # (which follows within seconds: the link's failure asks for a probe at once).
            assert client.stats.get("links_down_disconnected", 0) == 1, client.stats
            for i in range(50):  # and nothing goes to it any more
                assert (await client.request("work", b"%d" % i, timeout=2)).startswith(b"w1:")

    asyncio.run(asyncio.wait_for(main(), 60))


def _free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 a moment ago (a node takes both)."""
    while True:
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            tcp.bind(("127.0.0.1", 0))
            port: int = tcp.getsockname()[1]
            try:
                udp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_the_only_member_sigkilled_gives_no_responders_at_once_and_its_restart_serves(
    keyfile: Path, keys: irismesh.Keyring, transport: str
) -> None:
    """Its link drops and its endpoint refuses the redial: the caller takes it out of its own
    routing at once, well before membership's probes could declare it dead (seconds)."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile), IRISMESH_TRANSPORT=transport)
    env.pop("IRISMESH_KEYS", None)
    argv = [*MESH, "node", "--cluster", "work", "--prefix", "m:", "--bind", endpoint]
    procs: list[subprocess.Popen[str]] = []

    def start_member() -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        assert proc.stdout is not None
        assert endpoint in proc.stdout.readline(), "the member did not start"
        return proc

    async def main() -> None:
        member = start_member()
        async with irismesh.Node(keyring=keys, seeds=[endpoint], transport=transport) as client:
            await client.wait_for_members("work", 1, timeout=10)
            assert await client.request("work", b"x", timeout=5) == b"m:x"
            loop = asyncio.get_running_loop()
            member.send_signal(signal.SIGKILL)
            killed = loop.time()
            while True:  # bounded: a request's deadline each, and the loop's below
                assert loop.time() - killed < 10, "no NoResponders within 10 s"
                try:
                    await client.request("work", b"y", timeout=0.5)
                except irismesh.NoResponders:
                    break
                except irismesh.RequestTimeout:
                    continue
            taken = loop.time() - killed
            print(f"{transport}: NoResponders {taken * 1000:.0f} ms after the SIGKILL")
            assert taken < 0.8, f"NoResponders after {taken:.2f} s"
            assert client.stats.get("peers_taken_out", 0) == 1, client.stats
            # The same endpoint, a new process: the caller still calls, so it dials the
            # endpoint again, and the new member's handshake makes it routable.
            start_member()
            restarted = loop.time()
            while True:
                assert loop.time() - restarted < 10, "the restarted member was never asked"
                try:
                    reply = await client.request("work", b"z", timeout=2)
                    break
                except irismesh.NoResponders:
                    await asyncio.sleep(0.02)
            assert reply == b"m:z"

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        kill_all(procs, drain=True)


def test_stopped_member_for_300ms_is_not_declared_dead(
    keys: irismesh.Keyring, workers: Workers
) -> None:
    async def main() -> None:
        first = workers.start("w1")
        async with irismesh.Node(keyring=keys, seeds=[first]) as client:
            await client.wait_for_members("work", 1, timeout=10)
            pid = workers.procs["w1"].pid
            for _ in range(3):
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(0.3)
                os.kill(pid, signal.SIGCONT)
                assert (await client.request("work", b"x", timeout=5)) == b"w1:x"
            assert not [k for k in client.stats if k.startswith("peers_down")], client.stats

    asyncio.run(asyncio.wait_for(main(), 60))


def test_failover_example_reports_no_failure() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "failover.py"), "--json", "--requests", "1500"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["failed"] == 0
    assert report["replies_ok"] == 1500
    assert set(report["served_by"]) == {"w1", "w2", "w3"}
    assert "killed w3 (SIGKILL)" in result.stderr
