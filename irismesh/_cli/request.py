"""`mesh request`: send requests to a cluster and print the replies."""

from __future__ import annotations

import argparse
import sys
import time

from irismesh._cli.base import (
    MEMBER_WAIT,
    Commands,
    add_command,
    add_priority_option,
    add_shared_options,
    add_timeout_option,
    client_keyring,
    cluster_client,
    cluster_name,
    positive_int,
    print_json,
    read_payload,
    text_fields,
)


def register(commands: Commands) -> None:
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
    add_timeout_option(parser, "per request")
    add_priority_option(
        parser, "a busy member serves higher priorities first and turns lower ones away first"
    )
    add_shared_options(parser, joining=MEMBER_WAIT, json="one JSON object per reply")


async def run_request(args: argparse.Namespace) -> int:
    keys = client_keyring(args, args.cluster)
    payload = read_payload(args.payload)
    async with cluster_client(args, keys, args.cluster) as node:
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
