"""`mesh gateway`: join this mesh to other meshes through links to their gateways, or in this
very process (`--join`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import irismesh
from irismesh import _env
from irismesh._cli.base import (
    Commands,
    UsageError,
    add_command,
    add_repeatable,
    add_shared_options,
    load_keyring,
    positive_int,
    print_json,
    reload_keys_on_hangup,
    seed_endpoint,
    short_id,
    stop_on_signals,
    topic_pattern,
    window_size,
)
from irismesh.patterns.tunnel import DEFAULT_WINDOW


def _names(text: str) -> list[str]:
    return [name for name in (part.strip() for part in text.split(",")) if name]


@dataclass
class Joined:
    """Another mesh this process joins (`--join`): its name, keyring, seeds and exports."""

    mesh: str
    keys: Path
    seeds: list[str] = field(default_factory=list)
    export: list[str] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)
    interface: str | None = None
    bind: str | None = None
    discovery: bool | None = None


_JOIN_FIELDS = "keys=FILE (needed), seed=, export=, topics=, interface=, bind=, discovery=on|off"


def port_range(text: str) -> tuple[int, int]:
    """`FIRST-LAST` (or one port): the ports imported clusters' nodes take."""
    first, _, last = text.partition("-")
    try:
        ports = (int(first), int(last or first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port range is FIRST-LAST, got {text!r}") from None
    if not 1 <= ports[0] <= ports[1] <= 65535:
        raise argparse.ArgumentTypeError(f"a port range is 1 to 65535, first <= last: {text!r}")
    return ports


def joined_mesh(text: str) -> Joined:
    """`NAME;keys=FILE;seed=tcp://H:P;export=db,search;topics=feeds.#;discovery=off`."""
    name, *fields = [part.strip() for part in text.split(";")]
    if not name or "=" in name:
        raise argparse.ArgumentTypeError(
            f"starts with the mesh's name, then ;FIELD=VALUE: {text!r}"
        )
    keys: Path | None = None
    joined = Joined(name, Path())
    for part in fields:
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not FIELD=VALUE")
        if key == "keys":
            keys = Path(value)
        elif key == "seed":
            joined.seeds.append(seed_endpoint(value))
        elif key == "export":
            joined.export.extend(_names(value))
        elif key == "topics":
            joined.topics.append(topic_pattern(value))
        elif key == "interface":
            joined.interface = value
        elif key == "bind":
            joined.bind = value
        elif key == "discovery" and value in ("on", "off"):
            joined.discovery = value == "on"
        else:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r}: the fields are {_JOIN_FIELDS}")
    if keys is None:
        raise argparse.ArgumentTypeError(f"{text!r} names no keys=FILE (that mesh's keyring)")
    joined.keys = keys
    return joined


def register(commands: Commands) -> None:
    parser = add_command(
        commands,
        "gateway",
        summary="join this mesh to other meshes: export clusters and topics through a link",
        description=(
            "Runs a gateway of this mesh (--mesh names it for the whole federation) until\n"
            "Ctrl-C or SIGTERM. It joins this mesh like any node (its keyring, seeds and\n"
            "discovery) and links to gateways of other meshes: it listens for them on --listen\n"
            "and dials each --peer, over links authenticated and sealed under --link-keys (a\n"
            "keyring of its own, `mesh keygen link.keys`, shared by the linked gateways only).\n"
            "--export names the clusters and --topics the topic patterns that leave this mesh\n"
            "through it; what a peer exports appears here: its clusters as clusters whose\n"
            "members are the gateways, its topics republished. Published messages wait for a\n"
            "link that is down, up to --buffer of them; beyond that each is dropped and counted\n"
            "(`mesh top` shows every gateway's counters). The first line says where it listens\n"
            "(--json: an object with `endpoint`, `node_endpoint`, `gateway_id` and `mesh`).\n"
            "\n"
            "With --join the same process also joins other meshes, one --join each, with a\n"
            "gateway of each (its keyring, seeds, discovery and exports), every two linked\n"
            "inside the process: no link keys, no TCP between them, about one hop less per\n"
            "request than a pair of gateway processes. Use it where one host reaches both\n"
            "segments; use a pair over --listen/--peer across a WAN or between administrations\n"
            "(the process holds every joined mesh's keyring). --json then adds `joined`: each\n"
            "joined mesh's `mesh`, `node_endpoint`, `gateway_id` and `node_id`."
        ),
        examples=(
            "  mesh keygen link.keys\n"
            "  mesh gateway --mesh east --link-keys link.keys --listen tcp://10.0.0.5:7600 \\\n"
            "      --export db,search --topics 'feeds.#'\n"
            "  mesh gateway --mesh west --link-keys link.keys --peer tcp://10.0.0.5:7600\n"
            "  mesh gateway --mesh east --keys east.keys --export db \\\n"
            "      --join 'west;keys=west.keys;seed=tcp://10.1.0.2:7500;topics=feeds.#'"
        ),
        run=run_gateway,
    )
    parser.add_argument("--mesh", required=True, metavar="NAME", help="this mesh's name")
    parser.add_argument(
        "--link-keys",
        type=Path,
        metavar="FILE",
        help="the link keyring (needed with --listen or --peer, or without --join)",
    )
    parser.add_argument(
        "--listen", metavar="ENDPOINT", help="tcp://HOST:PORT where peer gateways dial in"
    )
    add_repeatable(
        parser,
        "--peer",
        metavar="ENDPOINT",
        help="tcp://HOST:PORT of a peer gateway to dial (repeatable)",
    )
    add_repeatable(
        parser,
        "--export",
        type=_names,
        metavar="CLUSTERS",
        help="clusters that leave this mesh, comma-separated (repeatable)",
    )
    add_repeatable(
        parser,
        "--topics",
        type=topic_pattern,
        metavar="PATTERN",
        help="a topic pattern whose messages leave this mesh (repeatable)",
    )
    parser.add_argument(
        "--buffer",
        type=positive_int,
        default=100_000,
        metavar="N",
        help="messages kept per link while it is down (default: %(default)s)",
    )
    add_repeatable(
        parser,
        "--join",
        type=joined_mesh,
        metavar="'NAME;keys=FILE;...'",
        help=f"another mesh this process joins, linked in-process (repeatable); {_JOIN_FIELDS}",
    )
    parser.add_argument(
        "--tunnel-window",
        type=window_size,
        default=DEFAULT_WINDOW,
        metavar="BYTES",
        help=(
            "bytes of each tunnel through the gateway the far side may send before it is"
            " granted more, e.g. 262144 or 256KiB (default: 1MiB)"
        ),
    )
    parser.add_argument(
        "--import-ports",
        type=port_range,
        metavar="FIRST-LAST",
        help=(
            "the ports (TCP, and UDP for membership) of the nodes serving imported clusters,"
            " one each, on --bind's or --interface's host (default: any free port)"
        ),
    )
    parser.add_argument(
        "--require-far-grants",
        action="store_true",
        help=(
            "far gateways (over --listen and --peer links) must show a grant from an authority"
            " the link keyring or this mesh's keyring trusts (@authority); the links follow"
            " its export, import, expiry and revocation, and this gateway shows its own"
            " identity and grant (a gateway of an earlier release cannot link then)"
        ),
    )
    parser.add_argument("--name", metavar="NAME", help="the gateway's node name")
    add_shared_options(parser, joining=(None, ""), metrics=True, json="the first line as JSON")


def _check(args: argparse.Namespace) -> None:
    joined: list[Joined] = args.join
    if args.link_keys is None and not joined:
        raise UsageError("--link-keys is needed (or --join, to join meshes in one process)")
    if not joined and not (args.listen or args.peer):
        raise UsageError("--listen or --peer is needed (or --join)")
    if args.link_keys is None and (args.listen or args.peer):
        raise UsageError("--listen and --peer need --link-keys")
    if joined and args.link_keys is not None and not (args.listen or args.peer):
        raise UsageError("--link-keys goes with --listen or --peer")
    if args.require_far_grants and not (args.listen or args.peer):
        raise UsageError("--require-far-grants goes with --listen or --peer")
    meshes = [args.mesh, *(j.mesh for j in joined)]
    if len(set(meshes)) != len(meshes):
        raise UsageError(
            f"each --join names another mesh than --mesh and the other --join: {meshes}"
        )


async def run_gateway(args: argparse.Namespace) -> int:
    _check(args)
    keys = load_keyring(args.keys)
    link_keys = None if args.link_keys is None else irismesh.Keyring.load(args.link_keys)
    stop = stop_on_signals()
    if args.metrics is not None:
        from irismesh.telemetry import metrics_endpoint

        # Every node the gateways make (one per imported cluster too) serves there, each
        # under its own `node` label: the gateways make their nodes themselves. Opened first,
        # so that port 0 is one port for them all.
        endpoint = await metrics_endpoint.open_endpoint(args.metrics)
        os.environ[_env.METRICS] = endpoint.address
    others = [
        irismesh.Gateway(
            j.mesh,
            keyring=irismesh.Keyring.load(j.keys),
            export=j.export,
            topics=j.topics,
            buffer=args.buffer,
            name=args.name,
            seeds=j.seeds,
            bind=j.bind,
            discovery=j.discovery,
            interface=j.interface,
            local=True,
            tunnel_window=args.tunnel_window,
        )
        for j in args.join
    ]
    gateway = irismesh.Gateway(
        args.mesh,
        keyring=keys,
        link_keyring=link_keys,
        listen=args.listen,
        peers=args.peer,
        export=[c for names in args.export for c in names],
        topics=args.topics,
        buffer=args.buffer,
        name=args.name,
        seeds=args.seed,
        bind=args.bind,
        discovery=args.survey,
        interface=args.interface,
        local=bool(others),
        tunnel_window=args.tunnel_window,
        import_ports=args.import_ports,
        identity=getattr(args, "identity", None),
        grant=getattr(args, "grant", None),
        require_far_grants=args.require_far_grants,
    )
    async with contextlib.AsyncExitStack() as stack:
        if others:
            await stack.enter_async_context(irismesh.LocalGateways([gateway, *others]))
        else:
            await stack.enter_async_context(gateway)
        node = gateway.node
        if node.metrics_address:
            from irismesh.telemetry import metrics_endpoint

            for one in (gateway, *others):
                metrics_endpoint.add_source(one.node, "gateway", one)
        reload_keys_on_hangup(node)  # the node's keyring, and the link keyring below

        def hangup() -> None:
            node_keys = node.keyring.path is not None and node.reload_keyring()
            for other in others:  # the other meshes' keyrings too
                if other.node.keyring.path is not None and other.node.reload_keyring():
                    node_keys = True
            if not (gateway.reload_link_keyring() or node_keys):
                logging.getLogger("irismesh.keyring").info("keyrings unchanged: keys in use kept")

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hangup)
        # What the process made to start (modules, keys) stays out of the collector's passes,
        # which otherwise cost a gateway about 5% of its CPU per request, traversing it anew.
        gc.freeze()
        if args.json:
            print_json(
                {
                    "endpoint": gateway.endpoint,
                    "node_endpoint": node.endpoint,
                    "gateway_id": gateway.gateway_id.hex(),
                    "node_id": node.node_id.hex(),
                    "mesh": gateway.mesh,
                    **({"metrics": node.metrics_address} if node.metrics_address else {}),
                    **({"joined": [_joined_json(other) for other in others]} if others else {}),
                }
            )
        else:
            where = f"listening on {gateway.endpoint}" if gateway.endpoint else "dialling"
            metrics = f"; metrics on {node.metrics_address}" if node.metrics_address else ""
            print(
                f"gateway of mesh {gateway.mesh!r} {where}; node {short_id(node.node_id.hex())}"
                f" on {node.endpoint}{metrics}",
                flush=True,
            )
            for other in others:
                print(
                    f"joined in-process: mesh {other.mesh!r}; node"
                    f" {short_id(other.node.node_id.hex())} on {other.node.endpoint}",
                    flush=True,
                )
        await stop.wait()
    return 0


def _joined_json(gateway: irismesh.Gateway) -> dict[str, str]:
    return {
        "mesh": gateway.mesh,
        "node_endpoint": gateway.node.endpoint,
        "gateway_id": gateway.gateway_id.hex(),
        "node_id": gateway.node.node_id.hex(),
    }
