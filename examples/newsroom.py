"""The newsroom: desks publish stories and corrections, readers subscribe with wildcards.

    python examples/newsroom.py                                 # 3 desks, 40 stories each
    python examples/newsroom.py --desks world,sports,business,arts --stories 200 --json
    python examples/newsroom.py --stories 1500 --archive-delay 0.001  # a slow archive

One command starts every process (this same file with `--role`), on a keyring it generates in
a temporary directory:

* desks, one process each (`world`, `sports`, `business` by default), publish stories on
  `feeds.<desk>.<story-id>` and, for every few stories, a correction on
  `feeds.<desk>.<story-id>.corrections`;
* readers, one process each, subscribe with a pattern: the archive `feeds.#` must see
  everything, the sports app `feeds.sports.*` only sports stories, the corrections monitor
  `feeds.#.corrections` every correction, the front page `feeds.*.*` every story but no
  correction.

A desk waits (`wait_for_subscribers`) until every reader whose pattern matches its topics has
subscribed, so nothing is published before the interest has arrived, then publishes as fast
as flow control lets it, and last a "done" message on `newsroom.done.<desk>` that every reader
also subscribes to. A reader stops once every desk is done and checks what it got against the
plan: exactly the messages matching its pattern (none missing, none extra), each desk's in the
order it published them, none missed. The script prints a table of desks and readers (or one
JSON object) and exits non-zero on any discrepancy.

Readers subscribe with the "block" policy: a reader that falls behind holds the desks back
(each may have 1024 messages in a reader's buffers) instead of losing messages. With
`--archive-delay` the archive reads slowly, and the desks' publishing time grows to match
once a desk has more than that in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import irismesh

READERS = {  # name -> pattern, in start order (the archive is the others' seed)
    "archive": "feeds.#",
    "sports-app": "feeds.sports.*",
    "corrections": "feeds.#.corrections",
    "front-page": "feeds.*.*",
}
DONE = "newsroom.done"  # + .<desk>: a desk's last message, which every reader wants
SUBJECTS = ("talks", "markets", "storm", "election", "final", "merger", "museum", "trial")
VERBS = ("resume", "rally", "nears", "called", "ends in upset", "approved", "reopens", "opens")


# ----------------------------------------------------------------- the plan everyone shares


def matches(pattern: str, topic: str) -> bool:
    """The mesh's matching rule, written out: `*` one segment, `#` zero or more."""

    def walk(p: list[str], t: list[str]) -> bool:
        if not p:
            return not t
        if p[0] == "#":
            return walk(p[1:], t) or (bool(t) and walk(p, t[1:]))
        return bool(t) and p[0] in ("*", t[0]) and walk(p[1:], t[1:])

    return walk(pattern.split("."), topic.split("."))


def desk_plan(desk: str, stories: int, corrections_every: int) -> list[tuple[int, str, str]]:
    """(sequence number, topic, kind) of what a desk publishes, in order.

    Each story, and after every `corrections_every`-th story a correction of the one before,
    so that corrections are interleaved with later stories.
    """
    plan: list[tuple[int, str, str]] = []
    for i in range(1, stories + 1):
        plan.append((len(plan) + 1, f"feeds.{desk}.s{i:04d}", "story"))
        if i > 1 and (i - 1) % corrections_every == 0:
            plan.append((len(plan) + 1, f"feeds.{desk}.s{i - 1:04d}.corrections", "correction"))
    return plan


def headline(desk: str, topic: str, kind: str) -> str:
    n = int(topic.split(".")[2][1:])
    text = f"{desk.title()}: {SUBJECTS[n % len(SUBJECTS)]} {VERBS[(n * 3) % len(VERBS)]}"
    return f"Correction to '{text}'" if kind == "correction" else text


# ----------------------------------------------------------------- a desk


async def run_desk(name: str, plan: dict[str, Any]) -> None:
    readers: dict[str, str] = plan["readers"]
    published = desk_plan(name, plan["stories"], plan["corrections_every"])
    async with irismesh.Node(seeds=plan["seeds"], name=f"desk-{name}") as node:
        print("READY", node.endpoint, flush=True)
        # Every reader interested in this desk's topics must have subscribed first: one of
        # its stories, one of its corrections, and its "done" (which every reader wants).
        patterns = list(readers.values()) + [f"{DONE}.*"] * len(readers)
        samples = [next(topic for _, topic, kind in published if kind == kind_) for kind_ in
                   {kind for _, _, kind in published}] + [f"{DONE}.{name}"]  # fmt: skip
        for topic in samples:
            wanted = sum(matches(p, topic) for p in patterns)
            if wanted:
                await node.wait_for_subscribers(topic, wanted, timeout=plan["timeout"])
        started = time.perf_counter()
        delivered = 0
        wrong_reach: list[str] = []
        for seq, topic, kind in published:
            payload = {
                "desk": name,
                "seq": seq,
                "kind": kind,
                "topic": topic,
                "headline": headline(name, topic, kind),
            }
            reached = await node.publish(topic, json.dumps(payload).encode(), timeout=10)
            expected = sum(matches(p, topic) for p in readers.values())
            if reached != expected:
                wrong_reach.append(f"{topic}: reached {reached}, expected {expected}")
            delivered += reached
        seconds = time.perf_counter() - started
        done = {"desk": name, "published": len(published)}
        await node.publish(f"{DONE}.{name}", json.dumps(done).encode(), timeout=10)
        result = {
            "desk": name,
            "node_id": node.node_id.hex(),
            "stories": sum(kind == "story" for _, _, kind in published),
            "corrections": sum(kind == "correction" for _, _, kind in published),
            "published": len(published),
            "delivered": delivered,
            "wrong_reach": wrong_reach,
            "seconds": round(seconds, 3),
        }
        print("RESULT", json.dumps(result), flush=True)
        # Stay in the mesh until the coordinator is done with every reader (it closes stdin).
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


# ----------------------------------------------------------------- a reader


async def run_reader(name: str, plan: dict[str, Any], delay: float) -> None:
    pattern: str = plan["readers"][name]
    desks: list[str] = plan["desks"]
    async with irismesh.Node(seeds=plan["seeds"], name=name) as node:
        feed = node.subscribe(pattern, maxsize=64)  # "block": a slow reader loses nothing
        done = node.subscribe(f"{DONE}.*")
        print("READY", node.endpoint, flush=True)
        received: list[irismesh.Message] = []

        async def read_feed() -> None:
            async for message in feed:
                received.append(message)
                if delay:
                    await asyncio.sleep(delay)

        reading = asyncio.create_task(read_feed())
        finished: set[str] = set()
        timed_out = False
        try:
            while len(finished) < len(desks):
                try:
                    marker = await done.get(timeout=plan["timeout"])
                except TimeoutError:
                    timed_out = True
                    break
                finished.add(json.loads(marker.payload)["desk"])
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
        # A desk's messages came before its "done" on the same ordered link: all are here.
        while (left := feed.get_nowait()) is not None:
            received.append(left)
        report = check(name, pattern, plan, received)
        report["timed_out"] = timed_out
        report["ok"] = report["ok"] and not timed_out
        print("RESULT", json.dumps(report), flush=True)


def check(
    name: str, pattern: str, plan: dict[str, Any], received: list[irismesh.Message]
) -> dict[str, Any]:
    """What a reader got against what it should have: exactly the matching messages, in order."""
    expected = {
        desk: [
            seq
            for seq, topic, _ in desk_plan(desk, plan["stories"], plan["corrections_every"])
            if matches(pattern, topic)
        ]
        for desk in plan["desks"]
    }
    got: dict[str, list[int]] = defaultdict(list)
    publishers: dict[str, set[str]] = defaultdict(set)
    wrong_topic = missed = 0
    for message in received:
        payload = json.loads(message.payload)
        missed += message.missed
        if not matches(pattern, message.topic) or payload["topic"] != message.topic:
            wrong_topic += 1
        got[payload["desk"]].append(payload["seq"])
        publishers[payload["desk"]].add(message.publisher)
    missing = extra = out_of_order = 0
    for desk in set(expected) | set(got):
        want, have = expected.get(desk, []), got.get(desk, [])
        missing += len(set(want) - set(have))
        extra += len(have) - len(set(have) & set(want))  # unwanted ones, and duplicates
        out_of_order += sum(1 for a, b in itertools.pairwise(have) if b <= a)
    return {
        "reader": name,
        "pattern": pattern,
        "expected": sum(map(len, expected.values())),
        "received": len(received),
        "by_desk": {desk: len(seqs) for desk, seqs in sorted(got.items())},
        "missing": missing,
        "extra": extra,
        "out_of_order": out_of_order,
        "missed": missed,
        "wrong_topic": wrong_topic,
        "publishers_per_desk": max((len(p) for p in publishers.values()), default=0),
        "ok": got == {d: s for d, s in expected.items() if s}
        and not (missed or wrong_topic)
        and all(len(p) == 1 for p in publishers.values()),
    }


# ----------------------------------------------------------------- the coordinator


@dataclass
class Child:
    name: str
    role: str
    proc: asyncio.subprocess.Process
    endpoint: str = ""

    async def line(self, tag: str, timeout: float) -> str:
        """The rest of the next line starting with `tag` (READY, RESULT) on its stdout."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while raw := await self.proc.stdout.readline():
                word, _, rest = raw.decode().strip().partition(" ")
                if word == tag:
                    return rest
        status = await self.proc.wait()
        raise RuntimeError(f"{self.role} {self.name} exited ({status}) without a {tag} line")


async def start(name: str, role: str, plan: dict[str, Any], args: argparse.Namespace) -> Child:
    cmd = [sys.executable, __file__, "--role", role, "--name", name, "--plan", json.dumps(plan)]
    if role == "reader" and name == "archive":
        cmd += ["--archive-delay", str(args.archive_delay)]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    child = Child(name, role, proc)
    child.endpoint = await child.line("READY", args.timeout)
    return child


async def run_newsroom(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="irismesh-newsroom-"))
    keyfile = workdir / "mesh.keys"
    irismesh.Keyring.generate().save(keyfile)
    os.environ["IRISMESH_KEYFILE"] = str(keyfile)  # the children inherit it
    os.environ.pop("IRISMESH_KEYS", None)
    plan: dict[str, Any] = {
        "desks": args.desks,
        "stories": args.stories,
        "corrections_every": args.corrections_every,
        "readers": READERS,
        "seeds": [],
        "timeout": args.timeout,
    }
    children: list[Child] = []
    started = time.perf_counter()
    try:
        for name in READERS:
            children.append(await start(name, "reader", plan, args))
            plan["seeds"] = [children[0].endpoint]  # the archive is everyone's seed
        readers = list(children)
        say(args, f"{len(readers)} readers subscribed: " + ", ".join(
            f"{r.name} ({READERS[r.name]})" for r in readers
        ))  # fmt: skip
        desks = [await start(desk, "desk", plan, args) for desk in args.desks]
        children += desks
        say(args, f"desks {', '.join(args.desks)} publishing {args.stories} stories each")
        async with asyncio.timeout(args.timeout):
            desk_results = [json.loads(await d.line("RESULT", args.timeout)) for d in desks]
            reader_results = [json.loads(await r.line("RESULT", args.timeout)) for r in readers]
        seconds = time.perf_counter() - started
    finally:
        await stop_all(children)
        shutil.rmtree(workdir, ignore_errors=True)
    ok = all(r["ok"] for r in reader_results) and not any(d["wrong_reach"] for d in desk_results)
    report = {
        "ok": ok,
        "desks": desk_results,
        "readers": reader_results,
        "published": sum(d["published"] for d in desk_results),
        "delivered": sum(d["delivered"] for d in desk_results),
        "seconds": round(seconds, 3),
    }
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print_report(report)
    return 0 if ok else 1


async def stop_all(children: list[Child]) -> None:
    """Every child ends, whatever happened: stdin closed (desks wait on it), then SIGTERM,
    then SIGKILL."""
    for child in children:
        if child.proc.stdin is not None:
            child.proc.stdin.close()
    for child in children:
        try:
            await asyncio.wait_for(child.proc.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                child.proc.terminate()
            try:
                await asyncio.wait_for(child.proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                await child.proc.wait()


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, width=120)  # piped: do not squeeze to 80 columns
    desks = Table(title="desks", title_justify="left")
    for column in ("desk", "stories", "corrections", "published", "delivered", "seconds"):
        desks.add_column(column, justify="left" if column == "desk" else "right")
    for d in report["desks"]:
        row = (d["stories"], d["corrections"], d["published"], d["delivered"], d["seconds"])
        desks.add_row(d["desk"], *map(str, row))
    readers = Table(title="readers", title_justify="left")
    columns = ("reader", "pattern", "expected", "received", "missing", "extra", "out of order",
               "missed", "status")  # fmt: skip
    for column in columns:
        readers.add_column(column, justify="left" if column in ("reader", "pattern") else "right")
    for r in report["readers"]:
        status = "[green]ok[/]" if r["ok"] else "[red]WRONG[/]"
        counts = (r["expected"], r["received"], r["missing"], r["extra"], r["out_of_order"],
                  r["missed"])  # fmt: skip
        readers.add_row(r["reader"], r["pattern"], *map(str, counts), status)
    console.print(desks)
    console.print(readers)
    if report["ok"]:
        console.print(
            f"{report['published']} messages published, {report['delivered']} delivered in "
            f"{report['seconds']:.2f} s: every reader got exactly the messages matching its "
            "pattern, each desk's in order, none missed",
            soft_wrap=True,
        )
    else:
        console.print("[red]DISCREPANCY[/]: see the tables above")


def say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


# ----------------------------------------------------------------- command line


def desk_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if not re.fullmatch(r"[a-z][a-z0-9-]*", name)]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected distinct lower-case names separated by commas, got {text!r}"
        )
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--desks", type=desk_names, default=["world", "sports", "business"])
    parser.add_argument("--stories", type=int, default=40, help="per desk (default: 40)")
    parser.add_argument(
        "--corrections-every", type=int, default=3, help="a correction per N stories"
    )
    parser.add_argument(
        "--archive-delay", type=float, default=0.0, help="seconds the archive takes per message"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole run")
    parser.add_argument("--json", action="store_true", help="the report as one JSON object")
    parser.add_argument("--role", choices=("desk", "reader"), help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        loop_signals = (signal.SIGTERM, signal.SIGINT)
        for sig in loop_signals:  # a child stops quietly when the coordinator says so
            signal.signal(sig, lambda *_: sys.exit(0))
        if args.role == "desk":
            irismesh.run(run_desk(args.name, args.plan))
        else:
            irismesh.run(run_reader(args.name, args.plan, args.archive_delay))
        return 0
    if args.stories < 1 or args.corrections_every < 1:
        parser.error("--stories and --corrections-every must be at least 1")
    try:
        return irismesh.run(run_newsroom(args))
    except (TimeoutError, RuntimeError) as exc:
        print(f"newsroom: {exc or 'timed out'}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
