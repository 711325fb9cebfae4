"""A node whose user keeps it busy stays alive: calls that complete at once still yield.

Each test runs one kind of busy loop for `BUSY` seconds on the test's event loop, beside a
ticker task and under `asyncio.wait_for`, while a peer in a process of its own watches the
busy node: the loop must keep giving turns (the ticker ticks, wait_for ends the loop on
time), and the peer must never suspect the node (its probes were answered throughout).

The ticker's gaps are measured in this process's CPU time: how much work the busy loop did
between two turns it gave, which a busy machine does not stretch (its wall-clock gaps also
hold whatever the scheduler gave to other processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from helpers import deadline

import irismesh
from irismesh import _turns
from irismesh.errors import NoResponders, Overloaded

BUSY = 3.0  # seconds each busy loop runs
TICK = 0.001  # the ticker's sleep
# A tick may come late when the machine is busy; most must come within this, none much later.
GAP = 0.010
PEER = Path(__file__).with_name("busy_peer.py")


class Watcher:
    """The peer process: its endpoint, and its view of the busy node on request."""

    def __init__(self, keyfile: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), str(keyfile)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["READY"], f"the watching peer did not start: {line!r}"
        self.endpoint = line[1]

    def report(self, node_id: str) -> dict[str, object]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"report {node_id}\n")
        self.proc.stdin.flush()
        report: dict[str, object] = json.loads(self.proc.stdout.readline())
        return report

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def watcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watcher]:
    keyfile = tmp_path_factory.mktemp("fairness") / "mesh.keys"
    irismesh.Keyring.generate().save(keyfile)
    with contextlib.closing(Watcher(keyfile)) as peer:
        yield peer


async def no_subscriber(node: irismesh.Node) -> None:
    await node.publish("quiet.metrics", b"x" * 100)


async def within_credit(node: irismesh.Node) -> None:
    await node.publish("busy.metrics", b"x" * 100)


async def no_responders(node: irismesh.Node) -> None:
    with contextlib.suppress(NoResponders):
        await node.request("nobody", b"x")


async def throttled(node: irismesh.Node) -> None:
    with contextlib.suppress(Overloaded):
        await node.request("shed", b"x", timeout=1.0)


@pytest.mark.parametrize(
    "call",
    [no_subscriber, within_credit, no_responders, throttled],
    ids=["publish-no-subscriber", "publish-in-credit", "retry-no-responders", "retry-throttled"],
)
def test_busy_caller_keeps_its_node_alive(
    watcher: Watcher, call: Callable[[irismesh.Node], Awaitable[None]]
) -> None:
    asyncio.run(asyncio.wait_for(busy_beside(watcher, call), 30))


async def busy_beside(watcher: Watcher, call: Callable[[irismesh.Node], Awaitable[None]]) -> None:
    keys = irismesh.Keyring.load(Path(watcher.proc.args[2]))  # type: ignore[index]
    async with irismesh.Node(keyring=keys, seeds=[watcher.endpoint], telemetry=False) as node:
        await node.wait_for_members("shed", 1, timeout=10)
        await node.wait_for_subscribers("busy.metrics", 1, timeout=10)
        before = watcher.report(node.node_id.hex())
        assert before["state"] == "alive", before

        ticks: list[float] = []  # process CPU time at each tick

        async def ticker() -> None:
            while True:
                ticks.append(time.process_time())
                await asyncio.sleep(TICK)

        calls = 0

        async def busy() -> None:
            nonlocal calls
            while True:
                await call(node)
                calls += 1

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        began, began_cpu = time.monotonic(), time.process_time()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(busy(), BUSY)
        took = time.monotonic() - began
        cpu = time.process_time() - began_cpu
        ticking.cancel()
        after = watcher.report(node.node_id.hex())
        refuted = node.stats.get("refutations", 0)

    gaps = sorted(b - a for a, b in itertools.pairwise(ticks) if b > began_cpu)
    late = sum(gap > GAP for gap in gaps)
    assert calls > 1000, f"only {calls} calls in {BUSY} s: the loop was not busy"
    assert took < BUSY + 0.5, f"wait_for ended the busy loop after {took:.2f} s, not {BUSY}"
    assert len(gaps) > cpu / GAP, f"the ticker ran {len(gaps)} times in {cpu:.2f} s of CPU"
    assert late <= len(gaps) // 100, f"{late} of {len(gaps)} ticks came over {GAP * 1e3} ms late"
    assert gaps[-1] < 10 * GAP, f"a tick waited {gaps[-1] * 1e3:.1f} ms"
    assert after["state"] == "alive", after
    assert after["suspected"] == before["suspected"], (before, after)
    assert refuted == 0, f"the busy node was suspected and refuted it {refuted} times"
    if call is within_credit:
        assert after["received"] > before["received"]  # type: ignore[operator]


@deadline(30)
async def test_a_publisher_its_subscriber_holds_back_is_given_no_turn_it_does_not_need() -> None:
    # The subscriber reads slowly (a window of 8 messages, one read every 2 ms), so most
    # publishes wait for room: the loop runs while they wait, and a forced turn on top of that
    # would be waste.
    keys = irismesh.Keyring.generate()
    window = irismesh.CoreConfig(pubsub_window=8)
    async with (
        irismesh.Node(keyring=keys, config=window, telemetry=False) as subscriber,
        irismesh.Node(keyring=keys, seeds=[subscriber.endpoint], telemetry=False) as publisher,
    ):
        got = 0

        async def read() -> None:
            nonlocal got
            async with subscriber.subscribe("slow.#", maxsize=4) as sub:
                async for _msg in sub:
                    got += 1
                    await asyncio.sleep(0.002)

        reader = asyncio.create_task(read())
        await publisher.wait_for_subscribers("slow.x", 1, timeout=10)
        waited = 0
        wake = publisher._pubsub.waited
        assert wake is not None

        def counted() -> None:
            nonlocal waited
            waited += 1
            wake()

        publisher._pubsub.waited = counted
        try:
            began = time.monotonic()
            for _ in range(150):  # some 0.3 s: many slices of the loop
                await publisher.publish("slow.x", b"x", timeout=5)
            took = time.monotonic() - began
        finally:
            reader.cancel()
        assert took > 10 * _turns.SLICE, f"the publisher was not held back ({took:.3f} s)"
        assert waited > 10, waited
        assert publisher.stats.get("loop_turns_given", 0) == 0
