"""`mesh`: the command-line tool (also `python -m irismesh`).

Every command that joins the mesh runs a node of its own. Errors a user can cause are one line
on stderr and exit status 2 (usage) or 1 (the mesh said no); never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import irismesh
from irismesh.errors import MeshError

EXAMPLES = """examples:
  mesh keygen mesh.keys
  mesh node --keys mesh.keys --cluster echo --bind tcp://127.0.0.1:7400
  mesh request --keys mesh.keys --seed tcp://127.0.0.1:7400 echo 'hello'
  mesh peers --keys mesh.keys --seed tcp://127.0.0.1:7400 --json
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mesh",
        description="irismesh: a brokerless service mesh.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=irismesh.__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    keygen = sub.add_parser(
        "keygen",
        help="write a new keyring file (mode 0600)",
        description="Write a keyring with a fresh random key per scope ('*' is the default key).",
        epilog="example: mesh keygen mesh.keys --scope '*' --scope db",
    )
    keygen.add_argument("path", type=Path)
    keygen.add_argument("--scope", action="append", help="scope to make a key for (repeatable)")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing file")

    def joining(name: str, help_: str, example: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, epilog=f"example: {example}")
        p.add_argument("--keys", type=Path, help="keyring file (default: $IRISMESH_KEYFILE)")
        p.add_argument("--seed", action="append", default=[], help="endpoint of a known node")
        p.add_argument("--survey", action="store_true", help="also discover by multicast survey")
        p.add_argument("--bind", default="tcp://127.0.0.1:0", help="endpoint to listen on")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    node = joining(
        "node",
        "run a member of a cluster that echoes each request",
        "mesh node --keys mesh.keys --cluster echo --bind tcp://127.0.0.1:7400",
    )
    node.add_argument("--cluster", required=True)
    node.add_argument("--prefix", default="", help="text to put before each echoed reply")

    request = joining(
        "request",
        "send one request to a cluster and print the reply",
        "mesh request --keys mesh.keys --seed tcp://127.0.0.1:7400 echo hello",
    )
    request.add_argument("cluster")
    request.add_argument("payload", help="request body; '-' reads standard input")
    request.add_argument("--timeout", type=float, default=5.0)
    request.add_argument("--wait", type=float, default=3.0, help="seconds to wait for members")

    peers = joining(
        "peers",
        "list the peers this node links to",
        "mesh peers --keys mesh.keys --seed tcp://127.0.0.1:7400",
    )
    peers.add_argument("--wait", type=float, default=1.0, help="seconds to gather peers")
    return parser


def _keyring(path: Path | None) -> irismesh.Keyring:
    if path is not None:
        return irismesh.Keyring.load(path)
    keys = irismesh.Keyring.from_env()
    if keys is None:
        raise irismesh.ConfigurationError(
            "no keyring: pass --keys FILE or set IRISMESH_KEYFILE (make one with `mesh keygen`)"
        )
    return keys


def _node(args: argparse.Namespace, cluster: str | None = None) -> irismesh.Node:
    return irismesh.Node(
        cluster,
        keyring=_keyring(args.keys),
        bind=args.bind,
        seeds=args.seed,
        survey=args.survey,
    )


async def _run_node(args: argparse.Namespace) -> int:
    async with _node(args, args.cluster) as node:
        prefix = args.prefix.encode()
        node.on_request(lambda payload: prefix + payload)
        if args.json:
            print(json.dumps({"endpoint": node.endpoint, "node_id": node.node_id.hex()}))
        else:
            print(f"member of {args.cluster!r} listening on {node.endpoint}", flush=True)
        sys.stdout.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    return 0


async def _run_request(args: argparse.Namespace) -> int:
    payload = sys.stdin.buffer.read() if args.payload == "-" else args.payload.encode()
    async with _node(args) as node:
        try:
            await node.wait_for_members(args.cluster, timeout=args.wait)
        except irismesh.MembershipTimeout:
            raise irismesh.NoResponders(args.cluster) from None
        reply = await node.request(args.cluster, payload, timeout=args.timeout)
    if args.json:
        print(json.dumps({"cluster": args.cluster, "reply": reply.decode(errors="replace")}))
    else:
        sys.stdout.buffer.write(reply + b"\n")
    return 0


async def _run_peers(args: argparse.Namespace) -> int:
    async with _node(args) as node:
        await asyncio.sleep(args.wait)  # gathering: the peers known after `--wait` seconds
        peers = node.peers()
    if args.json:
        print(json.dumps([_peer_dict(p) for p in peers]))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("node", "endpoint", "rtt ms", "latency ms", "outstanding")
    for p in peers:
        table.add_row(
            p.node_id[:12],
            p.endpoint,
            f"{p.rtt_ms:.2f}",
            f"{p.latency_ms:.2f}",
            str(p.outstanding),
        )
    Console().print(table)
    return 0


def _peer_dict(p: irismesh.PeerInfo) -> dict[str, object]:
    return {
        "node_id": p.node_id,
        "endpoint": p.endpoint,
        "rtt_ms": round(p.rtt_ms, 3),
        "latency_ms": round(p.latency_ms, 3),
        "outstanding": p.outstanding,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "keygen":
            if args.path.exists() and not args.force:
                raise irismesh.ConfigurationError(
                    f"{args.path} already exists: pass --force to replace it"
                )
            keys = irismesh.Keyring.generate(args.scope or ["*"])
            keys.save(args.path, overwrite=args.force)
            print(f"wrote {args.path} with keys for: {', '.join(keys.scopes)}")
            return 0
        runner = {"node": _run_node, "request": _run_request, "peers": _run_peers}
        return asyncio.run(runner[args.command](args))
    except irismesh.ConfigurationError as exc:
        print(f"mesh: error: {exc}", file=sys.stderr)
        return 2
    except MeshError as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
