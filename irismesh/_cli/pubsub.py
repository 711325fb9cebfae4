"""`mesh publish` and `mesh subscribe`: messages on topics, to whoever subscribed.

`mesh publish` is a new node: before it publishes it must know who is interested, which it
learns by linking to the other nodes (each tells a newcomer its subscriptions at once). It
therefore waits until the peers it sees stop changing, or with --wait-subscribers until that
many nodes subscribed to the topic, the reliable way in scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import irismesh
from irismesh._cli.base import (
    CommandError,
    Commands,
    StdinReader,
    StdoutWriter,
    UsageError,
    add_command,
    add_priority_option,
    add_shared_options,
    add_timeout_option,
    client_keyring,
    load_keyring,
    make_node,
    positive_int,
    positive_number,
    print_json,
    reload_keys_on_hangup,
    seconds,
    settle,
    short_id,
    stderr_console,
    stop_on_signals,
    text_fields,
    topic_name,
    topic_pattern,
    topic_scope,
    wait_for_cluster,
    where,
)
from irismesh._cli.listing import nobody_answered
from irismesh.errors import InterestTimeout, PayloadTooLarge, SlowConsumer
from irismesh.memory.service import MEMORY_CLUSTER
from irismesh.patterns.pubsub import POLICIES, Message, Subscription


def register(commands: Commands) -> None:
    publish = add_command(
        commands,
        "publish",
        summary="publish a message on a topic to every node subscribed to it",
        description=(
            "Joins the mesh as a client and publishes PAYLOAD (empty if left out) on TOPIC.\n"
            "First it finds out who subscribed: it waits until the peers it sees stop changing\n"
            "(up to --wait seconds), or with --wait-subscribers N until N nodes subscribed to\n"
            "TOPIC (exit 1 if they did not within --wait seconds); use that in scripts that\n"
            "start a subscriber and then publish. --count N publishes it N times, --rate R at\n"
            "most R a second. PAYLOAD '-' reads standard input and publishes each line as one\n"
            "message (without its newline), as lines come (`tail -f log | mesh publish ...`);\n"
            "--count then stops after N lines. Prints how many nodes the messages reached: 0\n"
            "is no error (nobody subscribed). --json prints an object: topic, published,\n"
            "reached (the most nodes a message reached), reached_min (the fewest), seconds.\n"
            "A subscriber that blocks publishers and reads too slowly makes a publish wait; one\n"
            "that waits --timeout seconds fails (exit 1). TOPIC's first segment names the\n"
            "keyring scope its messages are sealed under (else the default key '*')."
        ),
        examples=(
            "  mesh publish feeds.world.42 'Hello'\n"
            "  mesh publish feeds.world.42 hi --wait-subscribers 2\n"
            "  tail -f app.log | mesh publish logs.app -\n"
            "  mesh publish ticks.1s tick --count 60 --rate 1 --json"
        ),
        run=run_publish,
    )
    publish.add_argument("topic", type=topic_name, metavar="TOPIC", help="e.g. feeds.world.42")
    publish.add_argument(
        "payload",
        nargs="?",
        default="",
        metavar="PAYLOAD",
        help="message body (default: empty); '-' reads stdin, one message per line",
    )
    publish.add_argument(
        "--count",
        type=positive_int,
        metavar="N",
        help="publish PAYLOAD N times (with '-': at most N lines)",
    )
    publish.add_argument(
        "--retain",
        action="store_true",
        help=(
            "also remember each message under TOPIC with the mesh's memory members (`mesh"
            " memory`), for `mesh reread`; fails if no memory member runs"
        ),
    )
    publish.add_argument(
        "--rate",
        type=positive_number,
        metavar="PER_SECOND",
        help="publish at most this many messages a second (default: as fast as they go)",
    )
    publish.add_argument(
        "--wait-subscribers",
        type=positive_int,
        metavar="N",
        help="first wait (up to --wait) until N nodes subscribed to TOPIC",
    )
    add_timeout_option(publish, "most seconds a publish waits for room at a slow subscriber")
    add_priority_option(
        publish, "publishes waiting for a slow subscriber's room go highest priority first"
    )
    add_shared_options(
        publish,
        joining=(3.0, "seconds to wait for the mesh (and --wait-subscribers)"),
        json="a JSON object: topic, published, reached, reached_min, seconds",
    )

    subscribe = add_command(
        commands,
        "subscribe",
        summary="print the messages published on topics matching a pattern",
        description=(
            "Joins the mesh, subscribes to PATTERN and prints each message as it arrives, one\n"
            "line each: the topic, a space, the payload as it came (its own newlines included:\n"
            "use --json to parse); --json: an object with topic, payload (UTF-8 text),\n"
            "payload_base64 (when it is not text), publisher (node id) and missed. Output is\n"
            "flushed line by line. In PATTERN, '*' stands for one segment and '#' for\n"
            "any number: 'feeds.*' matches feeds.world, 'feeds.#' every feeds topic,\n"
            "'feeds.#.corrections' feeds.world.42.corrections. Once subscribed (and, with\n"
            "--seed, linked to the mesh) it says so on stderr: 'mesh: subscribed to PATTERN on\n"
            "ENDPOINT (node ID)'; publishers that start later should still use\n"
            "--wait-subscribers. --policy block (the default) loses nothing: a reader too slow\n"
            "holds publishers back; drop_oldest keeps at most --maxsize waiting and drops the\n"
            "oldest, and the next message says how many were missed (on stderr without --json).\n"
            "Exit status: 0 after --count messages, on Ctrl-C or SIGTERM, or when --timeout\n"
            "seconds pass without a message after at least one came; 1 when --timeout seconds\n"
            "pass before any message came, or before --count did; 2 bad arguments."
        ),
        examples=(
            "  mesh subscribe 'feeds.#'\n"
            "  mesh subscribe 'feeds.*.*' --json | jq .payload\n"
            "  mesh subscribe 'feeds.#.corrections' --count 1\n"
            "  mesh subscribe --bind tcp://127.0.0.1:7500 'logs.#' --policy drop_oldest"
        ),
        run=run_subscribe,
    )
    subscribe.add_argument(
        "pattern", type=topic_pattern, metavar="PATTERN", help="e.g. 'feeds.#' or 'feeds.*.42'"
    )
    subscribe.add_argument("--count", type=positive_int, metavar="N", help="exit after N messages")
    subscribe.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        help="exit after this long without a message (status 1 if none came at all)",
    )
    subscribe.add_argument(
        "--policy",
        choices=POLICIES,
        default="block",
        help="when this reader falls behind: hold publishers back, or drop the oldest "
        "(default: %(default)s)",
    )
    subscribe.add_argument(
        "--maxsize",
        type=positive_int,
        default=1024,
        metavar="N",
        help="messages waiting to be printed before the policy applies (default: %(default)s)",
    )
    add_shared_options(
        subscribe,
        joining=(10.0, "with --seed: seconds to wait for a peer"),
        json="one JSON object per message",
    )


# ----------------------------------------------------------------- publish


async def run_publish(args: argparse.Namespace) -> int:
    keys = client_keyring(args, topic_scope(args.topic) or "*")
    limit = irismesh.CoreConfig().max_payload
    if args.payload != "-" and len(args.payload.encode()) > limit:
        raise UsageError(f"PAYLOAD is {len(args.payload.encode())} bytes, above the {limit} limit")
    async with make_node(args, keys) as node:
        if args.retain:
            await wait_for_cluster(node, args, MEMORY_CLUSTER)
        await find_subscribers(node, args)
        reached: list[int] = []
        started = time.perf_counter()
        with publish_progress(args) as progress:
            async for payload in payloads(args):
                try:
                    reached.append(
                        await node.publish(
                            args.topic,
                            payload,
                            timeout=args.timeout,
                            retain=args.retain,
                            priority=args.priority,
                        )
                    )
                except SlowConsumer as exc:
                    raise CommandError(f"{exc} ({len(reached)} published before)") from None
                except PayloadTooLarge as exc:
                    raise UsageError(
                        f"message {len(reached) + 1}: {exc}; nothing more published"
                    ) from None
                progress(len(reached))
        elapsed = time.perf_counter() - started
        # The library stages a publish and sends it at the end of this loop iteration; a node
        # closed at once would say goodbye first and its peers would drop what follows it.
        await asyncio.sleep(0)
    if args.json:
        print_json(
            {
                "topic": args.topic,
                "published": len(reached),
                "reached": max(reached, default=0),
                "reached_min": min(reached, default=0),
                "seconds": round(elapsed, 3),
            }
        )
    else:
        print(publish_summary(args.topic, reached, elapsed), flush=True)
    return 0


async def find_subscribers(node: irismesh.Node, args: argparse.Namespace) -> None:
    """Wait until this new node knows who subscribed to the topic (see the module's docstring)."""
    if args.wait_subscribers is not None:
        wanted = args.wait_subscribers
        try:
            with stderr_console().status(f"waiting for {wanted} subscriber(s) of {args.topic!r}"):
                await node.wait_for_subscribers(args.topic, wanted, timeout=args.wait)
        except InterestTimeout as exc:
            raise CommandError(
                f"{exc.found} node(s) subscribed to {args.topic!r} after {args.wait:g} s, "
                f"wanted {wanted} (looked via {where(args)}; same keyring there?)"
            ) from None
        return
    if not await settle(node, args.wait):
        raise nobody_answered(args)


async def payloads(args: argparse.Namespace) -> AsyncIterator[bytes]:
    """The messages to publish, each when it is due (--rate)."""
    if args.payload == "-":
        source = StdinReader().lines()
    else:
        source = _repeat(args.payload.encode(), args.count or 1)
    interval = 1 / args.rate if args.rate else 0.0
    due = time.monotonic()
    count = 0
    async for payload in source:
        if interval:
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            due = max(due, time.monotonic() - interval) + interval
        yield payload
        count += 1
        if args.count is not None and count >= args.count:
            return


async def _repeat(payload: bytes, times: int) -> AsyncIterator[bytes]:
    for _ in range(times):
        yield payload


@contextlib.contextmanager
def publish_progress(args: argparse.Namespace) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (terminals only) while publishing many; called per message."""
    total = args.count if args.payload != "-" else None
    console = stderr_console()
    if not console.is_terminal or ((total or 0) < 2 and args.payload != "-"):
        yield lambda done: None
        return
    progress = Progress(
        TextColumn(f"publishing to {args.topic!r}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task("publish", total=total)
    shown = 0.0

    def update(done: int) -> None:
        nonlocal shown
        now = time.monotonic()
        if now - shown > 0.1:
            shown = now
            progress.update(task, completed=done)

    with progress:
        yield update


def publish_summary(topic: str, reached: list[int], elapsed: float) -> str:
    if not reached:
        return f"published nothing to {topic!r} (no input)"
    low, high = min(reached), max(reached)
    nodes = f"{high} node(s)" if low == high else f"{low} to {high} node(s)"
    if len(reached) == 1:
        return f"published to {topic!r}: reached {nodes}"
    took = f"{elapsed:.2f} s" if elapsed >= 1 else f"{elapsed * 1000:.1f} ms"
    return f"published {len(reached)} messages to {topic!r} in {took}: each reached {nodes}"


# ----------------------------------------------------------------- subscribe


async def run_subscribe(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    scope = topic_scope(args.pattern)
    if scope is not None:
        keys.require(scope)  # its publishers seal under that key: without it nothing opens
    stop = stop_on_signals()
    async with make_node(args, keys) as node:
        reload_keys_on_hangup(node)
        sub = node.subscribe(args.pattern, policy=args.policy, maxsize=args.maxsize)
        if args.seed:  # a seed should answer; discovery alone may find others later
            await _join(node, args)
        print(
            f"mesh: subscribed to {args.pattern!r} on {node.endpoint} "
            f"(node {short_id(node.node_id.hex())})",
            file=sys.stderr,
            flush=True,
        )
        out = StdoutWriter()
        try:
            received = await _print_messages(sub, out, args, stop)
        finally:
            sub.close()
            await out.close()
    if args.count is not None and received < args.count and not stop.is_set():
        raise CommandError(
            f"{received} of {args.count} message(s) on {args.pattern!r}, then none for "
            f"{args.timeout:g} s"
        )
    if received == 0 and not stop.is_set():
        raise CommandError(f"no message on {args.pattern!r} in {args.timeout:g} s")
    return 0


async def _join(node: irismesh.Node, args: argparse.Namespace) -> None:
    """Wait for a first peer: the subscription travels to the mesh from it."""
    deadline = time.monotonic() + args.wait
    with stderr_console().status("joining the mesh"):
        while not any(p.rtt_ms > 0 for p in node.peers()):
            if time.monotonic() >= deadline:
                raise nobody_answered(args)
            await asyncio.sleep(0.02)


async def _print_messages(
    sub: Subscription, out: StdoutWriter, args: argparse.Namespace, stop: asyncio.Event
) -> int:
    """Print messages until --count, --timeout idle, or `stop`; returns how many came."""
    received = 0
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while (args.count is None or received < args.count) and not stop.is_set():
            message = sub.get_nowait()
            if message is None:
                getting = asyncio.ensure_future(sub.get())
                done, _ = await asyncio.wait(
                    {getting, stopping}, timeout=args.timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if getting not in done:
                    getting.cancel()
                    return received
                message = getting.result()
            # Everything already waiting goes out in one write (up to --count).
            batch = [message]
            while args.count is None or received + len(batch) < args.count:
                more = sub.get_nowait()
                if more is None:
                    break
                batch.append(more)
            received += len(batch)
            await out.write(b"".join(_render(m, args.json) for m in batch))
        return received
    finally:
        stopping.cancel()


def _render(message: Message, as_json: bool) -> bytes:
    if as_json:
        fields = {
            "topic": message.topic,
            **text_fields("payload", message.payload),
            "publisher": message.publisher,
            "missed": message.missed,
        }
        return json.dumps(fields).encode() + b"\n"
    line = message.topic.encode() + b" " + message.payload
    if not line.endswith(b"\n"):
        line += b"\n"
    if message.missed:
        # On stderr, so that stdout stays one message per line.
        print(
            f"mesh: missed {message.missed} message(s) before this one",
            file=sys.stderr,
            flush=True,
        )
    return line
