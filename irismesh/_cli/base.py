"""What every `mesh` command shares: one-line errors, argument types, joining the mesh.

Exit statuses: 0 done; 1 the mesh said no (no member, a timeout, a remote error); 2 the user's
arguments or files are wrong (argparse, `ConfigurationError`, `NoKey`); 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn, TypeAlias, TypeVar

from rich.console import Console

import irismesh
from irismesh import _env
from irismesh._cli import config
from irismesh._core.records import validate_name
from irismesh._core.split import validate_version
from irismesh._core.topics import validate_pattern, validate_topic
from irismesh.errors import ConfigurationError, MembershipTimeout

# A command's body: plain, or async when it joins the mesh (main runs it in asyncio.run).
Run = Callable[[argparse.Namespace], int | Coroutine[Any, Any, int]]

_T = TypeVar("_T")

USAGE_ERROR = 2
MESH_ERROR = 1

# Peers found and heard from, and no new one for this long: the mesh as seen from here is known.
SETTLED_FOR = 0.3
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5}|\*)")


class CommandError(Exception):
    """A command cannot go on; `status` is the exit status (1 the mesh, 2 the user)."""

    def __init__(self, message: str, status: int = MESH_ERROR) -> None:
        super().__init__(message)
        self.status = status


class UsageError(CommandError):
    """The user's arguments or files are wrong (exit status 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, USAGE_ERROR)


class MeshArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"mesh: {message} (see `{self.prog} --help`)\n")


# What a command module's `register` adds its subcommands to.
Commands: TypeAlias = "argparse._SubParsersAction[MeshArgumentParser]"


def add_command(
    commands: Commands,
    name: str,
    *,
    summary: str,
    description: str,
    examples: str,
    run: Run | None,
) -> MeshArgumentParser:
    """A subcommand whose --help has a summary, a paragraph and examples.

    `run` is None for a command that only groups subcommands of its own (`mesh telemetry`).
    """
    parser = commands.add_parser(
        name,
        help=summary,
        description=f"{summary[0].upper()}{summary[1:]}.\n\n{description}",
        epilog=f"examples:\n{examples}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if run is not None:
        parser.set_defaults(run=run)
    return parser


def add_family(
    commands: Commands,
    name: str,
    *,
    summary: str,
    description: str,
    examples: str,
    dest: str = "action",
    metavar: str = "ACTION",
) -> Commands:
    """A command that only groups subcommands (`mesh context add|ls|use|rm`); what to add
    them to. The chosen subcommand's name is `args.<dest>`."""
    family = add_command(
        commands, name, summary=summary, description=description, examples=examples, run=None
    )
    return family.add_subparsers(dest=dest, required=True, metavar=metavar)


# ----------------------------------------------------------------- argument types


def seconds(text: str) -> float:
    """A positive number of seconds."""
    return _finite(text, "a positive number of seconds")


def seconds_or_zero(text: str) -> float:
    return _finite(text, "zero or more seconds", zero=True)


def positive_number(text: str) -> float:
    return _finite(text, "a positive number")


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def byte_size(text: str) -> int:
    value = _int(text)
    limit = irismesh.CoreConfig().max_payload
    if not 0 <= value <= limit:
        raise argparse.ArgumentTypeError(f"must be between 0 and {limit} bytes, got {text!r}")
    return value


def _finite(text: str, what: str, *, zero: bool = False) -> float:
    """A finite number above zero (or zero too); else the usage error "must be `what`"."""
    value = _float(text)
    if not (value >= 0 if zero else value > 0) or value == float("inf"):  # NaN fails both
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _float(text: str) -> float:
    return _parsed(float, text, "a number")


def _int(text: str) -> int:
    return _parsed(int, text, "a whole number")


def _parsed(kind: Callable[[str], _T], text: str, what: str) -> _T:
    """`kind(text)`; its ValueError is the usage error "must be `what`"."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_BYTES = re.compile(r"\s*(\d+)\s*(?:([kmg])i?b)?\s*", re.IGNORECASE)


def window_size(text: str) -> int:
    """A flow-control window: bytes, or a number with KiB, MiB or GiB (1 byte to 1 GiB).
    KB, MB and GB are read as KiB, MiB and GiB."""
    match = _BYTES.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"must be a size in bytes, KiB, MiB or GiB (e.g. 262144 or 256KiB), got {text!r}"
        )
    value = int(match[1]) * _UNITS[(match[2] or "").lower()]
    if not 1 <= value <= 1 << 30:
        raise argparse.ArgumentTypeError(f"must be 1 byte to 1 GiB, got {text!r}")
    return value


def seed_endpoint(text: str) -> str:
    """tcp://HOST:PORT of a node to dial."""
    match = _ENDPOINT.fullmatch(text)
    if not match or match[2] == "*" or not 0 < int(match[2]) < 65536:
        raise argparse.ArgumentTypeError(f"bad endpoint {text!r}: expected tcp://HOST:PORT")
    return text


def bind_endpoint(text: str) -> str:
    """tcp://HOST:PORT to listen on; port 0 or * picks a free one."""
    match = _ENDPOINT.fullmatch(text)
    if not match or (match[2] != "*" and not 0 <= int(match[2]) < 65536):
        raise argparse.ArgumentTypeError(
            f"bad endpoint {text!r}: expected tcp://HOST:PORT (port 0 picks a free one)"
        )
    return text


def _argument(check: Callable[[str], _T], text: str) -> _T:
    """What `check` makes of `text`; its ConfigurationError is a usage error (argparse prints
    the message and exits with status 2)."""
    try:
        return check(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def metrics_address(text: str) -> str:
    """--metrics: HOST:PORT (or :PORT, PORT) where the node serves Prometheus metrics."""
    _argument(_env.metrics_address, text)
    return text


def node_name(text: str) -> str:
    """--name: what peers, `mesh peers`, `mesh top` and the telemetry report call the node."""
    return _argument(validate_name, text)


def version_name(text: str) -> str:
    """--version: what version a member serves as (`mesh split` weighs versions)."""
    return _argument(validate_version, text)


def topic_name(text: str) -> str:
    """A topic to publish on: dot-separated segments, no wildcards."""
    return _argument(validate_topic, text)


def topic_pattern(text: str) -> str:
    """A subscription pattern: segments, each a literal, `*` or `#`."""
    return _argument(validate_pattern, text)


def cluster_name(text: str) -> str:
    if not text or len(text) > 200 or any(c.isspace() for c in text) or text == "*":
        raise argparse.ArgumentTypeError(
            f"bad cluster name {text!r}: 1-200 characters, no whitespace, not '*'"
        )
    return text


def topic_scope(topic: str) -> str | None:
    """The keyring scope a topic's messages are sealed under (its first segment); None when a
    pattern starts with a wildcard and so may match topics of any scope."""
    first = topic.partition(".")[0]
    return None if first in ("*", "#") else first


# ----------------------------------------------------------------- joining the mesh


def add_context_option(parser: argparse._ActionsContainer) -> None:
    """--context NAME; on a subcommand it leaves the root's value alone unless given."""
    parser.add_argument(
        "--context",
        metavar="NAME",
        default=argparse.SUPPRESS,
        help="take the keyring, seeds and interface of this context (`mesh context ls`)",
    )


def add_repeatable(
    parser: argparse._ActionsContainer,
    flag: str,
    *,
    metavar: str,
    help: str,
    type: Callable[[str], Any] = str,
) -> None:
    """An option that may be given again and again: `args.<flag>` lists its values (each made
    by `type`), [] when it is not given."""
    parser.add_argument(flag, action="append", default=[], type=type, metavar=metavar, help=help)


def add_directory(parser: MeshArgumentParser, flag: str, what: str) -> None:
    """A required option naming a directory (`args.<flag>` is a Path); `what` says what it
    holds and whether the command makes it."""
    parser.add_argument(flag, required=True, type=Path, metavar="DIR", help=what)


def add_joining_options(parser: MeshArgumentParser, *, wait: float | None, wait_help: str) -> None:
    group = parser.add_argument_group(
        "joining the mesh",
        "Nodes on this machine find each other with no flags (discovery on 127.0.0.1).",
    )
    group.add_argument(
        "--keys",
        type=Path,
        metavar="FILE",
        help="keyring file (default: the context's, else $IRISMESH_KEYFILE, else "
        f"{_home(_env.default_keyfile())}, which `mesh keygen` writes)",
    )
    add_repeatable(
        group,
        "--seed",
        type=seed_endpoint,
        metavar="ENDPOINT",
        help="tcp://HOST:PORT of a running node (repeatable; also $IRISMESH_SEEDS)",
    )
    group.add_argument(
        "--interface",
        metavar="ADDRESS",
        help="discover nodes on the interface with this IPv4 address, and listen there "
        "(default: $IRISMESH_INTERFACE, else 127.0.0.1)",
    )
    choice = group.add_mutually_exclusive_group()
    choice.add_argument(
        "--no-discovery",
        action="store_true",
        help="join through the seeds only (also IRISMESH_DISCOVERY=0)",
    )
    choice.add_argument(
        "--survey",
        action="store_true",
        help="discover by multicast survey even if IRISMESH_DISCOVERY=0",
    )
    group.add_argument(
        "--bind",
        type=bind_endpoint,
        metavar="ENDPOINT",
        help="where this node listens (default: tcp://127.0.0.1:0, or the --interface address)",
    )
    group.add_argument(
        "--identity",
        type=Path,
        metavar="FILE",
        help="the node's identity (`mesh identity new`): its id derives from it "
        "(default: $IRISMESH_IDENTITY, else a fresh one)",
    )
    group.add_argument(
        "--grant",
        type=Path,
        metavar="FILE",
        help="the node's grant (`mesh grant --out`), where the keyring requires grants "
        "(default: $IRISMESH_GRANT, else node.grant beside the keyring with the default "
        "identity)",
    )
    add_context_option(group)
    if wait is not None:
        group.add_argument(
            "--wait",
            type=seconds_or_zero,
            default=wait,
            metavar="SECONDS",
            help=f"{wait_help} (default: %(default)s)",
        )


def priority(text: str) -> int:
    """low, normal, high (any case), or a whole number from MIN_PRIORITY to MAX_PRIORITY."""
    named = {p.name.lower(): int(p) for p in irismesh.Priority}
    value = named.get(text.strip().lower())
    if value is not None:
        return value
    low, high = irismesh.MIN_PRIORITY, irismesh.MAX_PRIORITY
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"must be low, normal, high or a whole number from {low} to {high}, got {text!r}"
        )
    return value


def add_priority_option(parser: MeshArgumentParser, what: str) -> None:
    parser.add_argument(
        "--priority",
        type=priority,
        default=0,
        metavar="PRIORITY",
        help=f"low, normal, high, or -7 to 7: {what} (default: normal)",
    )


def add_timeout_option(parser: MeshArgumentParser, what: str) -> None:
    """--timeout SECONDS, 5 by default; `what` says what it bounds."""
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help=f"{what} (default: %(default)s)",
    )


# `joining` of a command that talks to the members of its CLUSTER argument.
MEMBER_WAIT = (3.0, "seconds to wait for a member of CLUSTER to appear")


def add_shared_options(
    parser: MeshArgumentParser,
    *,
    timeout: str | None = None,
    joining: tuple[float | None, str] | None = None,
    metrics: bool = False,
    json: str | None = None,
) -> None:
    """The options commands share, declared at the end of a command so that its --help lists
    them last, in this order: --timeout (`timeout` says what it bounds), joining the mesh
    (`joining` is --wait's default, None for no --wait, and its help), --metrics, --json
    (`json` is its help). Each is left out unless asked for."""
    if timeout is not None:
        add_timeout_option(parser, timeout)
    if joining is not None:
        wait, wait_help = joining
        add_joining_options(parser, wait=wait, wait_help=wait_help)
    if metrics:
        add_metrics_option(parser)
    if json is not None:
        add_json_option(parser, json)


def add_metrics_option(parser: MeshArgumentParser) -> None:
    parser.add_argument(
        "--metrics",
        type=metrics_address,
        metavar="ADDR",
        help="serve Prometheus metrics at HOST:PORT/metrics (HOST defaults to 127.0.0.1; "
        "also $IRISMESH_METRICS)",
    )


def add_json_option(parser: MeshArgumentParser, what: str = "JSON for scripts") -> None:
    parser.add_argument("--json", action="store_true", help=what)


def add_written_file(parser: MeshArgumentParser, default: str) -> None:
    """PATH and --force of a command that writes a fresh private file (a keyring, a key);
    `default` says where it writes without PATH. The command finds the path with
    `file_to_write`."""
    parser.add_argument(
        "path", type=Path, nargs="?", metavar="PATH", help=f"file to write (default: {default})"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing file")


def file_to_write(args: argparse.Namespace, default: Callable[[], Path]) -> Path:
    """The file a command declared with `add_written_file` writes: PATH, else `default()` (its
    folder made, private to its owner). An existing file is refused unless --force."""
    path: Path | None = args.path
    if path is None:
        path = default()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists() and not args.force:
        raise CommandError(f"{path} already exists: pass --force to replace it", USAGE_ERROR)
    return path


def _home(path: Path) -> str:
    """`path` with the home directory written ~, for help texts."""
    try:
        return f"~/{path.relative_to(Path.home())}"
    except ValueError:
        return str(path)


def apply_settings(args: argparse.Namespace) -> None:
    """Fill in what a joining command's flags left open, each from the first that has it:
    the context named by --context, the environment, the current context, the defaults.

    Afterwards `args.keys` is the keyring file (None: $IRISMESH_KEYS or $IRISMESH_KEYFILE),
    `args.seed` every seed ($IRISMESH_SEEDS included), `args.interface` the discovery
    interface (None: loopback), `args.survey` whether this node discovers and
    `args.survey_asked` whether --survey asked for it by name.
    """
    named: str | None = getattr(args, "context", None)
    settings = config.load()
    context = settings.get(named) if named is not None else None
    current = settings.get(settings.current) if settings.current and context is None else None
    env_keys = bool(os.environ.get("IRISMESH_KEYFILE") or os.environ.get("IRISMESH_KEYS"))
    if args.keys is None:
        if context is not None and context.keyring is not None:
            args.keys = context.keyring
        elif env_keys:
            pass  # load_keyring reads it
        elif current is not None and current.keyring is not None:
            args.keys = current.keyring
        elif _env.default_keyfile().exists():
            args.keys = _env.default_keyfile()
    if not args.seed:
        chosen = context or current
        args.seed = list(chosen.seeds) if chosen is not None else []
    args.seed = list(dict.fromkeys([*args.seed, *map(_env_seed, _env.seeds())]))
    if args.interface is None:
        args.interface = (
            (context.interface if context is not None else None)
            or _env.interface()
            or (current.interface if current is not None else None)
        )
    if args.interface is not None:
        try:
            config.check_interface(args.interface)
        except ConfigurationError as exc:
            raise UsageError(f"--interface: {exc}") from None
    if args.bind is None:
        args.bind = f"tcp://{args.interface or '127.0.0.1'}:0"
    args.survey_asked = args.survey
    if args.survey:
        return
    try:
        args.survey = not args.no_discovery and _env.discovery_enabled()
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from None


def _env_seed(text: str) -> str:
    try:
        return seed_endpoint(text)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"IRISMESH_SEEDS: {exc}") from None


def load_keyring(path: Path | None) -> irismesh.Keyring:
    """The keyring apply_settings chose: checked first, before anything else a command needs."""
    if path is not None:
        return irismesh.Keyring.load(path)
    keys = irismesh.Keyring.from_env()
    if keys is None:
        raise UsageError(
            "no keyring: pass --keys FILE, set IRISMESH_KEYFILE, or run `mesh keygen` to write "
            f"the default one ({_env.default_keyfile()})"
        )
    return keys


def make_node(
    args: argparse.Namespace,
    keys: irismesh.Keyring,
    clusters: Sequence[str] = (),
    name: str | None = None,
    memory: Path | None = None,
    version: str | None = None,
    memory_sync: str = "fsync",
) -> irismesh.Node:
    """The command's own node; a pure client unless `clusters` are given (or a `memory`
    directory, which makes it a memory member); named `name`, else by host and process id;
    serving as `version` (traffic splits), else as none."""
    return irismesh.Node(
        clusters[0] if clusters else None,
        keyring=keys,
        clusters=clusters[1:],
        bind=args.bind,
        seeds=args.seed,
        # By default as the library's: a survey that cannot start is a warning, not an error.
        survey=True if args.survey_asked else None,
        discovery=args.survey,
        interface=args.interface,
        name=name,
        memory=memory,
        memory_sync=memory_sync,
        metrics=getattr(args, "metrics", None),
        version=version,
        identity=getattr(args, "identity", None),
        grant=getattr(args, "grant", None),
    )


def client_keyring(args: argparse.Namespace, scope: str | None = None) -> irismesh.Keyring:
    """The keyring of a command whose node joins as a client, once what can fail before
    joining has been checked: a way to find other nodes, and a key for `scope` (NoKey now, not
    after --wait seconds)."""
    keys = load_keyring(args.keys)
    require_discovery(args)
    if scope is not None:
        keys.require(scope)
    return keys


@contextlib.asynccontextmanager
async def cluster_client(
    args: argparse.Namespace, keys: irismesh.Keyring, cluster: str
) -> AsyncIterator[irismesh.Node]:
    """The command's client node, once `cluster` has a live member (CommandError after --wait
    seconds without one)."""
    async with make_node(args, keys) as node:
        await wait_for_cluster(node, args, cluster)
        yield node


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets: a long-running command's cue to end cleanly
    (leave the mesh, flush what it wrote) rather than be killed by a KeyboardInterrupt."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def reload_keys_on_hangup(node: irismesh.Node) -> None:
    """A long-running command rereads its keyring file on SIGHUP (it also does by itself,
    within a second of a change); what happens to it is one line on stderr."""
    log = logging.getLogger("irismesh.keyring")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("mesh: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    if node.keyring.path is None:
        return  # IRISMESH_KEYS: no file to read again

    def hangup() -> None:
        if not node.reload_keyring():
            log.info("keyring %s unchanged: keys in use kept", node.keyring.path)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hangup)


def require_discovery(args: argparse.Namespace) -> None:
    """A node that only looks around must have a way to find others."""
    if not args.seed and not args.survey:
        off = "--no-discovery" if args.no_discovery else "IRISMESH_DISCOVERY=0"
        raise UsageError(
            "nothing to join: pass --seed tcp://HOST:PORT of a running node (or set "
            f"IRISMESH_SEEDS, or a context with seeds), or turn discovery back on ({off} "
            "turned it off)"
        )


def where(args: argparse.Namespace) -> str:
    """Where this command looked, for error messages."""
    places = list(args.seed)
    if args.survey:
        places.append(f"discovery on {args.interface or '127.0.0.1'}")
    return ", ".join(places)


async def wait_for_cluster(node: irismesh.Node, args: argparse.Namespace, cluster: str) -> int:
    """Wait up to --wait seconds for a live member of `cluster`; the number found."""
    try:
        with stderr_console().status(f"waiting for a member of {cluster!r}"):
            return await node.wait_for_members(cluster, timeout=args.wait)
    except MembershipTimeout:
        raise CommandError(
            f"cluster {cluster!r} has no live member after {args.wait:g} s "
            f"(looked via {where(args)}; same keyring there?)"
        ) from None


async def settle(node: irismesh.Node, wait: float) -> list[irismesh.PeerInfo]:
    """The peers once the mesh seen from here stops changing, or when `wait` seconds are up.

    Settled means: some peers, each heard back from (a measured round trip: membership
    probes every member in turn) and none suspected, and none new for SETTLED_FOR seconds.
    Membership spreads every node's record to every other, so one seed soon gives the whole
    mesh. A suspicion is settled too once it resolves (the member refutes it or is dropped):
    a command that just started, on a busy machine, may suspect a member its first probes
    reached late; a member really unreachable stays suspect until `wait` is up, and is shown
    so.
    """
    deadline = time.monotonic() + wait
    known: set[str] = set()
    changed = time.monotonic()
    with stderr_console().status("finding peers") as status:  # shown on terminals only
        while True:
            peers = node.peers()
            now = time.monotonic()
            ids = {p.node_id for p in peers}
            if ids != known:
                known, changed = ids, now
                status.update(f"finding peers: {len(peers)} so far")
            heard = all(p.rtt_ms > 0 and p.state != "suspect" for p in peers)
            if (peers and heard and now - changed >= SETTLED_FOR) or now >= deadline:
                return peers
            await asyncio.sleep(0.02)


# ----------------------------------------------------------------- output


def text_fields(key: str, data: bytes) -> dict[str, str]:
    """`data` for JSON: {key: text}, plus {key_base64: exact bytes} when it is not UTF-8."""
    try:
        return {key: data.decode()}
    except UnicodeDecodeError:
        text = data.decode(errors="replace")
        return {key: text, f"{key}_base64": base64.b64encode(data).decode()}


def read_payload(text: str) -> bytes:
    """A PAYLOAD argument: its UTF-8 bytes, or all of standard input for '-'."""
    return sys.stdin.buffer.read() if text == "-" else text.encode()


def print_json(value: object) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


def stdout_console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Piped tables should not be squeezed to 80 columns and cut node ids short.
        console = Console(highlight=False, width=160)
    return console


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


class StdinReader:
    """Standard input, read by a thread so that the event loop (and the node) never blocks.

    Each read returns what is there, up to `size` bytes, without waiting for more: a block of
    a file or pipe, a line typed at a terminal. At most `ahead` blocks wait unread, so a fast
    stdin is held back by a slow consumer. The thread is a daemon reading the file descriptor
    itself (not `sys.stdin`, whose lock a blocked daemon would hold at exit): a command that
    finishes while its stdin is still open (a terminal) exits without waiting for it.
    """

    def __init__(self, size: int = 1 << 16, ahead: int = 2) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[bytes | OSError] = asyncio.Queue()
        self._permits = threading.Semaphore(ahead)
        self._size = size
        self._ended = False
        threading.Thread(target=self._run, name="mesh-stdin", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._permits.acquire()
            item: bytes | OSError
            try:
                item = os.read(0, self._size)
            except OSError as exc:  # a closed or unreadable stdin
                item = exc
            try:
                self._loop.call_soon_threadsafe(self._items.put_nowait, item)
            except RuntimeError:  # the loop is gone: the command is over
                return
            if not isinstance(item, bytes) or not item:
                return

    async def get(self) -> bytes:
        """The next block; b"" at the end of input."""
        if self._ended:
            return b""
        item = await self._items.get()
        self._permits.release()
        if isinstance(item, bytes):
            self._ended = not item
            return item
        self._ended = True
        raise UsageError(f"cannot read standard input: {item}")

    async def lines(self) -> AsyncIterator[bytes]:
        """Each line as it comes, without its newline (and the last one, if it has none)."""
        pending = b""
        while block := await self.get():
            pending += block
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line
        if pending:
            yield pending


class StdoutWriter:
    """Bytes to standard output, written and flushed by a thread, in order.

    The event loop never blocks on a slow reader (the node keeps answering its peers): at most
    `depth` writes wait, and `write` waits for room beyond that, so a slow reader slows the
    command down instead of filling memory. A write error (BrokenPipeError: the reader went
    away) is raised by the next `write` or by `close`.
    """

    def __init__(self, stream: IO[bytes] | None = None, depth: int = 8) -> None:
        self._loop = asyncio.get_running_loop()
        self._stream = sys.stdout.buffer if stream is None else stream
        self._room = asyncio.Semaphore(depth)
        self._chunks: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._done: asyncio.Future[None] = self._loop.create_future()
        threading.Thread(target=self._run, name="mesh-stdout", daemon=True).start()

    def _run(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            try:
                self._stream.write(chunk)
                self._stream.flush()
            except BaseException as exc:
                self._error = exc
                break
            finally:
                self._call(self._room.release)
        self._call(self._finish)

    def _call(self, callback: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone
            self._loop.call_soon_threadsafe(callback)

    def _finish(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    async def write(self, data: bytes) -> None:
        if self._error is None:
            await self._room.acquire()
        if self._error is not None:
            self._room.release()  # whoever else waits sees the error too
            raise self._error
        self._chunks.put(data)

    async def close(self) -> None:
        """Wait until everything written is out; raises what went wrong, if anything did."""
        if self._error is None:
            self._chunks.put(None)
            await asyncio.shield(self._done)
        if self._error is not None:
            raise self._error


def short_id(node_id: str) -> str:
    return node_id[:12]


def ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
