"""Replicated data over real sockets on 127.0.0.1: counters reach the exact total, sets converge
add-wins, a late node gets the state, majority writes and reads, watches, scope keys."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path

import pytest
from helpers import wait_until

import irismesh
from irismesh import sync
from irismesh.errors import DataTimeout, NoKey


def run(coro: Awaitable[None], timeout: float = 40) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, timeout)

    asyncio.run(bounded())


async def start_nodes(keys: irismesh.Keyring, n: int, seed: str = "") -> list[irismesh.Node]:
    nodes: list[irismesh.Node] = []
    for _ in range(n):
        seeds = [seed] if seed else [nodes[0].endpoint] if nodes else []
        node = irismesh.Node(keyring=keys, seeds=seeds, telemetry=False)
        nodes.append(await node.start())
    return nodes


async def close_all(nodes: list[irismesh.Node]) -> None:
    await asyncio.gather(*(n.close() for n in nodes))


async def holders(node: irismesh.Node, key: str, count: int) -> None:
    await node.wait_for_subscribers("_data." + key, count, timeout=10)


def test_two_nodes_incrementing_one_counter_reach_the_exact_total(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        a, b = await start_nodes(keys, 2)
        try:
            ca, cb = a.data.counter("quota.acme"), b.data.counter("quota.acme")
            await holders(a, "quota.acme", 1)
            await holders(b, "quota.acme", 1)

            async def bump(counter: irismesh.data.DataCounter, n: int, by: int) -> None:
                for _ in range(n):
                    await counter.add(by)

            await asyncio.gather(bump(ca, 500, 1), bump(cb, 300, 2), bump(cb, 50, -1))
            total = 500 + 600 - 50

            async def both() -> bool:
                return await ca.get() == total and await cb.get() == total

            await wait_until_async(both, 10, "both counters at the total")
            assert a.stats["data_merges"] >= 1
            assert a.stats["data_deltas_sent"] < 500  # local writes fold into fewer deltas
            assert b.stats["data_bytes_sent"] > 0
        finally:
            await close_all([a, b])

    run(main())


async def wait_until_async(check: object, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while True:
        if await check():  # type: ignore[operator]
            return
        if loop.time() > until:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_a_set_converges_add_wins(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        a, b = await start_nodes(keys, 2)
        try:
            sa, sb = a.data.set("sessions.web"), b.data.set("sessions.web")
            await holders(a, "sessions.web", 1)
            await holders(b, "sessions.web", 1)
            await sa.add(b"s1", consistency="all")
            await sa.add(b"s2", consistency="all")
            assert await sb.get() == {b"s1", b"s2"}
            # Concurrently: a removes s1 while b adds it again; b removes s2 while a keeps it.
            await asyncio.gather(sa.remove(b"s1"), sb.add(b"s1"), sb.remove(b"s2"))

            async def agreed() -> bool:
                return await sa.get() == await sb.get() == {b"s1"}

            await wait_until_async(agreed, 10, "the sets to agree on {s1}")
            await sb.clear(consistency="all", timeout=5)
            assert await sa.get() == await sb.get() == frozenset()
        finally:
            await close_all([a, b])

    run(main())


def test_a_node_that_joins_late_gets_the_state(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        (a,) = await start_nodes(keys, 1)
        late: list[irismesh.Node] = []
        try:
            await a.data.counter("quota.acme").add(42)
            await a.data.register("config.mode").set("fast")
            await a.data.flag("flags.beta").enable()
            m = a.data.map("config.limits")
            await m.add("hits", 3)
            await m.set("owner", b"ops")
            await m.add_element("zones", "eu")
            late = await start_nodes(keys, 1, seed=a.endpoint)
            (b,) = late
            counter, register = b.data.counter("quota.acme"), b.data.register("config.mode")
            flag, limits = b.data.flag("flags.beta"), b.data.map("config.limits")

            async def caught_up() -> bool:
                return (
                    await counter.get() == 42
                    and await register.get() == "fast"
                    and await flag.get()
                    and await limits.get() == {"hits": 3, "owner": b"ops", "zones": {"eu"}}
                )

            await wait_until_async(caught_up, 10, "the late node to have every key")
        finally:
            await close_all([a, *late])

    run(main())


def test_majority_writes_and_reads(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        nodes = await start_nodes(keys, 3)
        try:
            counters = [n.data.counter("quota.acme") for n in nodes]
            for n in nodes:
                await holders(n, "quota.acme", 2)
            await counters[0].add(5, consistency="majority", timeout=5)
            # Acknowledged by a majority: another node has it without waiting.
            having = [await c.get() for c in counters[1:]]
            assert 5 in having
            await counters[1].add(1, consistency="all", timeout=5)
            assert [await c.get() for c in counters] == [6, 6, 6]
            assert await counters[2].get(consistency="majority", timeout=5) == 6
        finally:
            await close_all(nodes)

    run(main())


def test_majority_times_out_without_holders_answering(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        a, b = await start_nodes(keys, 2)
        try:
            ca = a.data.counter("quota.acme")
            b.data.counter("quota.acme")
            await holders(a, "quota.acme", 1)
            b.data._closed = True  # b still subscribes but answers nothing
            with pytest.raises(DataTimeout) as caught:
                await ca.add(1, consistency="majority", timeout=0.5)
            assert (caught.value.reached, caught.value.needed) == (1, 2)
            assert await ca.get() == 1  # the write stays applied here
        finally:
            await close_all([a, b])

    run(main())


def test_watch_sees_local_and_remote_changes(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        a, b = await start_nodes(keys, 2)
        try:
            async with b.data.watch("flags.#") as watch:
                await holders(a, "flags.beta", 1)
                await a.data.flag("flags.beta").enable()
                change = await asyncio.wait_for(watch.get(), 10)
                assert (change.key, change.value, change.local) == ("flags.beta", True, False)
                await b.data.flag("flags.beta").disable()
                change = await asyncio.wait_for(watch.get(), 10)
                assert (change.key, change.value, change.local) == ("flags.beta", False, True)
        finally:
            await close_all([a, b])

    run(main())


def test_a_scope_key_keeps_a_data_key_to_its_holders(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        # a holds a key of its own for the "quota" scope; b has only the default key.
        a = await irismesh.Node(keyring=keys.with_key("quota"), telemetry=False).start()
        b = await irismesh.Node(keyring=keys, seeds=[a.endpoint], telemetry=False).start()
        lone = irismesh.Node(keyring=irismesh.Keyring.generate(["@mesh", "_data"]), telemetry=False)
        await lone.start()
        try:
            with pytest.raises(NoKey):
                lone.data.counter("quota.acme")
            ca, cb = a.data.counter("quota.acme"), b.data.counter("quota.acme")
            await holders(a, "quota.acme", 1)
            await holders(b, "quota.acme", 1)
            await cb.add(5)
            await ca.add(1)
            await wait_until(
                lambda: (
                    a.stats.get("data_dropped_unsealed", 0) >= 1
                    and b.stats.get("data_dropped_unsealed", 0) >= 1
                ),
                10,
                "each side to drop what the other sealed",
            )
            assert await ca.get() == 1
            assert await cb.get() == 5
        finally:
            await close_all([a, b, lone])

    run(main())


def test_the_blocking_api_reaches_the_same_data(keys: irismesh.Keyring) -> None:
    with sync.Node(keyring=keys) as a:
        counter = a.data.counter("quota.acme")
        counter.add(2)
        counter.add(-1, consistency="majority", timeout=2)
        assert counter.get() == 1
        members = a.data.set("sessions.web")
        members.add(b"x")
        assert members.get() == {b"x"}
        with a.data.watch("flags.*") as watch:
            a.data.flag("flags.beta").enable()
            change = watch.get(timeout=5)
            assert (change.key, change.value) == ("flags.beta", True)


def test_digests_repair_what_deltas_missed(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        a, b = await start_nodes(keys, 2)
        try:
            sa, sb = a.data.set("sessions.web"), b.data.set("sessions.web")
            await holders(a, "sessions.web", 1)
            await holders(b, "sessions.web", 1)
            # A write whose delta never left a (as if a link broke with it in flight).
            a.data._held["sessions.web"].state.add(a.node_id, b"lost")
            await sb.add(b"seen")
            await a.data._digest_round()

            async def repaired() -> bool:
                return await sa.get() == await sb.get() == {b"lost", b"seen"}

            await wait_until_async(repaired, 10, "the digest to bring both sets together")
            assert b.stats["data_states_sent"] + a.stats["data_states_sent"] >= 1
        finally:
            await close_all([a, b])

    run(main())


def test_the_cli_writes_and_reads_with_the_holders(keys: irismesh.Keyring, keyfile: Path) -> None:
    with sync.Node(keyring=keys, discovery=False) as holder:
        counter = holder.data.counter("quota.acme")
        counter.add(10)
        env = {**os.environ, "IRISMESH_DISCOVERY": "0"}
        mesh = [sys.executable, "-m", "irismesh", "data"]
        joining = ["--keys", str(keyfile), "--seed", holder.endpoint, "--wait", "5"]
        added = subprocess.run(
            [*mesh, "add", "quota.acme", "5", *joining], env=env, capture_output=True, text=True
        )
        assert added.stdout == "quota.acme\t15\n", added.stderr
        assert counter.get() == 15
        got = subprocess.run(
            [*mesh, "get", "quota.acme", "--json", *joining],
            env=env,
            capture_output=True,
            text=True,
        )
        assert got.stdout == '{"key": "quota.acme", "value": 15}\n', got.stderr


MEMBER = """
import asyncio, sys, irismesh
async def main():
    keys = irismesh.Keyring.from_env()
    async with irismesh.Node(keyring=keys, memory=sys.argv[1], telemetry=False) as node:
        print("READY", node.endpoint, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


def start_member(keys: irismesh.Keyring, directory: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "IRISMESH_KEYS": keys.to_text(), "IRISMESH_DISCOVERY": "0"}
    env.pop("IRISMESH_KEYFILE", None)
    child = subprocess.Popen(
        [sys.executable, "-c", MEMBER, str(directory)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline().split()
    assert line[:1] == ["READY"], "the memory member did not start"
    return child, line[1]


def test_a_memory_member_killed_and_restarted_keeps_every_acknowledged_write(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    async def main() -> None:
        member, endpoint = start_member(keys, tmp_path)
        restarted: subprocess.Popen[str] | None = None
        try:
            (writer,) = await start_nodes(keys, 1, seed=endpoint)
            try:
                counter, sessions = writer.data.counter("quota.acme"), writer.data.set("s.web")
                await holders(writer, "quota.acme", 1)  # the member holds every key
                for _ in range(20):
                    await counter.add(1, consistency="majority", timeout=5)
                await sessions.add(b"kept", consistency="all", timeout=5)
            finally:
                await writer.close()
            member.kill()  # SIGKILL: no goodbye, no last save
            member.wait(10)
            for pipe in (member.stdin, member.stdout):
                assert pipe is not None
                pipe.close()
            restarted, endpoint = start_member(keys, tmp_path)
            (reader,) = await start_nodes(keys, 1, seed=endpoint)
            try:
                counter, sessions = reader.data.counter("quota.acme"), reader.data.set("s.web")

                async def kept() -> bool:
                    return await counter.get() == 20 and await sessions.get() == {b"kept"}

                await wait_until_async(kept, 10, "the restarted member to hand back its keys")
            finally:
                await reader.close()
        finally:
            for child in (member, restarted):
                if child is not None and child.poll() is None:
                    assert child.stdin is not None
                    child.stdin.close()
                    child.wait(10)
                if child is not None and child.stdout is not None:
                    child.stdout.close()

    run(main())


def test_bad_messages_and_values_are_refused(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        a, b = await start_nodes(keys, 2)
        try:
            counter = a.data.counter("quota.acme")
            await holders(b, "quota.acme", 1)
            await b.publish("_data.quota.acme", b"\x05not sealed")
            await b.publish("_data.quota.acme", a.data._sealer.seal("_data.quota.acme", b"\xc1"))
            await wait_until(
                lambda: (
                    a.stats.get("data_dropped_unsealed", 0) == 1
                    and a.stats.get("data_dropped_bad_data", 0) == 1
                ),
                10,
                "both bad messages dropped and counted",
            )
            assert await counter.get() == 0
            with pytest.raises(irismesh.ConfigurationError):
                await a.data.register("config.mode").set({1, 2})  # msgpack has no sets
            with pytest.raises(irismesh.ConfigurationError):
                a.data.set("quota.acme")  # a counter already
            with pytest.raises(irismesh.ConfigurationError):
                await counter.add(1, consistency="quorum")  # type: ignore[arg-type]
        finally:
            await close_all([a, b])

    run(main())


def test_a_node_closing_right_after_a_write_still_sends_it(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        a, b = await start_nodes(keys, 2)
        try:
            cb = b.data.counter("quota.acme")
            a.data.counter("quota.acme")
            await holders(a, "quota.acme", 1)
            await holders(b, "quota.acme", 1)
            await a.data.counter("quota.acme").add(7)
            await a.close()
            await wait_until_async(lambda: _equals(cb.get(), 7), 10, "the write made at close")
        finally:
            await close_all([a, b])

    run(main())


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


def test_a_register_write_after_a_read_wins_whatever_the_clocks(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        fast, right = await start_nodes(keys, 2)
        try:
            fast.data.physical = lambda: int(time.time() * 1000) + 10_000  # 10 s ahead
            on_fast, on_right = (
                fast.data.register("config.mode"),
                right.data.register("config.mode"),
            )
            fields = fast.data.map("config.limits"), right.data.map("config.limits")
            await holders(fast, "config.mode", 1)
            await holders(right, "config.mode", 1)
            await on_fast.set("v1", consistency="all", timeout=5)
            await fields[0].set("owner", "v1", consistency="all", timeout=5)
            assert await on_right.get() == "v1"
            await on_right.set("v2", consistency="all", timeout=5)  # after reading v1
            await fields[1].set("owner", "v2", consistency="all", timeout=5)
            assert await on_fast.get() == await on_right.get() == "v2"
            assert (await fields[0].get())["owner"] == (await fields[1].get())["owner"] == "v2"
        finally:
            await close_all([fast, right])

    run(main())


def test_a_pattern_finds_the_keys_that_exist_and_top_shows_them(keys: irismesh.Keyring) -> None:
    """A watch (or `mesh top --data`) holds the keys its pattern matches that were written
    before it started: a holder's digest (sent as soon as the watcher comes up) makes it ask
    for their states."""
    from irismesh._cli.top import Sampler, data_json, data_views, frame_json

    async def main() -> None:
        (a,) = await start_nodes(keys, 1)
        try:
            await a.data.counter("quota.top").add(7)
            await a.data.set("quota.zones").add(b"eu")
            await a.data.register("other.mode").set("x")  # not matched
            (b,) = await start_nodes(keys, 1, seed=a.endpoint)
            try:
                b.data.watch("quota.#")
                sampler = Sampler(b, [])
                sampler.data = True

                def shown() -> bool:
                    return [(d.key, d.type, data_json(d.value)) for d in data_views(b)] == [
                        ("quota.top", "counter", 7),
                        ("quota.zones", "set", ["eu"]),
                    ]

                await wait_until(shown, 10, "the watcher to hold both keys")
                frame = frame_json(sampler.sample())
                assert frame["data"] == [
                    {"key": "quota.top", "type": "counter", "value": 7},
                    {"key": "quota.zones", "type": "set", "value": ["eu"]},
                ]
                assert frame["stats"]["data_merges"]["value"] >= 2  # type: ignore[index]
                assert b.stats["data_asks_sent"] >= 2
            finally:
                await b.close()
        finally:
            await a.close()

    run(main())


def test_a_node_that_left_has_its_counter_entries_folded_and_the_total_stays(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer leaves; the key's lowest holder proposes folding its entries, every holder
    says it saw that (with its own copy of them), and the owner folds: no holder keeps an
    entry of the node that left, and every one reads the same exact total."""
    from irismesh.data import replicas

    monkeypatch.setattr(replicas, "PRUNE_AFTER", 0.0)  # the round below runs at once

    async def main() -> None:
        nodes = await start_nodes(keys, 3)
        a, b, c = nodes
        try:
            counters = [n.data.counter("quota.pruned") for n in nodes]
            for node in nodes:
                await holders(node, "quota.pruned", 2)
            await counters[0].add(2)
            await counters[1].add(3)
            await counters[2].add(10)
            await counters[2].add(-4)
            await wait_until(
                lambda: all(n.data.values()["quota.pruned"] == 11 for n in nodes), 10, "11"
            )
            gone = c.node_id
            await c.close()
            await wait_until(lambda: gone in a.data._left and gone in b.data._left, 10, "the leave")
            owner, other = (a, b) if a.node_id < b.node_id else (b, a)
            other.data._prune_round()  # not the lowest holder: proposes nothing
            owner.data._prune_round()

            def folded(n: irismesh.Node) -> bool:
                state = n.data._held["quota.pruned"].state
                assert isinstance(state, irismesh.data.types.PNCounter)
                return gone in state.pruned and gone not in state.up and gone not in state.down

            await wait_until(lambda: folded(a) and folded(b), 10, "the fold everywhere")
            assert a.data.values()["quota.pruned"] == b.data.values()["quota.pruned"] == 11
            assert owner.stats["data_nodes_pruned"] == 1
            assert other.stats.get("data_nodes_pruned", 0) == 0
            await counters[0].add(1)
            await wait_until(lambda: b.data.values()["quota.pruned"] == 12, 10, "12")
        finally:
            await close_all(nodes)  # closing twice is fine

    run(main())


def test_a_node_that_left_has_its_set_flag_and_map_dots_folded(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer adds to a set, enables a flag and updates a map, then leaves; once folded,
    no holder's state names it (dots, contexts, counters inside the map) and every holder
    reads what it read before; a remove of an element it added still removes it."""
    from irismesh.data import replicas
    from irismesh.data.types import Flag, ORMap, ORSet

    monkeypatch.setattr(replicas, "PRUNE_AFTER", 0.0)

    async def main() -> None:
        nodes = await start_nodes(keys, 3)
        a, b, c = nodes
        try:
            keys_ = ("sessions.pruned", "flags.pruned", "config.pruned")
            for node in nodes:
                node.data.set(keys_[0]), node.data.flag(keys_[1]), node.data.map(keys_[2])
            for node in nodes:
                for key in keys_:
                    await holders(node, key, 2)
            await c.data.set(keys_[0]).add(b"s1")
            await c.data.set(keys_[0]).add(b"s2")
            await a.data.set(keys_[0]).add(b"s3")
            await c.data.flag(keys_[1]).enable()
            await c.data.map(keys_[2]).add("hits", 5)
            await c.data.map(keys_[2]).add_element("zones", "eu")
            await a.data.map(keys_[2]).add("hits", 1)
            want = {
                keys_[0]: frozenset({b"s1", b"s2", b"s3"}),
                keys_[1]: True,
                keys_[2]: {"hits": 6, "zones": frozenset({"eu"})},
            }

            def reads(n: irismesh.Node) -> bool:
                values = n.data.values()
                return all(values.get(k) == v for k, v in want.items())

            await wait_until(lambda: all(reads(n) for n in nodes), 10, "the writes")
            gone = c.node_id
            await c.close()
            await wait_until(lambda: gone in a.data._left and gone in b.data._left, 10, "the leave")
            owner = a if a.node_id < b.node_id else b
            owner.data._prune_round()

            def folded(n: irismesh.Node) -> bool:
                for key in keys_:
                    state = n.data._held[key].state
                    assert isinstance(state, (ORSet, Flag, ORMap))
                    if gone not in state.pruned:
                        return False
                    assert gone not in encode_nodes(state)
                return True

            await wait_until(lambda: folded(a) and folded(b), 10, "the fold everywhere")
            assert reads(a)
            assert reads(b)
            assert owner.stats["data_nodes_pruned"] == 3
            await b.data.set(keys_[0]).remove(b"s1")  # an add of the node that left
            await wait_until(
                lambda: a.data.values()[keys_[0]] == frozenset({b"s2", b"s3"}), 10, "the remove"
            )
        finally:
            await close_all(nodes)

    run(main())


def encode_nodes(state: irismesh.data.types.Crdt) -> list[bytes]:
    """The node ids a state's encoding names, its fold markers' left out."""
    import msgpack

    from irismesh.data.types import Flag, ORMap, ORSet, encode

    bare = state.copy()
    for s in [bare.keys, *bare.values.values()] if isinstance(bare, ORMap) else [bare]:
        if isinstance(s, (ORSet, Flag, irismesh.data.types.PNCounter)):
            s.pruned = {}
    nodes: list[bytes] = msgpack.unpackb(encode(bare), strict_map_key=False)[1]
    return nodes
