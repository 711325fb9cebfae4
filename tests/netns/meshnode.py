"""One irismesh node of the namespace lab, driven by the test through JSON lines.

    ip netns exec NS python meshnode.py --name n1 --addr 10.77.0.1 --cluster work --discovery survey

The node binds tcp://ADDR:PORT (its namespace's own address), serves `--cluster` (a pure client
without one) with a handler that answers `name:payload`, and prints one line
`{"event": "ready", ...}` once started. Then it reads one JSON command a line on stdin and
answers each with one line `{"re": <the command's id>, ...}` on stdout. Commands run as tasks,
so a slow one (a wait) never holds up the others. Every wait has a deadline.

Commands (`cmd`):
- `wait`: until every id of `present` is a member of the cluster and none of `absent` is, or
  `timeout`. Answers `ok` and `at`, the time.monotonic() since which the condition has held
  (CLOCK_MONOTONIC is one clock for every namespace of the machine, so the test can subtract
  its own timestamps). Membership is sampled every 5 ms.
- `load_start` / `load_progress` / `load_stop`: `workers` tasks send requests in a loop, each
  with `timeout`, pausing `pause` s between requests; every reply is checked against its
  request. `load_stop` lets in-flight requests finish and answers the totals.
- `probe`: `count` requests at once, each with `timeout`; answers each one's outcome and time.
- `stats`: the node's counters, its members and every member drop it saw.
- `data`: hold a replicated counter and set, change them, answer their values (`Controller.data`).
- `revoke`: apply an authority's revocation (`token`, base64) and gossip it; answers `applied`.
- `quit`: close the node and exit.

The node exits on stdin EOF (the test is gone), on SIGTERM, and after `--max-seconds` whatever
it is doing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import irismesh

POLL = 0.005  # seconds between membership samples


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Membership:
    """Samples the members of one cluster and remembers when each one last came or went."""

    def __init__(self, node: irismesh.Node, cluster: str) -> None:
        self.node = node
        self.cluster = cluster
        self.current: set[str] = set()
        self.since: dict[str, float] = {}  # id -> time of its last appearance or disappearance
        self.drops: list[tuple[float, str]] = []  # (when, id) of every member that went away
        self.changed = asyncio.Event()

    def sample(self) -> None:
        now = time.monotonic()
        members = set(self.node.members(self.cluster))
        if members == self.current:
            return
        for gone in self.current - members:
            self.since[gone] = now
            self.drops.append((now, gone))
        for new in members - self.current:
            self.since[new] = now
        self.current = members
        self.changed.set()

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(POLL)

    def holds(self, present: list[str], absent: list[str]) -> float | None:
        """When the condition started holding (monotonic time), or None if it does not hold."""
        if not set(present) <= self.current or set(absent) & self.current:
            return None
        return max((self.since.get(i, 0.0) for i in (*present, *absent)), default=0.0)


MAX_EXAMPLES = 20  # failures and wrong replies kept as examples
MAX_SAMPLES = 200_000  # latencies kept for the percentiles


@dataclass(eq=False)
class Load:
    """Requests in a loop from `workers` tasks; every outcome counted, every reply checked."""

    node: irismesh.Node
    _: KW_ONLY
    cluster: str
    workers: int
    pause: float
    timeout: float
    label: str
    sent: int = 0
    ok: int = 0
    # Counted, with the first few kept as examples: a dying mesh fails requests at once,
    # and a list of every failure would grow without bound.
    failed: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    wrong_count: int = 0
    wrong: list[str] = field(default_factory=list)
    served: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # of the first MAX_SAMPLES replies
    late: int = 0  # requests that took longer than their timeout (plus 100 ms of slack)
    max_elapsed: float = 0.0
    started: float = field(default_factory=time.monotonic)
    stopping: bool = False
    tasks: list[asyncio.Future[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tasks = [asyncio.ensure_future(self._worker()) for _ in range(self.workers)]

    async def _worker(self) -> None:
        while not self.stopping:
            i = self.sent
            self.sent += 1
            payload = f"{self.label}:{i}".encode()
            began = time.monotonic()
            try:
                reply = await self.node.request(self.cluster, payload, timeout=self.timeout)
            except Exception as exc:  # every failure is a figure, never a crash
                elapsed = time.monotonic() - began
                self.failed += 1
                if len(self.failures) < MAX_EXAMPLES:
                    self.failures.append(
                        {
                            "i": i,
                            "at": began,
                            "elapsed": elapsed,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    )
            else:
                elapsed = time.monotonic() - began
                who, _, echoed = reply.partition(b":")
                if echoed != payload:
                    self.wrong_count += 1
                    if len(self.wrong) < MAX_EXAMPLES:
                        self.wrong.append(f"{i}: {reply[:80]!r}")
                else:
                    self.ok += 1
                    self.served[who.decode(errors="replace")] += 1
                    if len(self.latencies) < MAX_SAMPLES:
                        self.latencies.append(elapsed)
            self.max_elapsed = max(self.max_elapsed, elapsed)
            if elapsed > self.timeout + 0.1:
                self.late += 1
            if self.pause:
                await asyncio.sleep(self.pause)

    def progress(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "replied": self.ok,
            "failed": self.failed,
            "wrong": self.wrong_count,
            "served_by": dict(self.served),
            "pending": self.node.stats.get("requests_pending", 0),
            # Requests in flight on each peer's link (hex node id: count).
            "outstanding": {p.node_id: p.outstanding for p in self.node.peers() if p.outstanding},
        }

    async def stop(self) -> dict[str, Any]:
        self.stopping = True
        # Each request ends by its own deadline: wait no longer than that, plus slack.
        _done, not_done = await asyncio.wait(self.tasks, timeout=self.timeout + 2.0)
        for task in not_done:
            task.cancel()
        elapsed = time.monotonic() - self.started
        ordered = sorted(self.latencies)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0

        return {
            **self.progress(),
            "hung_workers": len(not_done),
            "failures": self.failures[:20],
            "wrong_replies": self.wrong[:20],
            "late": self.late,
            "max_elapsed": self.max_elapsed,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "seconds": elapsed,
            "rps": self.sent / elapsed if elapsed > 0 else 0.0,
        }


class Controller:
    def __init__(self, node: irismesh.Node, name: str, cluster: str) -> None:
        self.node = node
        self.name = name
        self.cluster = cluster
        self.membership = Membership(node, cluster)
        self.load: Load | None = None
        self.stop = asyncio.Event()

    async def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        cmd = message.get("cmd")
        if cmd == "wait":
            return await self.wait(
                list(message.get("present", [])),
                list(message.get("absent", [])),
                float(message["timeout"]),
            )
        if cmd == "load_start":
            if self.load is not None:
                return {"ok": False, "error": "a load is already running"}
            self.load = Load(
                self.node,
                cluster=self.cluster,
                workers=int(message.get("workers", 8)),
                pause=float(message.get("pause", 0.01)),
                timeout=float(message.get("timeout", 5.0)),
                label=self.name,
            )
            return {"ok": True}
        if cmd == "load_progress":
            if self.load is None:
                return {"ok": False, "error": "no load is running"}
            return {"ok": True, **self.load.progress()}
        if cmd == "load_stop":
            if self.load is None:
                return {"ok": False, "error": "no load is running"}
            load, self.load = self.load, None
            return {"ok": True, **(await load.stop())}
        if cmd == "probe":
            return await self.probe(int(message.get("count", 1)), float(message["timeout"]))
        if cmd == "stats":
            self.membership.sample()
            return {
                "ok": True,
                "stats": dict(self.node.stats),
                "members": sorted(self.membership.current),
                "peers": sorted(p.node_id for p in self.node.peers()),
                "drops": self.membership.drops,
            }
        if cmd == "quit":
            self.stop.set()
            return {"ok": True}
        if cmd == "data":
            return await self.data(message)
        if cmd == "revoke":
            applied = self.node.revoke(base64.b64decode(message["token"]))
            return {"ok": True, "applied": applied, "at": time.monotonic()}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    async def data(self, message: dict[str, Any]) -> dict[str, Any]:
        """Replicated data: hold a counter and a set (waiting for `holders` others), add to
        the counter `increments` times, add and remove set elements; answers both values."""
        data = self.node.data
        counter, members = data.counter(message["counter"]), data.set(message["set"])
        holders = int(message.get("holders", 0))
        if holders:
            for key in (counter.key, members.key):
                await self.node.wait_for_subscribers("_data." + key, holders, timeout=30)
        for _ in range(int(message.get("increments", 0))):
            await counter.add(1)
        for element in message.get("add", []):
            await members.add(element)
        for element in message.get("remove", []):
            await members.remove(element)
        if "until_counter" in message:  # wait here for these values: answer when they held
            deadline = time.monotonic() + float(message.get("timeout", 20))
            want = (int(message["until_counter"]), sorted(message["until_set"]))
            while (await counter.get(), sorted(await members.get())) != want:
                if time.monotonic() > deadline:
                    return {"ok": False, "counter": await counter.get()}
                await asyncio.sleep(0.01)
            return {"ok": True, "at": time.monotonic()}
        return {"ok": True, "counter": await counter.get(), "set": sorted(await members.get())}

    async def wait(self, present: list[str], absent: list[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        membership = self.membership
        while True:
            membership.sample()
            at = membership.holds(present, absent)
            if at is not None:
                return {"ok": True, "at": at, "members": sorted(membership.current)}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return {"ok": False, "members": sorted(membership.current)}
            membership.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(membership.changed.wait(), min(remaining, POLL * 4))

    async def probe(self, count: int, timeout: float) -> dict[str, Any]:
        async def one(i: int) -> dict[str, Any]:
            began = time.monotonic()
            payload = f"{self.name}:probe:{i}".encode()
            try:
                reply = await self.node.request(self.cluster, payload, timeout=timeout)
            except Exception as exc:
                outcome = type(exc).__name__
            else:
                outcome = "ok" if reply.partition(b":")[2] == payload else "wrong"
            return {"outcome": outcome, "elapsed": time.monotonic() - began}

        results = await asyncio.wait_for(
            asyncio.gather(*(one(i) for i in range(count))), timeout + 2.0
        )
        return {"ok": True, "results": results}


async def serve(args: argparse.Namespace) -> None:
    keys = irismesh.Keyring.from_env()
    if keys is None:
        raise SystemExit("IRISMESH_KEYFILE is not set")
    survey: bool | irismesh.SurveyConfig = False
    mdns: bool | irismesh.MdnsConfig = False
    default_key = keys.primary("*")
    if default_key is None:
        raise SystemExit("the keyring has no '*' key")
    if "survey" in args.discovery:
        # The realm survey=True derives, on this namespace's interface instead of loopback.
        realm = hmac.new(default_key.secret, b"irismesh/v1/survey-realm", hashlib.sha256)
        survey = irismesh.SurveyConfig(interface=args.addr, realm=realm.digest()[:16])
    if "mdns" in args.discovery:
        mdns = irismesh.MdnsConfig(interfaces=(args.addr,), realm_key=default_key.secret)
    node = irismesh.Node(
        args.cluster or None,
        keyring=keys,
        bind=f"tcp://{args.addr}:{args.port}",
        seeds=args.seed,
        survey=survey,
        mdns=mdns,
        identity=args.identity,
        grant=args.grant,
    )
    started = time.monotonic()
    async with node:
        if args.cluster:
            prefix: bytes = args.name.encode() + b":"
            delay: float = args.delay

            @node.on_request
            async def handle(payload: bytes) -> bytes:
                if delay:
                    await asyncio.sleep(delay)
                return prefix + payload

        controller = Controller(node, args.name, args.target)
        monitor = asyncio.ensure_future(controller.membership.run())
        say(
            {
                "event": "ready",
                "name": args.name,
                "id": node.node_id.hex(),
                "endpoint": node.endpoint,
                "pid": os.getpid(),
                "started": started,
                "ready": time.monotonic(),
            }
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, controller.stop.set)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks: set[asyncio.Task[None]] = set()

        async def run_one(message: dict[str, Any]) -> None:
            try:
                answer = await controller.handle(message)
            except Exception as exc:
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            say({"re": message.get("id"), **answer})

        async def read_commands() -> None:
            while True:
                line = await reader.readline()
                if not line:
                    controller.stop.set()  # EOF: the test is gone
                    return
                try:
                    message = json.loads(line)
                except ValueError:
                    say({"re": None, "ok": False, "error": f"not JSON: {line[:80]!r}"})
                    continue
                task = asyncio.ensure_future(run_one(message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        commands = asyncio.ensure_future(read_commands())
        await controller.stop.wait()
        commands.cancel()
        monitor.cancel()
        for task in list(tasks):
            task.cancel()
        if controller.load is not None:
            controller.load.stopping = True
            for task in controller.load.tasks:
                task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--name", required=True)
    parser.add_argument("--addr", required=True, help="this namespace's IPv4 address")
    parser.add_argument("--port", type=int, default=7400)
    parser.add_argument("--cluster", default="", help="cluster served ('' = a pure client)")
    parser.add_argument("--target", default="work", help="cluster requested and watched")
    parser.add_argument("--discovery", default="", help="survey, mdns, survey+mdns or ''")
    parser.add_argument("--seed", action="append", default=[])
    parser.add_argument("--delay", type=float, default=0.002, help="seconds a request takes")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--identity", default=None, help="the node's identity file")
    parser.add_argument("--grant", default=None, help="the node's grant file")
    args = parser.parse_args()

    def expire() -> None:
        print(f"{args.name}: hard timeout of {args.max_seconds} s", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(args.max_seconds, expire)
    timer.daemon = True
    timer.start()
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
