"""A peer that watches a busy node, run as a process of its own by test_fairness.py.

It serves cluster "shed" with a handler that turns every request away (so the busy node's
throttle comes to refuse at once), subscribes to "busy.#" counting what arrives, prints
`READY <endpoint>`, then answers each line on stdin: `report <hex id>` prints one line of
JSON (how often membership here suspected anyone, how it holds that node now, messages
received). It exits when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys

import irismesh
from irismesh.patterns.reqrep import TurnedAway


async def main(keyfile: str) -> None:
    keys = irismesh.Keyring.load(keyfile)
    received = 0

    def count(_msg: irismesh.Message) -> None:
        nonlocal received
        received += 1

    async with irismesh.Node(cluster="shed", keyring=keys, telemetry=False) as node:

        @node.on_request
        async def refuse(_payload: bytes) -> bytes:
            raise TurnedAway("always busy")

        async with node.subscribe("busy.#", callback=count):
            print("READY", node.endpoint, flush=True)
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                _verb, node_id = line.split()
                report = {
                    "suspected": node.stats.get("members_suspected", 0),
                    "state": node.peer_state(node_id),
                    "received": received,
                }
                print(json.dumps(report), flush=True)


if __name__ == "__main__":
    irismesh.run(main(sys.argv[1]))
