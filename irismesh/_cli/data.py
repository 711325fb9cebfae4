"""`mesh data get|add|remove|set|watch KEY`: the mesh's replicated data from the shell."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

from irismesh._cli.base import (
    CommandError,
    Commands,
    add_command,
    add_family,
    add_shared_options,
    load_keyring,
    make_node,
    print_json,
    stop_on_signals,
    topic_name,
    topic_pattern,
)
from irismesh.errors import MembershipTimeout

TYPES = ("counter", "set", "register", "flag", "map")


def register(commands: Commands) -> None:
    actions = add_family(
        commands,
        "data",
        summary="read, change and watch the mesh's replicated counters, sets and registers",
        description=(
            "Every node that reads or writes a data key holds a replica of it; the replicas\n"
            "converge without a server. These commands join the mesh for a moment, wait up to\n"
            "--wait seconds for another holder of KEY, then read or write with every holder\n"
            "found (consistency all); alone, they see only their own empty replica. KEY is a\n"
            "dot-separated path, sealed under the key of its first segment."
        ),
        examples=(
            "  mesh data add quota.acme 5\n"
            "  mesh data get quota.acme\n"
            "  mesh data add sessions.web s1 --type set\n"
            "  mesh data remove sessions.web s1\n"
            "  mesh data set config.mode fast\n"
            "  mesh data set flags.beta on --type flag\n"
            "  mesh data watch 'flags.#'"
        ),
    )
    for name, summary, value in (
        ("get", "print a key's value", None),
        ("add", "add N to a counter (default 1), or an element to a set", "VALUE"),
        ("remove", "remove an element from a set", "ELEMENT"),
        ("set", "write a register (or a flag: on or off)", "VALUE"),
    ):
        parser = add_command(
            actions,
            name,
            summary=summary,
            description=f"`mesh data {name}` on KEY; --type says what KEY holds.",
            examples=f"  mesh data {name} quota.acme" + (" 1" if value else ""),
            run=run_change,
        )
        parser.add_argument("key", type=topic_name, metavar="KEY")
        if value == "VALUE" and name == "add":
            parser.add_argument("value", nargs="?", default=None, metavar=value)
        elif value:
            parser.add_argument("value", metavar=value)
        default = {"remove": "set", "set": "register"}.get(name, "counter")
        parser.add_argument(
            "--type", choices=TYPES, default=default, help="what KEY holds (default: %(default)s)"
        )
        add_shared_options(
            parser, joining=(2.0, "most seconds to find another holder"), json="the value as JSON"
        )
    watch = add_command(
        actions,
        "watch",
        summary="print each change of the keys matching a pattern until Ctrl-C",
        description="One line per change: the key, a tab, the new value (--json: an object).",
        examples="  mesh data watch 'flags.#'",
        run=run_watch,
    )
    watch.add_argument("pattern", type=topic_pattern, metavar="PATTERN")
    add_shared_options(watch, joining=(None, "unused"), json="one JSON object per change")


def _handle(node: Any, kind: str, key: str) -> Any:
    return getattr(node.data, kind)(key)


async def run_change(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    async with make_node(args, keys) as node:
        handle = _handle(node, args.type, args.key)
        with contextlib.suppress(MembershipTimeout, TimeoutError):
            await node.wait_for_subscribers("_data." + args.key, 1, timeout=args.wait)
        options = {"consistency": "all", "timeout": max(args.wait, 1.0)}
        action, kind, value = args.action, args.type, getattr(args, "value", None)
        if action == "add" and kind == "counter":
            await handle.add(_int(value if value is not None else "1"), **options)
        elif action == "add" and kind == "set":
            await handle.add(_required(value), **options)
        elif action == "remove" and kind == "set":
            await handle.remove(_required(value), **options)
        elif action == "set" and kind == "register":
            await handle.set(_required(value), **options)
        elif action == "set" and kind == "flag":
            if value not in ("on", "off"):
                raise CommandError("a flag is set on or off")
            await (handle.enable if value == "on" else handle.disable)(**options)
        elif action != "get":
            raise CommandError(f"`mesh data {action}` does not apply to a {kind}")
        shown = await handle.get(**options)
    _print(args.key, shown, args.json)
    return 0


async def run_watch(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    stop = stop_on_signals()
    loop = asyncio.get_running_loop()
    async with make_node(args, keys) as node, node.data.watch(args.pattern) as watch:
        stopping = loop.create_task(stop.wait())
        while True:
            change = loop.create_task(watch.get())
            await asyncio.wait((change, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not change.done():
                change.cancel()
                return 0
            item = change.result()
            _print(item.key, item.value, args.json)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, frozenset | set | list | tuple):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    return value


def _print(key: str, value: Any, as_json: bool) -> None:
    if as_json:
        print_json({"key": key, "value": _plain(value)})
    else:
        print(f"{key}\t{_plain(value)}", flush=True)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CommandError(f"a counter adds an integer, not {text!r}") from None


def _required(value: str | None) -> str:
    if value is None:
        raise CommandError("give the element or value after KEY")
    return value
