"""Nodes join and leave a cluster while a watcher prints its membership as it changes.

    python examples/join_leave.py
    python examples/join_leave.py --json

The members are `mesh node` processes of the cluster "chat" (the command-line tool; any node
would do), each named with `--name`. The watcher is a node in this process that polls
`node.members("chat")` and `node.peers()` and prints each change, naming each member by the
name membership brought with it. The script then plays a day in the life of a cluster:

    n1, n2, n3 join            each is a member within milliseconds of starting
    n2 leaves cleanly          SIGTERM: it closes and says goodbye, so peers drop it at once
    n3 is killed               SIGKILL: no goodbye, but its kernel closes its connections, and
                               peers drop it as soon as theirs report it (a frozen or cut-off
                               node, which closes nothing, is dropped after 1 s of silence)
    n4 joins                   and the cluster is n1 and n4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import irismesh

CLUSTER = "chat"


class Watcher:
    """Prints the members of CLUSTER whenever they change, by the names they gave themselves."""

    def __init__(self, node: irismesh.Node, started: float, quiet: bool) -> None:
        self.node = node
        self.started = started
        self.quiet = quiet
        self.names: dict[str, str] = {}  # node id (hex) -> n1, n2, ... (from peers())
        self.members: set[str] = set()
        self.events: list[dict[str, object]] = []

    def log(self, event: str, name: str, detail: str = "") -> None:
        """event: joined, left, or the signal sent to the node."""
        elapsed = time.monotonic() - self.started
        self.events.append({"t": round(elapsed, 3), "event": event, "node": name})
        now = ", ".join(sorted(self.names[m] for m in self.members)) or "-"
        mark = {"joined": "+", "left": "-"}.get(event, " ")
        text = f"{mark} {name} {event if mark != ' ' else 'gets ' + event} {detail}".rstrip()
        out = sys.stderr if self.quiet else sys.stdout
        print(f"[{elapsed:5.2f} s] {text:<40} members: {now}", file=out, flush=True)

    async def run(self) -> None:
        endpoints: dict[str, str] = {}
        while True:
            # Membership is what this node knows: peers that proved they hold the key of
            # CLUSTER. peers() also gives each peer's name, endpoint, RTT and latency.
            for peer in self.node.peers():
                self.names[peer.node_id] = peer.name
                endpoints[peer.node_id] = peer.endpoint
            members = {m for m in self.node.members(CLUSTER) if m in self.names}
            joined, left = members - self.members, self.members - members
            self.members = members
            for m in sorted(joined):
                self.log("joined", self.names[m], endpoints.get(m, ""))
            for m in sorted(left):
                self.log("left", self.names[m])
            await asyncio.sleep(0.005)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> float:
    """Seconds until `condition` holds; fails loudly at the deadline."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"still waiting after {timeout} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - started


async def play(args: argparse.Namespace, keys: irismesh.Keyring, env: dict[str, str]) -> int:
    procs: dict[str, asyncio.subprocess.Process] = {}
    # A pure client: it serves no cluster.
    async with irismesh.Node(keyring=keys, name="watcher") as node:
        watcher = Watcher(node, time.monotonic(), quiet=args.json)
        watching = asyncio.create_task(watcher.run())

        async def join(name: str) -> None:
            # A member seeds from the watcher; the watcher links back to it and sees its
            # clusters. `mesh node --json` says where it listens and its node id.
            cmd = [sys.executable, "-m", "irismesh", "node", "--cluster", CLUSTER, "--json"]
            proc = await asyncio.create_subprocess_exec(
                *cmd, "--name", name, "--seed", node.endpoint, stdout=asyncio.subprocess.PIPE,
                env=env,
            )  # fmt: skip
            procs[name] = proc
            assert proc.stdout is not None
            node_id = json.loads(await proc.stdout.readline())["node_id"]
            await until(lambda: node_id in watcher.members)

        async def leave(name: str, sig: signal.Signals) -> float:
            node_id = next(i for i, n in watcher.names.items() if n == name)
            watcher.log(sig.name, name)
            procs[name].send_signal(sig)
            return await until(lambda: node_id not in watcher.members)

        try:
            for name in ("n1", "n2", "n3"):
                await join(name)
            clean = await leave("n2", signal.SIGTERM)
            killed = await leave("n3", signal.SIGKILL)
            await join("n4")
            await asyncio.sleep(0.2)
            final = sorted(watcher.names[m] for m in watcher.members)
        finally:
            watching.cancel()
            for proc in procs.values():
                if proc.returncode is None:
                    proc.terminate()
            await asyncio.gather(*(proc.wait() for proc in procs.values()))
    summary = {
        "events": watcher.events,
        "clean_leave_ms": round(clean * 1000, 1),
        "kill_noticed_ms": round(killed * 1000, 1),
        "members": final,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"n2's clean close was seen after {summary['clean_leave_ms']} ms;")
        print(f"n3's SIGKILL was noticed after {summary['kill_noticed_ms']} ms")
        print(f"members now: {', '.join(final)}")
    return 0 if final == ["n1", "n4"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="irismesh-join-") as workdir:
        keyfile = Path(workdir) / "mesh.keys"
        keys = irismesh.Keyring.generate()  # one default key '*' for every cluster
        keys.save(keyfile)
        env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
        env.pop("IRISMESH_KEYS", None)
        return irismesh.run(play(args, keys, env))


if __name__ == "__main__":
    sys.exit(main())
