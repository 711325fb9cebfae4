"""`mesh top`: a live view of the peers, clusters and counters of one node of the mesh.

Rates are deltas of `node.stats` counters and of the telemetry's exact message counts over each
refresh interval; gauges (requests pending, handlers running, reply cache entries) are shown as
they are. The node is `mesh top`'s own: it sees every peer and their clusters, but only its own
counters (the members' own rates need them to report, as a survey answer for instance).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import msgpack
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

import irismesh
from irismesh._cli.base import (
    Commands,
    add_command,
    add_joining_options,
    add_json_option,
    add_repeatable,
    client_keyring,
    make_node,
    print_json,
    seconds,
    settle,
    short_id,
    stdout_console,
    stop_on_signals,
    where,
)
from irismesh._cli.listing import (
    ClusterView,
    add_cluster_option,
    cluster_json,
    cluster_names,
    clusters_table,
    nobody_answered,
    peer_json,
    peers_table,
    served_by,
    view_clusters,
)
from irismesh.federation import GATEWAY_CLUSTER
from irismesh.spark_telemetry.units import duration_us

GAUGES = frozenset(
    {
        "requests_pending",
        "handlers_running",
        "reply_cache_entries",
        "requests_waiting",
        "handler_limit",
        "strangers_connected",
        "members_ejected_now",
        "data_keys_held",
    }
)


def register(commands: Commands) -> None:
    parser = add_command(
        commands,
        "top",
        summary="a live view of peers, clusters and message rates",
        description=(
            "Joins the mesh as a client and redraws every --interval seconds: this node's\n"
            "peers (name, endpoint, RTT, latency, requests in flight, clusters served), the\n"
            "clusters its keyring can open (members, load, latency; see `mesh clusters --help`\n"
            "for which those are), and its counters with their rates per second. q or Ctrl-C\n"
            "quits. --once gathers for at most --wait seconds, prints one frame and exits; --json\n"
            "prints one JSON object per frame (JSON lines) instead of drawing."
        ),
        examples=(
            "  mesh top\n"
            "  mesh top --cluster echo --interval 0.5\n"
            "  mesh top --once --json | jq '.peers | length'\n"
            "  mesh top --subscribe 'orders.#'\n"
            "  mesh top --data 'quota.#'"
        ),
        run=run_top,
    )
    parser.add_argument(
        "--interval",
        type=seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds between frames (default: %(default)s)",
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    add_repeatable(
        parser,
        "--subscribe",
        metavar="PATTERN",
        help=(
            "also subscribe to PATTERN (repeatable; messages are counted, then dropped), so the"
            " latency table shows publish-to-deliver times per topic scope"
        ),
    )
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="PATTERN",
        help=(
            "also hold the replicated data keys matching PATTERN (repeatable; topic wildcards,"
            " e.g. 'quota.#'), found as their holders' digests arrive (within about 10 s), and"
            " show them with their values; the data_* counters show merges, deltas and bytes"
        ),
    )
    add_cluster_option(parser)
    add_joining_options(parser, wait=2.0, wait_help="--once: most seconds to gather peers")
    add_json_option(parser, "JSON lines, one object per frame")


@dataclass(frozen=True, slots=True, kw_only=True)
class Rate:
    name: str
    value: int
    per_second: float | None  # None for a gauge


@dataclass(frozen=True, slots=True, kw_only=True)
class Frame:
    node_id: str
    endpoint: str
    uptime: float
    peers: list[irismesh.PeerInfo]
    clusters: list[ClusterView]
    counters: list[Rate]
    latency: list[Latency]
    gateways: list[GatewayView] = field(default_factory=list)
    data: list[DataView] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataView:
    """One replicated data key this node holds (`--data`), and its value here."""

    key: str
    type: str
    value: object


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayView:
    """One gateway of this mesh, as it answered the `_gateway` cluster: its links' state and
    what it forwarded, buffered and dropped."""

    name: str
    mesh: str
    links_up: int
    links: int
    buffered: int
    dropped: int
    duplicates: int
    forwarded: int
    stats: dict[str, int]
    errors: tuple[str, ...] = ()  # imports that could not start, and why


@dataclass(frozen=True, slots=True, kw_only=True)
class Latency:
    """What this node timed of one kind and cluster (a topic scope for deliveries)."""

    kind: str
    cluster: str
    timed: int
    p50_us: float
    p99_us: float


class Sampler:
    """Takes frames of one node; each frame's rates cover the time since the previous one."""

    def __init__(self, node: irismesh.Node, names: Sequence[str]) -> None:
        self.node = node
        self.names = names
        self.data = False  # whether this node holds data keys for `--data`
        self.started = time.monotonic()
        self._last = counters(node)
        self._last_at = self.started

    def sample(self, gateways: list[GatewayView] | None = None) -> Frame:
        node = self.node
        now = time.monotonic()
        stats = counters(node)
        peers = node.peers(departed=True)  # the dead and departed show, in red, until they return
        frame = Frame(
            node_id=node.node_id.hex(),
            endpoint=node.endpoint,
            uptime=now - self.started,
            peers=peers,
            clusters=view_clusters(node, self.names, peers),
            counters=rates(self._last, stats, now - self._last_at),
            latency=latencies(node),
            gateways=gateways or [],
            data=data_views(node) if self.data else [],
        )
        self._last, self._last_at = stats, now
        return frame


async def gateway_views(
    node: irismesh.Node, timeout: float, *, wait: bool = False
) -> list[GatewayView]:
    """Ask this mesh's gateways (members of `_gateway`) for their counters; [] if none, or if
    this keyring cannot name that cluster. `wait`: for a first gateway, up to `timeout`."""
    if node.keyring.primary(GATEWAY_CLUSTER) is None:
        return []
    if wait:
        if not node.known_members(GATEWAY_CLUSTER):  # membership knows of none: no wait
            return []
        try:
            await node.wait_for_members(GATEWAY_CLUSTER, timeout=timeout)
        except irismesh.MeshError:
            return []
    elif not node.members(GATEWAY_CLUSTER):  # asking opens links: the next frame has them
        return []
    try:
        result = await node.survey(GATEWAY_CLUSTER, b"", timeout=timeout)
    except irismesh.MeshError:
        return []
    views = []
    for answer in result.answers.values():
        try:
            report = msgpack.unpackb(answer, raw=False)
            stats = {str(k): int(v) for k, v in report["stats"].items()}
            views.append(
                GatewayView(
                    name=str(report["name"]),
                    mesh=str(report["mesh"]),
                    links_up=stats.get("links_up", 0),
                    links=stats.get("links", 0),
                    buffered=stats.get("link_buffered", 0),
                    dropped=stats.get("link_dropped_buffer_full", 0),
                    duplicates=stats.get("duplicates_dropped", 0),
                    forwarded=stats.get("requests_forwarded", 0),
                    stats=stats,
                    errors=tuple(str(e) for e in report.get("errors", ())),
                )
            )
        except (ValueError, KeyError, TypeError, AttributeError, msgpack.ExtraData):
            continue  # not a gateway's report: shown nowhere
    return sorted(views, key=lambda v: v.name)


def data_views(node: irismesh.Node) -> list[DataView]:
    """The data keys this node holds, with their values as this node has merged them."""
    kinds, values = node.data.keys(), node.data.values()
    return [
        DataView(key=key, type=_TYPE_NAMES.get(kind, kind), value=values[key])
        for key, kind in sorted(kinds.items())
    ]


_TYPE_NAMES = {
    "PNCounter": "counter",
    "ORSet": "set",
    "LWWRegister": "register",
    "Flag": "flag",
    "ORMap": "map",
}


def data_json(value: object) -> object:
    """A data value as JSON holds it: sets as sorted lists, bytes as text or hex."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value.hex()
    if isinstance(value, frozenset | set):
        return sorted((data_json(v) for v in value), key=str)
    if isinstance(value, dict):
        return {str(data_json(k)): data_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [data_json(v) for v in value]
    return value


def counters(node: irismesh.Node) -> dict[str, int]:
    """`node.stats`, and the telemetry's exact message counts as `KIND CLUSTER OUTCOME`."""
    values = dict(node.stats)
    if node.recorder is not None:
        for (kind, cluster, outcome), count in node.recorder.counts.items():
            values[f"{kind} {cluster} {outcome}"] = count
    return values


def latencies(node: irismesh.Node) -> list[Latency]:
    """p50 and p99 of what this node timed: round trips of its calls, its handlers' service
    times, and publish-to-deliver times of the messages it received that their publishers
    stamped (publisher's clock to this node's: across hosts, their skew is in it)."""
    recorder = node.recorder
    if recorder is None:
        return []
    out = []
    for (kind, cluster), histogram in sorted(recorder.histograms.items()):
        timed = sum(histogram)
        p50 = recorder.percentile(kind, cluster, 0.5)
        p99 = recorder.percentile(kind, cluster, 0.99)
        if timed and p50 is not None and p99 is not None:
            out.append(Latency(kind=kind, cluster=cluster, timed=timed, p50_us=p50, p99_us=p99))
    return out


def rates(before: Mapping[str, int], after: Mapping[str, int], elapsed: float) -> list[Rate]:
    out = []
    for name in sorted(after):
        value = after[name]
        if name in GAUGES:
            out.append(Rate(name=name, value=value, per_second=None))
        else:
            delta = value - before.get(name, 0)
            out.append(Rate(name=name, value=value, per_second=delta / max(elapsed, 1e-9)))
    return out


def frame_json(frame: Frame) -> dict[str, object]:
    served = served_by(frame.clusters)
    return {
        "node_id": frame.node_id,
        "endpoint": frame.endpoint,
        "uptime_s": round(frame.uptime, 3),
        "peers": [peer_json(p, served.get(p.node_id, [])) for p in frame.peers],
        "clusters": [cluster_json(view) for view in frame.clusters],
        "stats": {
            r.name: {
                "value": r.value,
                "per_second": None if r.per_second is None else round(r.per_second, 3),
            }
            for r in frame.counters
        },
        "latency": [
            {
                "kind": x.kind,
                "cluster": x.cluster,
                "timed": x.timed,
                "p50_us": round(x.p50_us, 1),
                "p99_us": round(x.p99_us, 1),
            }
            for x in frame.latency
        ],
        "gateways": [
            {"name": g.name, "mesh": g.mesh, "stats": g.stats, "errors": list(g.errors)}
            for g in frame.gateways
        ],
        "data": [{"key": d.key, "type": d.type, "value": data_json(d.value)} for d in frame.data],
    }


def render(frame: Frame, args: argparse.Namespace, live: bool) -> RenderableType:
    header = Text.assemble(
        ("mesh top", "bold"),
        f"  node {short_id(frame.node_id)} on {frame.endpoint}",
        f"  up {frame.uptime:.0f} s",
        f"  every {args.interval:g} s" if live else "",
        ("   q or Ctrl-C quits" if live else "", "dim"),
    )
    parts: list[RenderableType] = [header]
    if frame.peers:
        parts.append(peers_table(frame.peers, served_by(frame.clusters)))
    else:
        parts.append(Text(f"no peers yet: looking via {where(args)}", style="yellow"))
    if frame.clusters:
        parts.append(clusters_table(frame.clusters, {p.node_id: p.name for p in frame.peers}))
    if frame.gateways:
        parts.append(gateways_table(frame.gateways))
        for g in frame.gateways:
            for error in g.errors:
                parts.append(Text(f"gateway {g.name}: {error}", style="bold red"))
    if frame.data:
        parts.append(data_table(frame.data))
    if frame.latency:
        parts.append(latency_table(frame.latency))
    parts.append(counters_table(frame.counters))
    return Group(*parts)


def gateways_table(rows: Sequence[GatewayView]) -> Table:
    table = Table(title="this mesh's gateways", title_justify="left")
    for name in ("gateway", "mesh", "links up", "buffered", "dropped", "duplicates"):
        table.add_column(name, justify="left" if name in ("gateway", "mesh") else "right")
    table.add_column("requests forwarded", justify="right")
    for g in rows:
        dropped = Text(f"{g.dropped:,}", style="red" if g.dropped else "")
        table.add_row(
            g.name,
            g.mesh,
            f"{g.links_up}/{g.links}",
            f"{g.buffered:,}",
            dropped,
            f"{g.duplicates:,}",
            f"{g.forwarded:,}",
        )
    return table


def data_table(rows: Sequence[DataView]) -> Table:
    table = Table(title="data held (--data)", title_justify="left")
    table.add_column("key")
    table.add_column("type")
    table.add_column("value")
    for d in rows:
        table.add_row(d.key, d.type, Text(_shorten(repr(data_json(d.value)), 80)))
    return table


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def latency_table(rows: Sequence[Latency]) -> Table:
    table = Table(title="this node's latency", title_justify="left")
    table.add_column("kind")
    table.add_column("cluster or topic scope")
    table.add_column("timed", justify="right")
    table.add_column("p50", justify="right")
    table.add_column("p99", justify="right")
    for x in rows:
        table.add_row(
            x.kind, x.cluster, f"{x.timed:,}", duration_us(x.p50_us), duration_us(x.p99_us)
        )
    return table


def counters_table(counters: Sequence[Rate]) -> Table:
    table = Table(title="this node's counters", title_justify="left")
    table.add_column("counter")
    table.add_column("value", justify="right")
    table.add_column("per s", justify="right")
    for r in counters:
        rate = "gauge" if r.per_second is None else f"{r.per_second:.1f}"
        table.add_row(r.name, str(r.value), rate)
    return table


@contextlib.contextmanager
def keypresses(loop: asyncio.AbstractEventLoop, quit_: Callable[[], None]) -> Iterator[None]:
    """Call `quit_` when q is pressed on a terminal's stdin (read key by key meanwhile)."""
    if not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)  # keys arrive one by one, unechoed; Ctrl-C still sends SIGINT

    def on_input() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data or b"q" in data.lower():  # no data: the terminal hung up
            quit_()

    loop.add_reader(fd, on_input)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def run_top(args: argparse.Namespace) -> int:
    keys = client_keyring(args)
    names = cluster_names(keys, args.cluster)
    async with make_node(args, keys) as node:
        for pattern in args.subscribe:
            node.subscribe(pattern, policy="drop_oldest", maxsize=1, callback=lambda _m: None)
        sampler = Sampler(node, names)
        for pattern in args.data:
            try:
                node.data.watch(pattern, maxsize=1)  # holds the keys it matches
            except irismesh.MeshError as exc:
                raise SystemExit(f"mesh top: --data {pattern}: {exc}") from None
            sampler.data = True
        console = stdout_console()
        probe = min(0.5, args.interval / 2)  # how long each frame waits for the gateways
        if args.once:
            await settle(node, args.wait)
            frame = sampler.sample(await gateway_views(node, max(args.wait, 0.5), wait=True))
            if not frame.peers and args.seed:
                raise nobody_answered(args)
            if args.json:
                print_json(frame_json(frame))
            else:
                console.print(render(frame, args, live=False))
            return 0
        stop = stop_on_signals()

        async def tick() -> bool:
            """Wait one interval; False once asked to stop."""
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.interval)
            return not stop.is_set()

        if args.json:
            while True:
                print_json(frame_json(sampler.sample(await gateway_views(node, probe))))
                if not await tick():
                    return 0
        if not console.is_terminal:  # batch mode, like `top -b`: frame after frame
            while True:
                console.print(
                    render(sampler.sample(await gateway_views(node, probe)), args, live=False)
                )
                if not await tick():
                    return 0
        with (
            keypresses(asyncio.get_running_loop(), stop.set),
            Live(console=console, screen=True, auto_refresh=False) as view,
        ):
            while True:
                frame = sampler.sample(await gateway_views(node, probe))
                view.update(render(frame, args, live=True), refresh=True)
                if not await tick():
                    return 0
