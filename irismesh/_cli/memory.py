"""`mesh memory` (a memory member) and `mesh reread` (what the memory holds for a pattern)."""

from __future__ import annotations

import argparse

from irismesh._cli.base import (
    Commands,
    add_command,
    add_directory,
    add_shared_options,
    client_keyring,
    cluster_client,
    load_keyring,
    make_node,
    positive_int,
    print_json,
    reload_keys_on_hangup,
    short_id,
    stop_on_signals,
    text_fields,
    topic_pattern,
)
from irismesh.memory.service import MEMORY_CLUSTER


def register(commands: Commands) -> None:
    memory = add_command(
        commands,
        "memory",
        summary="run a memory member: it keeps retained messages for `mesh reread`",
        description=(
            "Joins the mesh as a member of the memory (the cluster _memory) and keeps every\n"
            "message published with --retain in a SQLite database in --data, sealed at rest\n"
            "under keys derived from the topics' keys, until Ctrl-C or SIGTERM. Run two (or\n"
            "more) on different machines: a retained publish returns once --replicas of them\n"
            "hold it, and a member that starts copies what the others hold. The first line,\n"
            "printed once that copy is done, says where it listens and what it holds\n"
            "(--json: an object with `endpoint`, `node_id`, `data`, `messages` and `paths`)."
        ),
        examples=(
            "  mesh memory --keys mesh.keys --data /var/lib/irismesh/memory \\\n"
            "      --bind tcp://127.0.0.1:7500 --seed tcp://127.0.0.1:7400\n"
            "  mesh publish --keys mesh.keys --seed tcp://127.0.0.1:7500 news.a 'v1' --retain\n"
            "  mesh reread --keys mesh.keys --seed tcp://127.0.0.1:7500 'news.#'"
        ),
        run=run_memory,
    )
    add_directory(memory, "--data", "directory of the database")
    memory.add_argument(
        "--sync",
        choices=("fsync", "os"),
        default="fsync",
        help="fsync: a write is acknowledged once on disk (survives a power cut); os: once the "
        "operating system holds it (faster; survives a crash of this process, not of the "
        "machine) (default: %(default)s)",
    )
    add_shared_options(
        memory, joining=(None, "unused"), metrics=True, json="the first line as a JSON object"
    )

    reread = add_command(
        commands,
        "reread",
        summary="print what the mesh's memory holds for a topic pattern",
        description=(
            "Asks every memory member (`mesh memory`) for the stored paths PATTERN matches\n"
            "(`*` one segment, `#` any number, as `mesh subscribe`) and prints each path's\n"
            "--latest newest retained messages, newest first: one line each, topic, a tab,\n"
            "the payload (--json: one object per line with topic, payload, published_at and\n"
            "id). Exits 1 if no memory member answered within --wait seconds."
        ),
        examples=(
            "  mesh reread --keys mesh.keys --seed tcp://127.0.0.1:7500 'news.#'\n"
            "  mesh reread --seed tcp://127.0.0.1:7500 'feeds.*.42' --latest 5 --json"
        ),
        run=run_reread,
    )
    reread.add_argument("pattern", type=topic_pattern, metavar="PATTERN", help="e.g. 'news.#'")
    reread.add_argument(
        "--latest",
        type=positive_int,
        default=1,
        metavar="N",
        help="messages per path, newest first (default: %(default)s)",
    )
    add_shared_options(
        reread,
        joining=(5.0, "most seconds to find a memory member"),
        json="one JSON object per message",
    )


async def run_memory(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    stop = stop_on_signals()
    async with make_node(args, keys, memory=args.data, memory_sync=args.sync) as node:
        reload_keys_on_hangup(node)
        await node.caught_up()  # what the others stored meanwhile, before saying it is ready
        stats = node.stats
        if args.json:
            print_json(
                {
                    "endpoint": node.endpoint,
                    "node_id": node.node_id.hex(),
                    "data": str(args.data),
                    "messages": stats.get("memory_messages", 0),
                    "paths": stats.get("memory_paths", 0),
                    **({"metrics": node.metrics_address} if node.metrics_address else {}),
                }
            )
        else:
            metrics = f"; metrics on {node.metrics_address}" if node.metrics_address else ""
            print(
                f"memory member {short_id(node.node_id.hex())} on {node.endpoint}: "
                f"{stats.get('memory_messages', 0)} message(s) on "
                f"{stats.get('memory_paths', 0)} path(s) in {args.data}{metrics}",
                flush=True,
            )
        await stop.wait()
    return 0


async def run_reread(args: argparse.Namespace) -> int:
    keys = client_keyring(args)
    async with cluster_client(args, keys, MEMORY_CLUSTER) as node:
        found = await node.reread(args.pattern, latest=args.latest, timeout=args.wait)
    for message in found:
        if args.json:
            print_json(
                {
                    "topic": message.topic,
                    **text_fields("payload", message.payload),
                    "published_at": message.published_at,
                    "id": message.id.hex(),
                }
            )
        else:
            text = message.payload.decode(errors="replace")
            print(f"{message.topic}\t{text}", flush=True)
    return 0
