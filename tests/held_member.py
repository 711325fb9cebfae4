"""A member of "db" in a process of its own, for the tests that hold connections against it.

Run with a descriptor limit (`--nofile`, 1,024 by default: many systems' soft limit) and the
stranger settings given. It prints `READY <endpoint> <pid>` once it serves, answers "stats"
with its `Node.stats` as JSON and anything else with "db:" before it, and leaves when its
stdin closes (or it is killed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys

import irismesh
from irismesh._core.config import CoreConfig


def main() -> None:
    defaults = CoreConfig()
    parser = argparse.ArgumentParser()
    parser.add_argument("--nofile", type=int, default=1024)
    parser.add_argument("--hello-timeout", type=float, default=defaults.hello_timeout)
    parser.add_argument("--max-strangers", type=int, default=defaults.max_strangers)
    parser.add_argument(
        "--max-strangers-per-address", type=int, default=defaults.max_strangers_per_address
    )
    parser.add_argument("--max-payload", type=int, default=defaults.max_payload)
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))
    config = CoreConfig(
        hello_timeout=args.hello_timeout,
        max_strangers=args.max_strangers,
        max_strangers_per_address=args.max_strangers_per_address,
        max_payload=args.max_payload,
    )
    irismesh.run(serve(config))


async def serve(config: CoreConfig) -> None:
    keys = irismesh.Keyring.from_env()
    assert keys is not None, "no IRISMESH_KEYFILE"
    async with irismesh.Node("db", keyring=keys, config=config, transport="tcp") as node:

        def answer(payload: bytes) -> bytes:
            if payload == b"stats":
                return json.dumps(dict(node.stats)).encode()
            return b"db:" + payload

        node.on_request(answer)
        print("READY", node.endpoint, os.getpid(), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    main()
