"""Two meshes in two segments that multicast does not cross, joined only through gateways.

One bridge carries every host, and an nft `bridge` table in its namespace makes two segments
of it: nothing passes between them but the gateways' link (TCP to port 7600, and ARP) between
the hosts of each gateway pair. Each mesh has its own keyring and finds itself by survey on
its own segment. An outage is a second table that drops the gateway pair's traffic too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from netlab import Lab, MeshProcess, built_lab, unavailable

import irismesh

FEDNODE = Path(__file__).resolve().parent / "fednode.py"
LINK_PORT = 7600


@pytest.fixture
def fedlab(tmp_path: Path, keyfile: Path, request: pytest.FixtureRequest) -> Iterator[Lab]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    if not Path("/usr/sbin/nft").exists() and not Path("/sbin/nft").exists():
        pytest.skip("`nft` is not installed (Debian: apt-get install -y nftables)")
    with built_lab(request.param, tmp_path, keyfile) as lab:
        yield lab


def keys(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.keys"
    irismesh.Keyring.generate().save(path)
    return str(path)


def segments(
    lab: Lab, a: Iterable[str], b: Iterable[str], pairs: Iterable[tuple[str, str]]
) -> None:
    """Cut the bridge into segments a and b, but for each (listener, dialler) gateway pair."""
    port = {name: host.port_name for name, host in lab.hosts.items()}
    rules = []
    for listener, dialler in pairs:
        x, y = port[listener], port[dialler]
        rules += [
            f'iifname "{x}" oifname "{y}" ether type arp accept',
            f'iifname "{y}" oifname "{x}" ether type arp accept',
            f'iifname "{y}" oifname "{x}" tcp dport {LINK_PORT} accept',
            f'iifname "{x}" oifname "{y}" tcp sport {LINK_PORT} accept',
        ]
    side_a = ", ".join(f'"{port[n]}"' for n in a)
    side_b = ", ".join(f'"{port[n]}"' for n in b)
    rules += [
        f"iifname {{ {side_a} }} oifname {{ {side_b} }} drop",
        f"iifname {{ {side_b} }} oifname {{ {side_a} }} drop",
    ]
    body = "\n    ".join(rules)
    lab.nft(
        lab.switch,
        "table bridge segments {\n"
        "  chain cut { type filter hook forward priority 0; policy accept;\n"
        f"    {body}\n"
        "  }\n"
        "}\n",
    )


def outage(lab: Lab, x: str, y: str) -> Callable[[], None]:
    """Drop everything between hosts x and y; returns what heals it."""
    px, py = lab.hosts[x].port_name, lab.hosts[y].port_name
    lab.nft(
        lab.switch,
        "table bridge outage {\n"
        "  chain cut { type filter hook forward priority -10; policy accept;\n"
        f'    iifname "{px}" oifname "{py}" drop\n'
        f'    iifname "{py}" oifname "{px}" drop\n'
        "  }\n"
        "}\n",
    )
    return lambda: lab.nft(lab.switch, "delete table bridge outage\n")


def start(lab: Lab, name: str, keyfile: str, *args: str) -> MeshProcess:
    host = lab.hosts[name]
    argv = [sys.executable, str(FEDNODE), "--name", name, "--addr", host.addr, "--keys", keyfile]
    node = MeshProcess(host, [*argv, *args], lab.env, lab.workdir)
    lab.nodes[name] = node
    node.wait_ready(time.monotonic() + 20)
    return node


def gateway(lab: Lab, name: str, mesh: str, keyfile: str, link: str, *args: str) -> MeshProcess:
    return start(lab, name, keyfile, "--gateway", mesh, "--link-keys", link, *args)


def listen(lab: Lab, name: str) -> str:
    return f"tcp://{lab.hosts[name].addr}:{LINK_PORT}"


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


pytestmark = pytest.mark.netns


@pytest.mark.parametrize("fedlab", [("a1", "a2", "ga1", "ga2", "gb1", "gb2", "cb")], indirect=True)
def test_two_gateways_sigkill_of_one_under_load_loses_no_request(
    fedlab: Lab, tmp_path: Path, report: Callable[[str], None]
) -> None:
    lab = fedlab
    a, b, link = keys(tmp_path, "a"), keys(tmp_path, "b"), keys(tmp_path, "link")
    segments(
        lab, ["a1", "a2", "ga1", "ga2"], ["gb1", "gb2", "cb"], [("ga1", "gb1"), ("ga2", "gb2")]
    )
    start(lab, "a1", a, "--cluster", "db")
    start(lab, "a2", a, "--cluster", "db")
    for i in ("1", "2"):
        gateway(lab, f"ga{i}", "a", a, link, "--listen", listen(lab, f"ga{i}"), "--export", "db")
        gateway(lab, f"gb{i}", "b", b, link, "--peer", listen(lab, f"ga{i}"))
    client = start(lab, "cb", b)
    for i in ("1", "2"):
        wait_for(lambda i=i: lab.nodes[f"gb{i}"].call("stats")["imports"] == ["db"], 20, "imports")
    # Both gateways' members of db known to the client before one dies: with one alone known,
    # its death leaves the client no member to go to (NoResponders at once, by design).
    client.call("members", timeout=25, cluster="db", count=2, wait=20)
    total = 4000
    asked = client.send("requests", count=total, concurrency=48, timeout=10, cluster="db")
    wait_for(lambda: client.call("progress")["done"] >= total // 4, 60, "a quarter done")
    lab.nodes["gb1"].signal(signal.SIGKILL)
    result = client.reply(asked, 120)
    assert result["ok"], result
    assert result["failed"] == 0, result["errors"]
    assert result["wrong"] == 0
    resent = result["stats"].get("requests_resent", 0)
    report(f"{total} requests through two gateway pairs, gb1 SIGKILLed: 0 failed, {resent} resent")


@pytest.mark.parametrize("fedlab", [("p", "ga", "gb", "s")], indirect=True)
def test_a_ten_second_outage_buffers_to_the_bound_and_counts_the_rest(
    fedlab: Lab, tmp_path: Path, report: Callable[[str], None]
) -> None:
    lab = fedlab
    a, b, link = keys(tmp_path, "a"), keys(tmp_path, "b"), keys(tmp_path, "link")
    segments(lab, ["p", "ga"], ["gb", "s"], [("ga", "gb")])
    bound = 3000
    publisher = start(lab, "p", a)
    ga = gateway(
        lab, "ga", "a", a, link, "--listen", listen(lab, "ga"), "--topics", "feeds.#",
        "--buffer", str(bound),
    )  # fmt: skip
    gateway(lab, "gb", "b", b, link, "--peer", listen(lab, "ga"))
    subscriber = start(lab, "s", b, "--subscribe", "feeds.#")
    wait_for(lambda: ga.call("stats")["stats"]["links_up"] == 1, 20, "the link")
    time.sleep(1.0)  # the subscriber's interest reaches gb
    count, rate = 14000, 1000
    publishing = publisher.send("publish", topic="feeds.x", count=count, rate=rate)
    wait_for(lambda: subscriber.call("received")["count"] >= 1500, 20, "messages flowing")
    heal = outage(lab, "ga", "gb")
    cut_at = time.monotonic()
    time.sleep(10)
    down = ga.call("stats")["stats"]
    heal()
    healed_at = time.monotonic()
    wait_for(lambda: ga.call("stats")["stats"]["links_up"] == 1, 20, "the link back")
    back = time.monotonic() - healed_at
    report(
        f"outage of {healed_at - cut_at:.1f} s: ga buffered {down['link_buffered']}, dropped"
        f" {down.get('link_dropped_buffer_full', 0)}; link up again {back:.2f} s after the heal"
    )
    done = publisher.reply(publishing, 60)
    assert done["ok"], done

    def settled() -> bool:
        stats = ga.call("stats")["stats"]
        got = subscriber.call("received")["count"]
        return stats["link_buffered"] == 0 and got + stats["link_dropped_buffer_full"] == count

    wait_for(settled, 30, "the buffered messages to arrive")
    got = subscriber.call("received")
    dropped = ga.call("stats")["stats"]["link_dropped_buffer_full"]
    assert got["in_order"], got
    assert got["distinct"] == got["count"]
    assert dropped > 0  # ten seconds at 1000/s is more than the bound
    assert got["count"] + dropped == count
    # mesh top, run in segment a, shows the same count.
    top = ["ip", "netns", "exec", lab.hosts["p"].ns, sys.executable, "-m", "irismesh", "top"]
    top += ["--once", "--json", "--keys", a, "--interface", lab.hosts["p"].addr, "--survey"]
    top += ["--wait", "3"]
    frame = json.loads(
        subprocess.run(top, capture_output=True, text=True, check=True, timeout=60).stdout
    )
    [view] = frame["gateways"]
    assert view["stats"]["link_dropped_buffer_full"] == dropped
    report(
        f"{count} published at {rate}/s: {got['count']} "
        f"arrived in order once, {dropped} dropped beyond the bound of {bound} (mesh top agrees)"
    )


@pytest.mark.parametrize("fedlab", [("p", "ga", "gb", "s")], indirect=True)
def test_messages_cross_a_lossy_gateway_link_once_and_in_order(
    fedlab: Lab, tmp_path: Path, report: Callable[[str], None]
) -> None:
    lab = fedlab
    a, b, link = keys(tmp_path, "a"), keys(tmp_path, "b"), keys(tmp_path, "link")
    segments(lab, ["p", "ga"], ["gb", "s"], [("ga", "gb")])
    publisher = start(lab, "p", a)
    ga = gateway(lab, "ga", "a", a, link, "--listen", listen(lab, "ga"), "--topics", "feeds.#")
    gateway(lab, "gb", "b", b, link, "--peer", listen(lab, "ga"))
    subscriber = start(lab, "s", b, "--subscribe", "feeds.#")
    wait_for(lambda: ga.call("stats")["stats"]["links_up"] == 1, 20, "the link")
    time.sleep(1.0)  # the subscriber's interest reaches gb
    how = lab.loss("gb", 10, "nft")
    count = 5000
    done = publisher.call("publish", timeout=60, topic="feeds.x", count=count, rate=1000)
    wait_for(lambda: subscriber.call("received")["count"] >= count, 60, "every message")
    time.sleep(0.5)
    got = subscriber.call("received")
    stats = ga.call("stats")["stats"]
    assert got["count"] == count
    assert got["distinct"] == count
    assert got["in_order"]
    assert stats.get("link_dropped_buffer_full", 0) == 0
    report(
        f"{count} messages at 1000/s in {done['seconds']:.1f} s over a gateway link losing 10%"
        f" ({how}): all arrived once, in order; link downs {stats.get('link_downs', 0)},"
        f" resent {stats.get('link_resends', 0)}"
    )


@pytest.mark.parametrize("fedlab", [("a1", "ga", "gb", "cb")], indirect=True)
def test_a_tunnel_crosses_the_segments_in_order_and_a_killed_member_resets_it(
    fedlab: Lab, tmp_path: Path, report: Callable[[str], None]
) -> None:
    lab = fedlab
    a, b, link = keys(tmp_path, "a"), keys(tmp_path, "b"), keys(tmp_path, "link")
    segments(lab, ["a1", "ga"], ["gb", "cb"], [("ga", "gb")])
    start(lab, "a1", a, "--cluster", "db")
    gateway(lab, "ga", "a", a, link, "--listen", listen(lab, "ga"), "--export", "db")
    gb = gateway(lab, "gb", "b", b, link, "--peer", listen(lab, "ga"))
    wait_for(lambda: gb.call("stats")["imports"] == ["db"], 20, "the import")
    client = start(lab, "cb", b)
    size = 32 << 20
    done = client.call("tunnel", timeout=120, cluster="db", size=size, block=64 << 10)
    assert done["bytes"] == size, done
    report(
        f"{size >> 20} MiB echoed in order through a tunnel across two segments and a gateway"
        f" pair in {done['seconds']:.2f} s ({size / done['seconds'] / 1e6:.0f} MB/s each way)"
    )
    # A long stream; the member in segment a is SIGKILLed under it: the caller's tunnel resets.
    streaming = client.send("tunnel", cluster="db", size=8 << 30, block=64 << 10)
    before = client.call("progress")["done"]
    wait_for(lambda: client.call("progress")["done"] > before + (8 << 20), 30, "the stream")
    killed_at = time.monotonic()
    lab.nodes["a1"].signal(signal.SIGKILL)
    answer = client.reply(streaming, 30)
    took = time.monotonic() - killed_at
    assert not answer["ok"]
    assert answer["error"].startswith("TunnelReset"), answer
    assert "member is gone" in answer["error"], answer  # the far member's id stays there
    stats = gb.call("stats")["stats"]
    wait_for(lambda: gb.call("stats")["stats"]["tunnels_open"] == 0, 10, "gb's relay to end")
    assert stats["tunnel_buffered_peak"] <= (1 << 20) + (128 << 10), stats
    report(
        f"a1 SIGKILLed under a stream: the caller's tunnel reset {took:.2f} s later"
        f" ({answer['error'][:80]}); gb buffered at most {stats['tunnel_buffered_peak']} bytes"
    )


@pytest.mark.parametrize("fedlab", [("a1", "g", "cb")], indirect=True)
def test_one_gateway_process_with_a_foot_in_each_segment_carries_requests(
    fedlab: Lab, tmp_path: Path, report: Callable[[str], None]
) -> None:
    """Host g reaches both segments (as a host with an interface in each would); a1 and cb
    reach only their own. One process on g is a gateway of mesh a and of mesh b, each finding
    its mesh by survey: cb's requests to a's db cross it, and nothing else joins the meshes."""
    lab = fedlab
    a, b = keys(tmp_path, "a"), keys(tmp_path, "b")
    segments(lab, ["a1"], ["cb"], [])  # g is in neither list: it reaches both
    start(lab, "a1", a, "--cluster", "db")
    start(lab, "g", a, "--gateway", "a", "--export", "db", "--join", "b", "--join-keys", b)
    client = start(lab, "cb", b)
    wait_for(lambda: lab.nodes["g"].call("stats")["imports"] == [[], ["db"]], 20, "db in b")
    total = 2000
    asked = client.send("requests", count=total, concurrency=32, timeout=10, cluster="db")
    result = client.reply(asked, 120)
    assert result["ok"], result
    assert result["failed"] == 0, result["errors"]
    assert result["wrong"] == 0
    stats = lab.nodes["g"].call("stats")["stats"]
    assert stats["b"]["requests_forwarded"] == stats["a"]["requests_served"] == total
    report(f"{total} requests from segment b to segment a through one gateway process: 0 failed")


NODE_PORT, IMPORT_PORTS = 7401, (7410, 7419)  # a gateway's node, its imports' nodes


def fixed(lab: Lab, name: str) -> str:
    return f"tcp://{lab.hosts[name].addr}:{NODE_PORT}"


def two_fixed_pairs(
    lab: Lab, tmp_path: Path
) -> tuple[MeshProcess, MeshProcess, Callable[[int], MeshProcess]]:
    """Mesh east (db member and publisher edb, gateways e1 and e2 listening on the link port)
    and mesh west (gateways w1 and w2 dialling e1 and e2, client and subscriber wc), every
    gateway's node on a fixed port and its imports on a fixed range; returns edb, wc, and
    what starts west gateway i (again)."""
    e, w, link = keys(tmp_path, "e"), keys(tmp_path, "w"), keys(tmp_path, "link")
    segments(lab, ["edb", "e1", "e2"], ["w1", "w2", "wc"], [("e1", "w1"), ("e2", "w2")])
    east = start(lab, "edb", e, "--cluster", "db")
    for i in (1, 2):
        gateway(
            lab, f"e{i}", "east", e, link, "--listen", listen(lab, f"e{i}"), "--export", "db",
            "--topics", "feeds.#", "--bind", fixed(lab, f"e{i}"),
        )  # fmt: skip
    ports = "-".join(map(str, IMPORT_PORTS))

    def west(i: int) -> MeshProcess:
        return gateway(
            lab, f"w{i}", "west", w, link, "--peer", listen(lab, f"e{i}"),
            "--bind", fixed(lab, f"w{i}"), "--import-ports", ports,
        )  # fmt: skip

    for i in (1, 2):
        west(i)
    client = start(lab, "wc", w, "--subscribe", "feeds.#")
    for i in (1, 2):
        imported(lab.nodes[f"w{i}"])
    wait_for(lambda: forwarders(lab) == 1, 20, "one east forwarder")
    return east, client, west


def imported(gw: MeshProcess) -> None:
    """Wait for the west gateway's import of db, its ports the fixed ones, and the
    subscriber's interest in feeds."""
    wait_for(lambda: gw.call("stats")["imports"] == ["db"], 30, f"{gw.name} to import db")
    ports = gw.call("stats")["ports"]
    assert ports[0] == NODE_PORT, ports
    assert all(IMPORT_PORTS[0] <= p <= IMPORT_PORTS[1] for p in ports[1:]), ports
    gw.call("subscribers", timeout=30, topic="feeds.x", wait=20)


def forwarders(lab: Lab) -> int:
    return sum(lab.nodes[n].call("stats")["stats"].get("forwarding", 0) for n in ("e1", "e2"))


def forwarder(lab: Lab) -> str:
    [name] = [n for n in ("e1", "e2") if lab.nodes[n].call("stats")["stats"].get("forwarding", 0)]
    return name


def describe(lab: Lab, client: MeshProcess) -> str:
    """What the subscriber got, and the counters of the gateways still running."""
    out = [f"wc: {client.call('received')}"]
    for name in ("e1", "e2", "w1", "w2"):
        node = lab.nodes[name]
        if node.proc.poll() is None:
            stats = node.call("stats")["stats"]
            keep = {k: v for k, v in stats.items() if not k.startswith(("tunnel", "request"))}
            out.append(f"{name}: {keep}")
    return "\n".join(out)


def west_resends(lab: Lab) -> str:
    """What the west gateways did with resent messages: received, dropped as republished by
    the other, republished unchecked; and how many they republished to no subscriber."""
    keys = (
        "resends_received",
        "resends_dropped_republished_elsewhere",
        "resends_unchecked",
        "republished_to_no_subscriber",
    )
    total = dict.fromkeys(keys, 0)
    for name in ("w1", "w2"):
        stats = lab.nodes[name].call("stats")["stats"]
        for key in keys:
            total[key] += stats.get(key, 0)
    return ", ".join(f"{k} {v}" for k, v in total.items())


def check_exactly_once(
    lab: Lab, east: MeshProcess, client: MeshProcess, publishing: int, asked: int, count: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    done = east.reply(publishing, 90)
    assert done["ok"], done
    deadline = time.monotonic() + 60
    while client.call("received")["count"] < count:
        if time.monotonic() > deadline:
            pytest.fail(f"not every message arrived: {describe(lab, client)}")
        time.sleep(0.05)
    result = client.reply(asked, 60)
    time.sleep(0.5)  # a double would come now
    got = client.call("received")
    assert result["ok"], result
    assert result["failed"] == 0, result["errors"]
    assert result["wrong"] == 0
    assert got["count"] == got["distinct"] == count, describe(lab, client)
    assert got["in_order"], describe(lab, client)
    return result, got


@pytest.mark.parametrize("fedlab", [("edb", "e1", "e2", "w1", "w2", "wc")], indirect=True)
def test_fixed_ports_a_west_gateway_then_the_east_forwarder_sigkilled_under_load(
    fedlab: Lab, tmp_path: Path, report: Callable[[str], None]
) -> None:
    """Two gateway pairs on fixed ports; under requests and published messages, the west
    gateway on the forwarder's link is SIGKILLed and restarted on the same ports, then the
    east forwarder is SIGKILLed: no request fails, and the west subscriber gets every message
    once, in order."""
    lab = fedlab
    east, client, west = two_fixed_pairs(lab, tmp_path)
    count, rate = 6000, 400
    publishing = east.send("publish", topic="feeds.x", count=count, rate=rate)
    asked = client.send(
        "requests", count=10**9, concurrency=16, timeout=10, cluster="db",
        seconds=count / rate + 2,
    )  # fmt: skip
    wait_for(lambda: client.call("received")["count"] >= 1000, 30, "messages flowing")
    victim = "w1" if forwarder(lab) == "e1" else "w2"
    old = lab.nodes[victim]
    old.signal(signal.SIGKILL)
    old.proc.wait(10)
    restarted = west(int(victim[1]))  # the same fixed ports, at once
    imported(restarted)
    at = client.call("received")["count"]
    wait_for(lambda: client.call("received")["count"] >= at + 600, 30, "messages after it")
    killed = forwarder(lab)
    lab.nodes[killed].signal(signal.SIGKILL)
    result, _got = check_exactly_once(lab, east, client, publishing, asked, count)
    stats = result["stats"]
    report(
        f"{victim} SIGKILLed and restarted on its fixed ports, then {killed} (the east"
        f" forwarder): {result['done']} requests, 0 failed, longest wait {result['slowest']:.2f}"
        f" s; {count} messages at {rate}/s each once in order"
        f" ({stats.get('messages_duplicates_dropped', 0)} copies dropped by the subscriber;"
        f" west gateways: {west_resends(lab)})"
    )


@pytest.mark.parametrize("fedlab", [("edb", "e1", "e2", "w1", "w2", "wc")], indirect=True)
def test_fixed_ports_a_ten_second_outage_of_the_forwarders_link_under_load(
    fedlab: Lab, tmp_path: Path, report: Callable[[str], None]
) -> None:
    lab = fedlab
    east, client, _west = two_fixed_pairs(lab, tmp_path)
    count, rate = 6000, 400
    publishing = east.send("publish", topic="feeds.x", count=count, rate=rate)
    asked = client.send(
        "requests", count=10**9, concurrency=16, timeout=10, cluster="db",
        seconds=count / rate + 2,
    )  # fmt: skip
    wait_for(lambda: client.call("received")["count"] >= 800, 30, "messages flowing")
    cut = forwarder(lab)
    heal = outage(lab, cut, "w" + cut[1])
    time.sleep(10)
    heal()
    result, _got = check_exactly_once(lab, east, client, publishing, asked, count)
    stats = result["stats"]
    report(
        f"10 s outage of {cut}'s link: {result['done']} requests, 0 failed, longest wait"
        f" {result['slowest']:.2f} s; {count} messages at {rate}/s each once in order"
        f" ({stats.get('messages_duplicates_dropped', 0)} copies dropped by the subscriber;"
        f" west gateways: {west_resends(lab)})"
    )
