"""`mesh request`: send requests to a cluster and print the replies."""

from __future__ import annotations

import argparse
import sys
import time

from irismesh._cli.base import (
    MeshArgumentParser,
    add_command,
    add_joining_options,
    add_json_option,
    add_priority_option,
    cluster_name,
    load_keyring,
    make_node,
    positive_int,
    print_json,
    require_discovery,
    seconds,
    text_fields,
    wait_for_cluster,
)


def register(commands: argparse._SubParsersAction[MeshArgumentParser]) -> None:
    parser = add_command(
        commands,
        "request",
        summary="send a request to a cluster and print the reply",
        description=(
            "Joins the mesh as a client, waits up to --wait seconds for a live member of\n"
            "CLUSTER, sends PAYLOAD (or standard input, for '-') and writes the reply to stdout\n"
            "as it came, one reply per line. Any live member may answer. --count sends the\n"
            "request N times, one after the other, stopping at the first failure. --json prints\n"
            "one object per reply: cluster, reply (UTF-8 text), reply_base64 (when the reply is\n"
            "not text) and ms (the round trip). Exits 1 if the cluster has no member, a request\n"
            "times out or the member's handler raised (its message is on stderr)."
        ),
        examples=(
            "  mesh request echo hello\n"
            "  date | mesh request upper -\n"
            "  mesh request echo ping --count 5 --json\n"
            "  mesh request reports build --priority high"
        ),
        run=run_request,
    )
    parser.add_argument("cluster", type=cluster_name, metavar="CLUSTER")
    parser.add_argument("payload", metavar="PAYLOAD", help="request body; '-' reads stdin")
    parser.add_argument(
        "--count", type=positive_int, default=1, metavar="N", help="send N requests in turn"
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="per request (default: %(default)s)",
    )
    add_priority_option(
        parser, "a busy member serves higher priorities first and turns lower ones away first"
    )
    add_joining_options(
        parser, wait=3.0, wait_help="seconds to wait for a member of CLUSTER to appear"
    )
    add_json_option(parser, "one JSON object per reply")


async def run_request(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    require_discovery(args)
    keys.require(args.cluster)  # no key for it: say so now, not after --wait seconds
    payload = sys.stdin.buffer.read() if args.payload == "-" else args.payload.encode()
    async with make_node(args, keys) as node:
        await wait_for_cluster(node, args, args.cluster)
        for _ in range(args.count):
            started = time.perf_counter()
            reply = await node.request(
                args.cluster, payload, timeout=args.timeout, priority=args.priority
            )
            elapsed_ms = (time.perf_counter() - started) * 1000
            if args.json:
                print_json(reply_json(args.cluster, reply, elapsed_ms))
            else:
                sys.stdout.buffer.write(reply + b"\n")
                sys.stdout.flush()
    return 0


def reply_json(cluster: str, reply: bytes, elapsed_ms: float) -> dict[str, object]:
    return {"cluster": cluster, "ms": round(elapsed_ms, 3), **text_fields("reply", reply)}
