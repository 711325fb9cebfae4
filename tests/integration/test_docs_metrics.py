"""The metrics page names what a node serves: every metric named in its table is in a real
scrape, with the labels the table gives it (the memory's and the gateways' families, named by
pattern, are left out). A node exports a counter once it has counted something, so the nodes
here call, serve, publish, deliver, give a request up, dial a closed port, get a stranger's
junk datagram and see a member leave."""

from __future__ import annotations

import asyncio
import re
import socket
import urllib.request

import pytest
from docs_blocks import DOCS
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

import irismesh

PAGE = DOCS / "observability" / "metrics.md"
ROW = re.compile(r"^\| (?P<names>`irismesh_[^|]*?) \|(?P<labels>[^|]*)\|", re.MULTILINE)
NAME = re.compile(r"`(irismesh_[a-z_]+)`")


def documented() -> dict[str, set[str]]:
    """Metric (sample) name -> the labels the page gives it, besides `node`."""
    rows: dict[str, set[str]] = {}
    for row in ROW.finditer(PAGE.read_text(encoding="utf-8")):
        labels = {label.strip() for label in row["labels"].split(",") if label.strip()}
        for name in NAME.findall(row["names"]):
            rows[name] = labels
    return rows


def scrape(address: str, into: dict[str, set[str]], sampled: set[str]) -> None:
    """The names a node's scrape exposes, with the labels their samples carry."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        # A counter family is exposed as <name>_total, a histogram as <name>_bucket/_count.
        exposed = f"{family.name}_total" if family.type == "counter" else family.name
        labels = into.setdefault(exposed, set())
        for sample in family.samples:
            sampled.add(exposed)
            labels.update(set(sample.labels) - {"node", "le"})


def test_every_metric_the_page_names_is_served(keys: irismesh.Keyring) -> None:
    async def main() -> tuple[dict[str, set[str]], set[str]]:
        served: dict[str, set[str]] = {}
        sampled: set[str] = set()
        async with irismesh.Node("db", keyring=keys, name="db-1", metrics="127.0.0.1:0") as member:

            @member.on_request
            async def handle(payload: bytes) -> bytes:
                if payload == b"slow":
                    await asyncio.sleep(10)  # cancelled when its caller gives up
                return payload

            @member.on_broadcast
            async def flush(payload: bytes) -> None:
                pass

            @member.on_tunnel
            async def echo(tunnel: irismesh.Tunnel) -> None:
                async for message in tunnel:
                    await tunnel.send(message)

            closed = socket.socket()
            closed.bind(("127.0.0.1", 0))
            nobody = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
            closed.close()  # a port nothing listens on: a dial there is refused
            async with irismesh.Node(
                keyring=keys, seeds=[member.endpoint, nobody], name="client", metrics="127.0.0.1:0"
            ) as client:
                await client.wait_for_members("db", timeout=5)
                await client.request("db", b"ping")
                given_up = asyncio.ensure_future(client.request("db", b"slow", timeout=5))
                await wait_until(lambda: member.stats["handlers_running"] == 1, 5, "the handler")
                given_up.cancel()  # the caller gives up: its member hears so and cancels
                with pytest.raises(asyncio.CancelledError):
                    await given_up
                async with irismesh.Node("db", keyring=keys, seeds=[member.endpoint]) as second:
                    second.on_request(lambda payload: payload)
                    await client.wait_for_members("db", 2, timeout=5)  # a link to it, then it goes
                host, port = member.endpoint.removeprefix("tcp://").rsplit(":", 1)
                # Membership's datagrams come to the link port's number: a junk one is dropped.
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
                    stranger.sendto(b"\xff" * 64, (host, int(port)))
                    await wait_until(
                        lambda: any(k.startswith("dropped_") for k in member.stats), 5, "a drop"
                    )
                await wait_until(
                    lambda: (
                        "requests_cancelled" in member.stats
                        and any(k.startswith("peers_down_") for k in member.stats)
                        and any(k.startswith("links_down_") for k in client.stats)
                        and any(k.startswith("dials_failed_") for k in client.stats)
                    ),
                    5,
                    "a cancelled request, a peer and its link gone, a dial refused",
                )
                await client.broadcast("db", b"flush")
                await client.survey("db", b"status?", timeout=1.0)
                async with client.tunnel("db", timeout=5) as tunnel:
                    await tunnel.send(b"x")
                    await tunnel.recv()
                async with member.subscribe("feeds.#") as subscription:
                    await client.wait_for_subscribers("feeds.world", timeout=5)
                    await client.publish("feeds.world", b"news")
                    await subscription.get(timeout=5)
                for node in (member, client):
                    address = node.metrics_address
                    assert address is not None
                    await asyncio.to_thread(scrape, address, served, sampled)
        return served, sampled

    named = documented()
    assert len(named) >= 25
    served, sampled = asyncio.run(asyncio.wait_for(main(), 30))
    missing = sorted(name for name in named if name not in served)
    assert missing == [], f"{missing} not in {sorted(served)}"
    # Labels show in samples: a family with none yet (no shed request, no peer down) has none.
    unlabelled = {
        name: sorted(labels - served[name])
        for name, labels in named.items()
        if name in sampled and labels - served[name]
    }
    assert unlabelled == {}
