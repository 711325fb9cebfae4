"""A gateway or a node of one mesh in the namespace lab, driven through JSON lines.

    ip netns exec NS python fednode.py --keys a.keys --addr 10.77.0.1 --cluster db
    ip netns exec NS python fednode.py --keys a.keys --addr 10.77.0.2 --gateway a \
        --link-keys link.keys --listen tcp://10.77.0.2:7600 --export db --topics 'feeds.#'

A gateway takes `--bind tcp://ADDR:PORT` (its node's fixed port) and `--import-ports FIRST-LAST`
(the imported clusters' nodes' ports).

With `--join MESH --join-keys FILE [--join-export CLUSTER]...` the gateway also joins mesh
MESH in the same process (`irismesh.LocalGateways`), on the same interface; `--link-keys` is
then needed only with `--listen` or `--peer`.

Either mode discovers its mesh by survey on its namespace's interface and prints one line
`{"event": "ready", "id": ...}`. Then it reads one JSON command a line (`{"cmd", "id", ...}`)
and answers each with `{"re": id, "ok": ...}`; commands run as tasks, so `progress` is answered
while `requests` runs. Commands:

- `stats`: the node's (or the gateway's) counters.
- `requests` (`count`, `concurrency`, `timeout`, `cluster`, `seconds`): requests whose replies
  are checked, none started after `seconds` if given; answers the totals (and the longest wait
  between two replies of one caller) when all are done. `progress`: how many are done so far.
- `publish` (`topic`, `count`, `rate`): `count` messages `<index>` at `rate` per second.
- `subscribers` (`topic`, `wait`): answers once a subscriber of `topic` is known.
- `received`: what the subscription (`--subscribe`) got: count, whether in order, duplicates.
- `tunnel` (`cluster`, `size`, `block`): a tunnel to the cluster (a member echoes it), `size`
  bytes sent in numbered `block`-byte messages and checked as they come back; answers bytes
  and seconds, or the error that ended it. `progress` then counts the bytes echoed so far.

It exits on stdin EOF, SIGTERM, or after `--max-seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import time
from typing import Any

import irismesh

ANSWER = "{name}:{payload}"


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.done = 0
        self.got: list[int] = []
        self.gateway: irismesh.Gateway | None = None
        self.joined: irismesh.LocalGateways | None = None
        self.node: irismesh.Node

    def stats(self) -> dict[str, Any]:
        if self.joined is not None:
            return {
                "stats": self.joined.stats,
                "imports": [g.imports() for g in self.joined.gateways],
            }
        if self.gateway is not None:
            nodes = [self.gateway.node, *self.gateway._imports.values()]
            return {"stats": self.gateway.stats, "imports": self.gateway.imports(),
                    "ports": [int(n.endpoint.rpartition(":")[2]) for n in nodes],
                    "import_errors": self.gateway.import_errors}  # fmt: skip
        return {"stats": dict(self.node.stats)}

    async def requests(
        self, count: int, concurrency: int, timeout: float, cluster: str, seconds: float | None
    ) -> dict[str, Any]:
        await self.node.wait_for_members(cluster, timeout=20)
        failed: list[str] = []
        wrong = 0
        left = iter(range(count))
        until = None if seconds is None else time.monotonic() + seconds
        slowest = 0.0  # the longest wait between two replies

        async def caller() -> None:
            nonlocal wrong, slowest
            last = time.monotonic()
            for i in left:
                if until is not None and time.monotonic() > until:
                    break
                now = time.monotonic()
                slowest = max(slowest, now - last)
                last = now
                try:
                    reply = await self.node.request(cluster, b"%d" % i, timeout=timeout)
                except irismesh.MeshError as exc:
                    failed.append(f"{i}: {type(exc).__name__}: {exc}")
                    continue
                finally:
                    self.done += 1
                if reply.partition(b":")[2] != b"%d" % i:
                    wrong += 1

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return {"done": self.done, "failed": len(failed), "errors": failed[:5], "wrong": wrong,
                "slowest": slowest, "stats": dict(self.node.stats)}  # fmt: skip

    async def tunnel(self, cluster: str, size: int, block: int) -> dict[str, Any]:
        await self.node.wait_for_members(cluster, timeout=20)
        count = max(1, size // block)
        start = time.monotonic()
        async with self.node.tunnel(cluster, timeout=10) as tunnel:

            async def write() -> None:
                for i in range(count):
                    await tunnel.send(i.to_bytes(8, "big") * (block // 8))
                await tunnel.send_eof()

            writer = asyncio.create_task(write())
            try:
                for i in range(count):
                    message = await tunnel.recv()
                    if message != i.to_bytes(8, "big") * (block // 8):
                        raise ValueError(f"message {i} came back changed or out of order")
                    self.done += len(message)
                await writer
            finally:
                writer.cancel()
        return {"bytes": self.done, "seconds": time.monotonic() - start}

    async def publish(self, topic: str, count: int, rate: float) -> dict[str, Any]:
        await self.node.wait_for_subscribers(topic, timeout=20)
        start = time.monotonic()
        for i in range(count):
            pause = start + i / rate - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            await self.node.publish(topic, b"%d" % i, timeout=30)
        return {"published": count, "seconds": time.monotonic() - start}

    def received(self) -> dict[str, Any]:
        got = self.got
        ordered = all(a < b for a, b in itertools.pairwise(got))
        distinct = set(got)
        missing = [i for i in range(max(got) + 1) if i not in distinct] if got else []
        backwards = [(a, b) for a, b in itertools.pairwise(got) if a >= b]
        return {"count": len(got), "in_order": ordered, "distinct": len(distinct),
                "last": got[-1] if got else None, "missing": missing[:20],
                "missing_count": len(missing), "backwards": backwards[:10]}  # fmt: skip

    async def command(self, line: str) -> None:
        msg = json.loads(line)
        ident, cmd = msg.get("id"), msg.get("cmd")
        try:
            if cmd == "stats":
                out = self.stats()
            elif cmd == "progress":
                out = {"done": self.done}
            elif cmd == "requests":
                out = await self.requests(
                    msg["count"], msg["concurrency"], msg["timeout"], msg.get("cluster", "db"),
                    msg.get("seconds"),
                )  # fmt: skip
            elif cmd == "publish":
                out = await self.publish(msg["topic"], msg["count"], msg["rate"])
            elif cmd == "subscribers":
                await self.node.wait_for_subscribers(msg["topic"], timeout=msg["wait"])
                out = {}
            elif cmd == "members":
                found = await self.node.wait_for_members(
                    msg["cluster"], msg["count"], timeout=msg["wait"]
                )
                out = {"members": found}
            elif cmd == "received":
                out = self.received()
            elif cmd == "tunnel":
                out = await self.tunnel(msg["cluster"], msg["size"], msg["block"])
            else:
                raise ValueError(f"unknown command {cmd!r}")
            say({"re": ident, "ok": True, **out})
        except Exception as exc:
            say({"re": ident, "ok": False, "error": f"{type(exc).__name__}: {exc}"})


async def main(args: argparse.Namespace) -> None:
    keys = irismesh.Keyring.load(args.keys)
    driver = Driver(args)
    common: dict[str, Any] = {"keyring": keys, "discovery": True, "interface": args.addr}
    if args.gateway:
        driver.gateway = irismesh.Gateway(
            args.gateway,
            link_keyring=irismesh.Keyring.load(args.link_keys) if args.link_keys else None,
            listen=args.listen,
            peers=args.peer,
            export=args.export,
            topics=args.topics,
            buffer=args.buffer,
            name=args.name,
            local=bool(args.join),
            bind=args.bind,
            import_ports=args.import_ports,
            **common,
        )
        if args.join:
            other = irismesh.Gateway(
                args.join,
                export=args.join_export,
                buffer=args.buffer,
                name=args.name,
                local=True,
                **{**common, "keyring": irismesh.Keyring.load(args.join_keys)},
            )
            driver.joined = await irismesh.LocalGateways([driver.gateway, other]).start()
        else:
            await driver.gateway.start()
        driver.node = driver.gateway.node
    else:
        driver.node = await irismesh.Node(args.cluster, name=args.name, **common).start()
        if args.cluster:
            prefix = args.name.encode() + b":"
            driver.node.on_request(lambda payload: prefix + payload)

            @driver.node.on_tunnel
            async def echo(tunnel: irismesh.Tunnel) -> None:
                async for message in tunnel:
                    await tunnel.send(message)
                await tunnel.send_eof()

    if args.subscribe:
        driver.node.subscribe(args.subscribe, callback=lambda m: driver.got.append(int(m.payload)))
    say({"event": "ready", "id": driver.node.node_id.hex(), "endpoint": driver.node.endpoint,
         "link": driver.gateway.endpoint if driver.gateway else ""})  # fmt: skip

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.call_later(args.max_seconds, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()

    async def read() -> None:
        while line := await reader.readline():
            task = asyncio.create_task(driver.command(line.decode()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        stop.set()

    reading = asyncio.create_task(read())
    await stop.wait()
    reading.cancel()
    if driver.joined is not None:
        await driver.joined.close()
    elif driver.gateway is not None:
        await driver.gateway.close()
    else:
        await driver.node.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--name", default="node")
    parser.add_argument("--cluster")
    parser.add_argument("--subscribe")
    parser.add_argument("--gateway", metavar="MESH")
    parser.add_argument("--link-keys")
    parser.add_argument("--listen")
    parser.add_argument("--peer", action="append", default=[])
    parser.add_argument("--export", action="append", default=[])
    parser.add_argument("--topics", action="append", default=[])
    parser.add_argument("--buffer", type=int, default=100_000)
    parser.add_argument("--join", metavar="MESH")
    parser.add_argument("--join-keys")
    parser.add_argument("--join-export", action="append", default=[])
    parser.add_argument("--bind")
    parser.add_argument(
        "--import-ports", type=lambda t: tuple(int(p) for p in t.split("-")), default=None
    )
    parser.add_argument("--max-seconds", type=float, default=300)
    irismesh.run(main(parser.parse_args()))
