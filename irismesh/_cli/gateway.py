"""`mesh gateway`: join this mesh to other meshes through links to their gateways."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from pathlib import Path

import irismesh
from irismesh._cli.base import (
    MeshArgumentParser,
    add_command,
    add_joining_options,
    add_json_option,
    load_keyring,
    positive_int,
    print_json,
    reload_keys_on_hangup,
    short_id,
    topic_pattern,
)


def _names(text: str) -> list[str]:
    return [name for name in (part.strip() for part in text.split(",")) if name]


def register(commands: argparse._SubParsersAction[MeshArgumentParser]) -> None:
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
            "(--json: an object with `endpoint`, `node_endpoint`, `gateway_id` and `mesh`)."
        ),
        examples=(
            "  mesh keygen link.keys\n"
            "  mesh gateway --mesh east --link-keys link.keys --listen tcp://10.0.0.5:7600 \\\n"
            "      --export db,search --topics 'feeds.#'\n"
            "  mesh gateway --mesh west --link-keys link.keys --peer tcp://10.0.0.5:7600"
        ),
        run=run_gateway,
    )
    parser.add_argument("--mesh", required=True, metavar="NAME", help="this mesh's name")
    parser.add_argument(
        "--link-keys", required=True, type=Path, metavar="FILE", help="the link keyring"
    )
    parser.add_argument(
        "--listen", metavar="ENDPOINT", help="tcp://HOST:PORT where peer gateways dial in"
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="tcp://HOST:PORT of a peer gateway to dial (repeatable)",
    )
    parser.add_argument(
        "--export",
        action="append",
        default=[],
        type=_names,
        metavar="CLUSTERS",
        help="clusters that leave this mesh, comma-separated (repeatable)",
    )
    parser.add_argument(
        "--topics",
        action="append",
        default=[],
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
    parser.add_argument("--name", metavar="NAME", help="the gateway's node name")
    add_joining_options(parser, wait=None, wait_help="")
    add_json_option(parser, "the first line as JSON")


async def run_gateway(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    link_keys = irismesh.Keyring.load(args.link_keys)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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
    )
    async with gateway:
        node = gateway.node
        reload_keys_on_hangup(node)  # the node's keyring, and the link keyring below

        def hangup() -> None:
            node_keys = node.keyring.path is not None and node.reload_keyring()
            if not (gateway.reload_link_keyring() or node_keys):
                logging.getLogger("irismesh.keyring").info("keyrings unchanged: keys in use kept")

        loop.add_signal_handler(signal.SIGHUP, hangup)
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
                }
            )
        else:
            where = f"listening on {gateway.endpoint}" if gateway.endpoint else "dialling"
            print(
                f"gateway of mesh {gateway.mesh!r} {where}; node {short_id(node.node_id.hex())}"
                f" on {node.endpoint}",
                flush=True,
            )
        await stop.wait()
    return 0
