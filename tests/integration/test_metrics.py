"""Live metrics: what a node serves at /metrics agrees with what it counts, in Prometheus form."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from helpers import calls_of_each_outcome, echo_or_boom
from prometheus_client.parser import text_string_to_metric_families

import irismesh
from irismesh.telemetry.prometheus import LE_BOUNDS

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
ROOT = Path(__file__).resolve().parents[2]


async def scrape(address: str, path: str = "/metrics") -> tuple[int, str]:
    """One HTTP/1.1 GET on a kept-alive connection, as Prometheus makes it."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {address}\r\nAccept: */*\r\n\r\n".encode())
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        status = int(head.split()[1])
        length = next(
            int(line.split(":")[1])
            for line in head.split("\r\n")
            if line.lower().startswith("content-length:")
        )
        body = await reader.readexactly(length)
        return status, body.decode()
    finally:
        writer.close()


def samples(text: str) -> Samples:
    """Every sample of an exposition, by name and labels (the parser checks the format); a
    family with no sample yet as one of value nan under its name."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        if not family.samples:
            suffix = {"counter": "_total", "histogram": "_bucket"}.get(family.type, "")
            out[(family.name + suffix, frozenset())] = math.nan
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in out, f"duplicate sample {key}"
            out[key] = sample.value
    return out


def value(found: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and wanted <= ls and v == v)


def names(found: Samples) -> set[str]:
    return {name for name, _ in found}


def test_metrics_agree_with_the_node_counters(keys: irismesh.Keyring) -> None:
    async def main() -> tuple[Samples, Samples, dict[str, int], dict[str, int]]:
        async with irismesh.Node("db", keyring=keys, name="m1", metrics="127.0.0.1:0") as member:
            member.on_request(echo_or_boom)

            async with irismesh.Node(
                keyring=keys, seeds=[member.endpoint], name="c1", metrics="127.0.0.1:0"
            ) as client:
                assert client.metrics_address != member.metrics_address
                await calls_of_each_outcome(client, 300)
                async with client.subscribe("news.#") as sub:
                    await member.wait_for_subscribers("news.item-0", 1, timeout=5)
                    for i in range(5):
                        await member.publish(f"news.item-{i}", b"x")
                    for _ in range(5):
                        await sub.get(timeout=5)
                status, text = await scrape(client.metrics_address)
                assert status == 200
                _, member_text = await scrape(member.metrics_address)
                return samples(text), samples(member_text), dict(client.stats), dict(member.stats)

    client, member, client_stats, member_stats = asyncio.run(asyncio.wait_for(main(), 30))
    caller = {"node": "c1", "cluster": "db", "side": "caller"}
    assert value(client, "irismesh_requests_total", **caller, outcome="ok") == 300
    assert value(client, "irismesh_requests_total", **caller, outcome="remote_error") == 1
    assert value(client, "irismesh_requests_total", cluster="nobody", outcome="no_responders") == 1
    served = {"node": "m1", "cluster": "db", "side": "member"}
    assert value(member, "irismesh_requests_total", **served, outcome="ok") == 300
    assert value(member, "irismesh_requests_total", **served, outcome="remote_error") == 1
    # Every request that ended is in the round-trip histogram, cumulative over the bounds.
    histogram = "irismesh_request_duration_seconds"
    bounds = [
        value(client, histogram + "_bucket", node="c1", cluster="db", le=le)
        for le in (*LE_BOUNDS, "+Inf")
    ]
    assert bounds == sorted(bounds)
    assert bounds[-1] == 301 == value(client, histogram + "_count", node="c1", cluster="db")
    # Messages by topic scope, never by topic.
    assert value(member, "irismesh_messages_published_total", scope="news") == 5
    assert value(client, "irismesh_messages_delivered_total", scope="news") == 5
    assert not any("item-" in str(labels) for _, labels in client)
    # Membership, admission and a level of the node's stats.
    assert value(client, "irismesh_members", node="c1", state="alive") == 1
    assert value(member, "irismesh_admission_limit", node="m1") == member_stats["handler_limit"]
    assert "irismesh_requests_in_flight" in names(client)
    # Every counter of node.stats under a conventional name: its own, or its reason family's.
    for stats, found in ((client_stats, client), (member_stats, member)):
        exported = names(found)
        missing = [key for key in stats if not _exported(key, exported)]
        assert not missing, f"node.stats entries with no metric: {missing}"


def _exported(key: str, exported: Iterable[str]) -> bool:
    own = {f"irismesh_{key}", f"irismesh_{key}_total"}
    families = {
        "dropped_": "irismesh_dropped_total",
        "peers_down_": "irismesh_peers_down_total",
        "links_down_": "irismesh_links_down_total",
        "ejections_": "irismesh_ejections_total",
        "dials_failed": "irismesh_dial_failures_total",
        "requests_shed_": "irismesh_requests_shed_total",
        "messages_published": "irismesh_messages_published_total",
        "messages_delivered": "irismesh_messages_delivered_total",
        "messages_unmatched": "irismesh_messages_dropped_total",
        "requests_pending": "irismesh_requests_in_flight",
        "requests_waiting": "irismesh_admission_queue_length",
        "handler_limit": "irismesh_admission_limit",
    }
    found = set(exported)
    return bool(own & found) or any(
        key.startswith(prefix) and family in found for prefix, family in families.items()
    )


def test_nodes_of_one_process_share_an_address_each_under_its_label(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> tuple[Samples, int, str]:
        async with irismesh.Node("db", keyring=keys, name="same", metrics="127.0.0.1:0") as one:
            # The second finds the address in the environment: the same endpoint, shared.
            monkeypatch.setenv("IRISMESH_METRICS", one.metrics_address)
            async with irismesh.Node(keyring=keys, name="same", seeds=[one.endpoint]) as two:
                assert two.metrics_address == one.metrics_address
                _, text = await scrape(one.metrics_address)
                missing, _ = await scrape(one.metrics_address, "/nothing")
            _, alone = await scrape(one.metrics_address)
            return samples(text), missing, alone

    found, missing, alone = asyncio.run(asyncio.wait_for(main(), 30))
    labels = {dict(ls)["node"] for name, ls in found if name == "irismesh_members"}
    assert len(labels) == 2, labels
    assert "same" in labels, labels
    assert missing == 404
    assert {dict(ls).get("node") for _, ls in samples(alone) if ls} == {"same"}


def test_the_endpoint_closes_with_its_last_node(keys: irismesh.Keyring) -> None:
    async def main() -> str:
        async with irismesh.Node(keyring=keys, metrics="127.0.0.1:0") as node:
            address = node.metrics_address
            assert (await scrape(address))[0] == 200
        return address

    address = asyncio.run(main())
    host, _, port = address.rpartition(":")

    async def dial() -> None:
        await asyncio.open_connection(host, int(port))

    with pytest.raises(ConnectionRefusedError):
        asyncio.run(dial())


@pytest.mark.parametrize("address", ["nowhere:9464", "127.0.0.1:99999", "127.0.0.1:x", ""])
def test_a_bad_metrics_address_is_refused_at_once(keys: irismesh.Keyring, address: str) -> None:
    if not address:  # "" is no metrics at all, not an error
        assert irismesh.Node(keyring=keys, metrics="").metrics_address == ""
        return
    with pytest.raises(irismesh.ConfigurationError, match="bad metrics address"):
        irismesh.Node(keyring=keys, metrics=address)


def test_an_address_in_use_is_a_configuration_error(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            node = irismesh.Node(keyring=keys, metrics=f"127.0.0.1:{port}")
            with pytest.raises(irismesh.ConfigurationError, match="cannot serve metrics"):
                await node.start()
        finally:
            server.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_import_irismesh_does_not_import_the_prometheus_client() -> None:
    code = "import sys, irismesh; print('prometheus_client' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"


def test_le_bounds_are_powers_of_two_microseconds_from_50us_to_10s() -> None:
    seconds = [float(b) for b in LE_BOUNDS]
    assert seconds[0] <= 50e-6 < seconds[1]
    assert seconds[-2] < 10 <= seconds[-1]
    for low, high in itertools.pairwise(seconds):
        assert math.isclose(high / low, 2, rel_tol=1e-5)


def test_a_blocking_node_serves_metrics_from_its_loop_thread(keys: irismesh.Keyring) -> None:
    import irismesh.sync

    with irismesh.sync.Node("db", keyring=keys, name="blocking", metrics="127.0.0.1:0") as node:
        node.on_request(lambda payload: payload)
        status, text = asyncio.run(scrape(node.metrics_address))
    assert status == 200
    alive = ("irismesh_members", frozenset({("node", "blocking"), ("state", "alive")}))
    assert samples(text)[alive] == 0  # alone in its mesh


def test_the_dashboard_asks_for_metrics_a_node_serves(keys: irismesh.Keyring) -> None:
    dashboard = json.loads((ROOT / "examples" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    asked = {name for expr in exprs for name in re.findall(r"irismesh_[a-z_]+", expr)}

    async def main() -> Samples:
        async with irismesh.Node("db", keyring=keys, metrics="127.0.0.1:0") as member:
            member.on_request(lambda payload: payload)
            async with irismesh.Node(
                keyring=keys, seeds=[member.endpoint], metrics="127.0.0.1:0"
            ) as client:
                await client.wait_for_members("db", timeout=5)
                await client.request("db", b"x")
                async with client.subscribe("news.#"):
                    await member.wait_for_subscribers("news.x", 1, timeout=5)
                    await member.publish("news.x", b"x")
                found = samples((await scrape(member.metrics_address))[1])
                return found | samples((await scrape(client.metrics_address))[1])

    served = names(asyncio.run(asyncio.wait_for(main(), 30)))
    # Counters of node.stats are served from their first count on: none refuted or lost here.
    first_counted = {"irismesh_refutations_total", "irismesh_peers_down_total"}
    assert asked - served <= first_counted, asked - served - first_counted


def test_data_counters_are_exported_held_keys_as_a_gauge_drops_by_reason() -> None:
    from irismesh.telemetry.prometheus import _stats

    stats = {"data_keys_held": 3, "data_merges": 5, "data_dropped_bad_data": 2}
    families = {f.name: f for f in _stats("n1", "", stats)}
    assert families["irismesh_data_keys_held"].type == "gauge"
    assert families["irismesh_data_merges"].type == "counter"
    [sample] = families["irismesh_data_dropped"].samples
    assert sample.labels == {"node": "n1", "reason": "bad_data"}
    assert sample.value == 2
