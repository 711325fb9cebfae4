"""`mesh node`: a member that echoes each request, or answers it by running a command.

It answers surveys as it answers requests, and prints each broadcast it gets on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

import irismesh
from irismesh._cli.base import (
    USAGE_ERROR,
    CommandError,
    MeshArgumentParser,
    add_command,
    add_joining_options,
    add_json_option,
    cluster_name,
    load_keyring,
    make_node,
    positive_int,
    print_json,
    seconds,
    text_fields,
)


def register(commands: argparse._SubParsersAction[MeshArgumentParser]) -> None:
    parser = add_command(
        commands,
        "node",
        summary="run a member of a cluster that echoes, or runs a command for each request",
        description=(
            "Joins the mesh as a member of --cluster and serves its requests until Ctrl-C or\n"
            "SIGTERM, when it says goodbye and its peers stop sending to it at once. It echoes\n"
            "each request (after --prefix), or with --exec runs CMD once per request: the payload\n"
            "on CMD's stdin, CMD's stdout the reply. A CMD that exits non-zero or outlives\n"
            "--exec-timeout fails that request: the caller gets a RemoteError carrying the last\n"
            "line of CMD's stderr. CMD is split like a shell line but run without a shell.\n"
            "Surveys (`mesh survey`) are answered the same way as requests. Each broadcast\n"
            "(`mesh broadcast`) is printed on stdout, one line: --prefix then the payload\n"
            "(--json: an object with `broadcast`, and `broadcast_base64` when it is not text);\n"
            "the sender counts this member once the line is written. The first line printed\n"
            "says where the node listens (--json: an object with `endpoint` and `node_id`)."
        ),
        examples=(
            "  mesh node --keys mesh.keys --cluster echo --bind tcp://127.0.0.1:7400\n"
            "  mesh node --keys mesh.keys --cluster echo --seed tcp://127.0.0.1:7400 --prefix B:\n"
            "  mesh node --keys mesh.keys --cluster upper --seed tcp://127.0.0.1:7400 \\\n"
            "      --exec 'tr a-z A-Z' --concurrency 4 --exec-timeout 2\n"
            "  mesh node --cluster count --seed tcp://127.0.0.1:7400 --exec 'wc -c'"
        ),
        run=run_node,
    )
    parser.add_argument(
        "--cluster",
        required=True,
        action="append",
        type=cluster_name,
        metavar="C",
        help="cluster to serve (repeatable: one handler serves them all)",
    )
    answer = parser.add_mutually_exclusive_group()
    answer.add_argument("--prefix", default="", help="text put before each echoed request")
    answer.add_argument("--exec", dest="command", metavar="CMD", help="command run per request")
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=8,
        metavar="N",
        help="--exec: at most N commands at once; more requests queue (default: %(default)s)",
    )
    parser.add_argument(
        "--exec-timeout",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="--exec: kill a command running longer and fail its request (default: %(default)s)",
    )
    add_joining_options(parser, wait=None, wait_help="")
    add_json_option(parser, "print the listening line as JSON")


class CommandFailed(Exception):
    """The command of `mesh node --exec` exited non-zero; the caller sees this as RemoteError."""

    def __init__(self, last_line: str, status: int) -> None:
        what = f"exit status {status}" if status >= 0 else f"killed by signal {-status}"
        super().__init__(f"{last_line} ({what})" if last_line else f"command failed ({what})")
        self.last_line = last_line
        self.status = status


class CommandHandler:
    """Answers a request by running `argv`: the payload on stdin, its stdout the reply.

    At most `concurrency` commands run at once (a burst of requests queues rather than fork
    hundreds of processes); each runs in a session of its own so that a timeout kills the
    command and everything it started.
    """

    def __init__(
        self, argv: Sequence[str], *, concurrency: int, timeout: float, max_output: int
    ) -> None:
        self.argv = list(argv)
        self.timeout = timeout
        self.max_output = max_output
        self._slots = asyncio.Semaphore(concurrency)

    async def __call__(self, payload: bytes) -> bytes:
        async with self._slots:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            try:
                out, err = await asyncio.wait_for(proc.communicate(payload), self.timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"command ran longer than {self.timeout:g} s and was killed"
                ) from None
            finally:
                if proc.returncode is None:  # timed out, or the node is closing
                    _kill_session(proc.pid)
                    await proc.wait()
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise CommandFailed(lines[-1].strip() if lines else "", proc.returncode or 0)
        if len(out) > self.max_output:
            raise ValueError(f"command wrote {len(out)} bytes, above the {self.max_output} limit")
        return out


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def command_argv(command: str) -> list[str]:
    """Split --exec's CMD and check that its program exists, so a typo fails at start."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise CommandError(f"bad --exec command {command!r}: {exc}", USAGE_ERROR) from None
    if not argv:
        raise CommandError("--exec needs a command", USAGE_ERROR)
    if shutil.which(argv[0]) is None:
        raise CommandError(
            f"--exec: program {argv[0]!r} not found (or not executable)", USAGE_ERROR
        )
    return argv


async def run_node(args: argparse.Namespace) -> int:
    clusters: list[str] = list(dict.fromkeys(args.cluster))
    keys = load_keyring(args.keys)
    handler: CommandHandler | None = None
    if args.command is not None:
        handler = CommandHandler(
            command_argv(args.command),
            concurrency=args.concurrency,
            timeout=args.exec_timeout,
            max_output=irismesh.CoreConfig().max_payload,
        )
    # Before the first line: whoever reads it may signal this node at once.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with make_node(args, keys, clusters) as node:
        if handler is not None:
            node.on_request(_logging(handler))
        else:
            prefix = args.prefix.encode()
            node.on_request(lambda payload: prefix + payload)
        node.on_broadcast(_printer(args.prefix.encode(), as_json=args.json))
        if args.json:
            print_json(
                {"endpoint": node.endpoint, "node_id": node.node_id.hex(), "clusters": clusters}
            )
        else:
            names = ", ".join(map(repr, clusters))
            print(
                f"member of {names} listening on {node.endpoint} (node {node.node_id.hex()[:12]})",
                flush=True,
            )
        await stop.wait()
    return 0


def _logging(handler: CommandHandler) -> Callable[[bytes], Awaitable[bytes]]:
    """The handler, saying on this node's stderr why a command failed (the caller hears too)."""

    async def run(payload: bytes) -> bytes:
        try:
            return await handler(payload)
        except Exception as exc:
            print(f"mesh: --exec: {exc}", file=sys.stderr, flush=True)
            raise

    return run


def _printer(prefix: bytes, *, as_json: bool) -> Callable[[bytes], None]:
    """The broadcast handler: each broadcast on stdout, one line (a JSON object with --json)."""

    def show(payload: bytes) -> None:
        if as_json:
            print_json(text_fields("broadcast", payload))
        else:
            end = b"" if payload.endswith(b"\n") else b"\n"
            sys.stdout.buffer.write(prefix + payload + end)
            sys.stdout.flush()

    return show
