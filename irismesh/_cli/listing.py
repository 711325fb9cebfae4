"""`mesh peers` and `mesh clusters`: the mesh as one node sees it (`mesh top` reuses the views).

The clusters shown are those `Node.clusters()` finds (nodes' survey datagrams name their
clusters sealed under the keys that open them, so a keyring lists what it can open: with a
'*' key, every cluster of the nodes holding it), plus the keyring's own scopes and those named
with --cluster, shown even while they have no member.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rich.markup import escape
from rich.table import Table

import irismesh
from irismesh._cli.base import (
    USAGE_ERROR,
    CommandError,
    Commands,
    MeshArgumentParser,
    add_command,
    add_joining_options,
    add_json_option,
    add_repeatable,
    client_keyring,
    cluster_name,
    make_node,
    ms,
    print_json,
    settle,
    short_id,
    stdout_console,
    where,
)
from irismesh.security.keyring import MESH_SCOPE

GATHER_WAIT = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterView:
    """One cluster as this node sees it."""

    name: str
    members: tuple[str, ...]
    outstanding: int  # this node's requests in flight to the cluster's members
    latency_ms: float | None  # mean of the members' measured latency estimates (None: none yet)
    rtt_ms: float | None  # mean heartbeat round trip to the members
    announced: tuple[str, ...] = ()  # members heard of by discovery only, not peers here


def register(commands: Commands) -> None:
    peers = add_command(
        commands,
        "peers",
        summary="list the peers a node finds, with RTT and latency",
        description=(
            "Joins the mesh as a client, gathers peers until the mesh seen from here stops\n"
            "changing (at most --wait seconds) and prints them: node id, name (`mesh node\n"
            "--name`; '-' for a node without one), identity (the start of the public key\n"
            "its id derives from: `mesh grant` names it), endpoint, state\n"
            "(alive; suspect when it fell silent and other peers are asked about it; dead or\n"
            "left for peers seen to go while gathering; 'ejected from C' while this node keeps\n"
            "it out of cluster C's rotation after failures or lagging far behind; 'ejected by\n"
            "N callers (C)' while N nodes of the mesh keep it out of C's rotation, as their\n"
            "membership records say, for the clusters this keyring can open),\n"
            "heartbeat RTT, the balancer's latency estimate, this node's requests in flight,\n"
            "and the clusters it serves among those this keyring can open (nodes announce\n"
            "their clusters sealed under the keys that open them; '*' opens them all)."
        ),
        examples=("  mesh peers\n  mesh peers --json | jq -r '.[].endpoint'"),
        run=run_peers,
    )
    add_joining_options(peers, wait=GATHER_WAIT, wait_help="most seconds to gather peers")
    add_json_option(peers, "a JSON list of peers")

    clusters = add_command(
        commands,
        "clusters",
        summary="list clusters with their members, load and latency",
        description=(
            "Joins the mesh as a client, gathers peers (at most --wait seconds) and prints each\n"
            "cluster: its live members, the requests this node has in flight to them, and the\n"
            "mean latency and RTT to them. The clusters listed are those this keyring can\n"
            "open: nodes announce their cluster names sealed under the keys that open them\n"
            "(a cluster's own key, and the node's '*' key), so a '*' keyring lists every\n"
            "cluster and a keyring with one cluster's key lists that cluster alone; nobody\n"
            "without a key learns a name. The keyring's own scopes and every --cluster are\n"
            "listed even without members. Members heard of only by discovery (nodes of a mesh\n"
            "whose key this keyring lacks) show with state 'announced' in --json."
        ),
        examples=("  mesh clusters\n  mesh clusters --cluster echo --cluster upper --json"),
        run=run_clusters,
    )
    add_cluster_option(clusters)
    add_joining_options(clusters, wait=GATHER_WAIT, wait_help="most seconds to gather peers")
    add_json_option(clusters, "a JSON list of clusters")


def add_cluster_option(parser: MeshArgumentParser) -> None:
    add_repeatable(
        parser,
        "--cluster",
        type=cluster_name,
        metavar="C",
        help="a cluster to look for besides the keyring's own scopes (repeatable)",
    )


def cluster_names(keys: irismesh.Keyring, extra: Iterable[str]) -> list[str]:
    """The clusters this node can recognise: keyring scopes but '*', then --cluster names."""
    names = [scope for scope in keys.scopes if scope not in ("*", MESH_SCOPE)]
    for name in extra:
        keys.require(name)  # raises NoKey: without a key the cluster is invisible
        names.append(name)
    return list(dict.fromkeys(names))


def view_clusters(
    node: irismesh.Node, names: Sequence[str], peers: Sequence[irismesh.PeerInfo]
) -> list[ClusterView]:
    """`names` (shown even without members), then every other cluster `node.clusters()`
    finds, with their members."""
    by_id = {p.node_id: p for p in peers}
    found = node.clusters()
    views = []
    for name in [*names, *(n for n in found if n not in names)]:
        linked = [by_id[m] for m in node.members(name) if m in by_id] if name in names else []
        heard = {p.node_id: by_id.get(p.node_id, p) for p in found.get(name, ())}
        heard.update((p.node_id, p) for p in linked)
        members = list(heard.values())
        views.append(
            ClusterView(
                name=name,
                members=tuple(sorted(m.node_id for m in members)),
                outstanding=sum(m.outstanding for m in members),
                latency_ms=_mean(m.latency_ms for m in members if m.latency_ms > 0),
                rtt_ms=_mean(m.rtt_ms for m in members if m.state != "announced"),
                announced=tuple(sorted(m.node_id for m in members if m.state == "announced")),
            )
        )
    return views


def served_by(views: Iterable[ClusterView]) -> dict[str, list[str]]:
    """node id -> the clusters (of those viewed) it serves."""
    served: dict[str, list[str]] = {}
    for view in views:
        for member in view.members:
            served.setdefault(member, []).append(view.name)
    return served


def measured(latency_ms: float) -> float | None:
    """The balancer's latency estimate; 0 means no request has measured it yet."""
    return round(latency_ms, 3) if latency_ms > 0 else None


def _mean(values: Iterable[float]) -> float | None:
    items = list(values)
    return sum(items) / len(items) if items else None


EjectedBy = Mapping[str, Mapping[str, Sequence[str]]]  # peer id -> cluster -> callers' ids


def peer_json(
    p: irismesh.PeerInfo, clusters: Sequence[str], ejected_by: EjectedBy | None = None
) -> dict[str, object]:
    by = (ejected_by or {}).get(p.node_id, {})
    return {
        "node_id": p.node_id,
        "name": p.name,
        "public": p.public,
        "endpoint": p.endpoint,
        "state": p.state,
        "rtt_ms": round(p.rtt_ms, 3),
        "latency_ms": measured(p.latency_ms),
        "outstanding": p.outstanding,
        "clusters": list(clusters),
        "ejected": list(p.ejected),
        "ejected_by": {cluster: list(callers) for cluster, callers in by.items()},
    }


def cluster_json(view: ClusterView) -> dict[str, object]:
    return {
        "cluster": view.name,
        "members": list(view.members),
        "member_count": len(view.members),
        "announced": list(view.announced),
        "outstanding": view.outstanding,
        "latency_ms": None if view.latency_ms is None else round(view.latency_ms, 3),
        "rtt_ms": None if view.rtt_ms is None else round(view.rtt_ms, 3),
    }


_STATE_STYLE = {
    "alive": "[green]alive[/]",
    "suspect": "[yellow]suspect[/]",
    "dead": "[red]dead[/]",
    "left": "[dim]left[/]",
}


def ejected_by_text(by: Mapping[str, Sequence[str]]) -> str:
    """'ejected by 2 callers (db, cache)': how many nodes keep the peer out of some rotation."""
    callers = {caller for ids in by.values() for caller in ids}
    if not callers:
        return ""
    noun = "caller" if len(callers) == 1 else "callers"
    return f"ejected by {len(callers)} {noun} ({', '.join(sorted(by))})"


def peers_table(
    peers: Sequence[irismesh.PeerInfo],
    served: dict[str, list[str]],
    ejected_by: EjectedBy | None = None,
    *,
    identity: bool = False,
) -> Table:
    """The peers, one a row; with `identity`, a column for the start of each one's public key
    (`mesh peers`; `mesh top` keeps its width for the figures)."""
    table = Table(title=f"peers ({len(peers)})", title_justify="left")
    table.add_column("node")
    table.add_column("name", no_wrap=True)
    if identity:
        table.add_column("identity", no_wrap=True)
    table.add_column("endpoint", no_wrap=True)
    table.add_column("state")
    table.add_column("rtt ms", justify="right")
    table.add_column("latency ms", justify="right")
    table.add_column("outstanding", justify="right")
    table.add_column("clusters")
    for p in sorted(peers, key=lambda p: p.endpoint):
        by = ejected_by_text((ejected_by or {}).get(p.node_id, {}))
        shown = [short_id(p.public) if p.public else "-"] if identity else []
        table.add_row(
            short_id(p.node_id),
            escape(p.name) or "-",
            *shown,
            p.endpoint,
            _STATE_STYLE.get(p.state, p.state)
            + (f" [magenta]ejected from {escape(', '.join(p.ejected))}[/]" if p.ejected else "")
            + (f" [magenta]{escape(by)}[/]" if by else ""),
            ms(p.rtt_ms),
            ms(measured(p.latency_ms)),
            str(p.outstanding),
            ", ".join(served.get(p.node_id, [])) or "-",
        )
    return table


def clusters_table(views: Sequence[ClusterView], names: Mapping[str, str]) -> Table:
    """`names`: node id -> name, to show members by (by short id where they have none)."""
    table = Table(title=f"clusters ({len(views)})", title_justify="left")
    table.add_column("cluster")
    table.add_column("members", justify="right")
    table.add_column("outstanding", justify="right")
    table.add_column("latency ms", justify="right")
    table.add_column("rtt ms", justify="right")
    table.add_column("member nodes")
    for view in views:
        table.add_row(
            view.name,
            str(len(view.members)) if view.members else "[red]0[/]",
            str(view.outstanding),
            ms(view.latency_ms),
            ms(view.rtt_ms),
            " ".join(escape(names.get(m, "")) or short_id(m) for m in view.members) or "-",
        )
    return table


def nobody_answered(args: argparse.Namespace) -> CommandError:
    return CommandError(
        f"no node answered within {args.wait:g} s (looked via {where(args)}; "
        "is a node running there, with the same keyring?)"
    )


async def run_peers(args: argparse.Namespace) -> int:
    keys = client_keyring(args)
    names = cluster_names(keys, [])
    async with make_node(args, keys) as node:
        await settle(node, args.wait)
        if node.peers():  # which peer serves what: its offer tags, on a link
            for name in names:
                await node.connect(name, timeout=args.wait)
        peers = node.peers()
        served = served_by(view_clusters(node, names, peers))
        # Which callers keep which peers out of rotation: their records say, cluster by cluster.
        ejected_by = node.ejected_by({*names, *(c for cs in served.values() for c in cs)})
        peers = node.peers(departed=True)  # and those seen to go while gathering
    if not peers and args.seed:
        raise nobody_answered(args)
    if args.json:
        print_json([peer_json(p, served.get(p.node_id, []), ejected_by) for p in peers])
    else:
        stdout_console().print(peers_table(peers, served, ejected_by, identity=True))
    return 0


async def run_clusters(args: argparse.Namespace) -> int:
    keys = client_keyring(args)
    names = cluster_names(keys, args.cluster)
    if not names and not args.survey:
        raise CommandError(
            "no cluster names: without discovery a node sees only clusters it can name, and "
            "the keyring has only the default '*' key; pass --cluster NAME (repeatable), or "
            "turn discovery on (nodes announce their clusters to it)",
            USAGE_ERROR,
        )
    async with make_node(args, keys) as node:
        await settle(node, args.wait)
        if node.peers():  # link to each cluster's members, to measure them
            for name in names:
                await node.connect(name, timeout=args.wait)
        peers = node.peers()
        views = view_clusters(node, names, peers)
    if not peers and not any(view.members for view in views) and args.seed:
        raise nobody_answered(args)
    if args.json:
        print_json([cluster_json(view) for view in views])
    else:
        stdout_console().print(clusters_table(views, {p.node_id: p.name for p in peers}))
    return 0
