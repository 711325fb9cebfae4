"""`mesh node`: a member that echoes each request, or answers it by running a command.

It answers surveys as it answers requests, prints each broadcast it gets on stdout, and serves
tunnels (`mesh tunnel`): it echoes them, or pipes each through a command (--tunnel-exec).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import irismesh
from irismesh._cli.base import (
    Commands,
    UsageError,
    add_command,
    add_shared_options,
    cluster_name,
    load_keyring,
    make_node,
    node_name,
    positive_int,
    print_json,
    reload_keys_on_hangup,
    seconds,
    short_id,
    stop_on_signals,
    text_fields,
    version_name,
)
from irismesh._cli.tunnel import BLOCK


def register(commands: Commands) -> None:
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
            "the sender counts this member once the line is written. Tunnels (`mesh tunnel`)\n"
            "are echoed: each message back as it came, and the end of stream once the caller's\n"
            "came (--prefix does not apply). With --tunnel-exec CMD each tunnel runs CMD: the\n"
            "tunnel into its stdin (closed at the caller's end of stream), its stdout back into\n"
            "the tunnel; CMD exiting 0 ends the stream, non-zero resets the tunnel with the\n"
            "last line of its stderr. No time limit applies: a tunnel lasts as long as CMD, and\n"
            "at most --concurrency run at once (a tunnel beyond that is refused). --name names\n"
            "the node for its peers, `mesh peers`, `mesh top` and the telemetry report (1-64\n"
            "printable characters, no whitespace; default: host name and process id).\n"
            "--version V is the version it serves as, which a traffic split weighs\n"
            "(`mesh split`).\n"
            "--metrics ADDR serves Prometheus metrics at http://ADDR/metrics. The\n"
            "first line printed says where the node listens (--json: an object with\n"
            "`endpoint`, `node_id` and `name`)."
        ),
        examples=(
            "  mesh node --cluster echo --name a1\n"
            "  mesh node --cluster echo --prefix B:\n"
            "  mesh node --cluster upper \\\n"
            "      --exec 'tr a-z A-Z' --concurrency 4 --exec-timeout 2\n"
            "  mesh node --cluster count --exec 'wc -c'\n"
            "  mesh node --cluster sorter --tunnel-exec sort"
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
        "--tunnel-exec",
        dest="tunnel_command",
        metavar="CMD",
        help="command run per tunnel, between its two directions (default: echo tunnels)",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=8,
        metavar="N",
        help="--exec: at most N commands at once, more requests queue; --tunnel-exec: at most "
        "N tunnel commands, more tunnels are refused (default: %(default)s)",
    )
    parser.add_argument(
        "--exec-timeout",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="--exec: kill a command running longer and fail its request (default: %(default)s)",
    )
    parser.add_argument(
        "--name",
        type=node_name,
        metavar="NAME",
        help="what peers and reports call this node (default: host name and process id)",
    )
    parser.add_argument(
        "--version",
        type=version_name,
        metavar="V",
        help="the version this member serves as, which `mesh split` weighs (default: none)",
    )
    add_shared_options(
        parser, joining=(None, ""), metrics=True, json="print the listening line as JSON"
    )


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


def command_argv(command: str, option: str = "--exec") -> list[str]:
    """Split --exec's CMD and check that its program exists, so a typo fails at start."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise UsageError(f"bad {option} command {command!r}: {exc}") from None
    if not argv:
        raise UsageError(f"{option} needs a command")
    if shutil.which(argv[0]) is None:
        raise UsageError(f"{option}: program {argv[0]!r} not found (or not executable)")
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
    # A tunnel command that fails is one line on stderr (below), not the library's traceback.
    logging.getLogger("irismesh.tunnel").addHandler(logging.NullHandler())
    tunnels: Callable[[irismesh.Tunnel], Awaitable[None]] = echo_tunnel
    if args.tunnel_command is not None:
        tunnels = _logging_tunnels(
            TunnelCommand(
                command_argv(args.tunnel_command, "--tunnel-exec"), concurrency=args.concurrency
            )
        )
    # Before the first line: whoever reads it may signal this node at once.
    stop = stop_on_signals()
    async with make_node(args, keys, clusters, args.name, version=args.version) as node:
        reload_keys_on_hangup(node)
        if handler is not None:
            node.on_request(_logging(handler))
        else:
            prefix = args.prefix.encode()
            node.on_request(lambda payload: prefix + payload)
        node.on_broadcast(_printer(args.prefix.encode(), as_json=args.json))
        node.on_tunnel(tunnels)
        if args.json:
            print_json(
                {
                    "endpoint": node.endpoint,
                    "node_id": node.node_id.hex(),
                    "name": node.name,
                    "clusters": clusters,
                    **({"version": node.version} if node.version else {}),
                    **({"metrics": node.metrics_address} if node.metrics_address else {}),
                }
            )
        else:
            names = ", ".join(map(repr, clusters))
            me = short_id(node.node_id.hex())
            metrics = f"; metrics on {node.metrics_address}" if node.metrics_address else ""
            version = f", version {node.version}" if node.version else ""
            print(
                f"member of {names} listening on {node.endpoint} (node {me}, {node.name}"
                + version
                + ")"
                + metrics,
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


def _logging_tunnels(
    handler: TunnelCommand,
) -> Callable[[irismesh.Tunnel], Awaitable[None]]:
    """The tunnel handler, saying on this node's stderr why a command failed (the caller sees
    the reset too)."""

    async def run(tunnel: irismesh.Tunnel) -> None:
        try:
            await handler(tunnel)
        except (TunnelsBusy, CommandFailed) as exc:
            print(f"mesh: --tunnel-exec: {exc}", file=sys.stderr, flush=True)
            raise

    return run


# ----------------------------------------------------------------- tunnels


async def echo_tunnel(tunnel: irismesh.Tunnel) -> None:
    """Every message back as it came, then the end of stream once the caller's came."""
    async for message in tunnel:
        await tunnel.send(message)
    await tunnel.send_eof()


class TunnelsBusy(Exception):
    """Already --concurrency tunnel commands running; the caller's tunnel is reset with this."""


class TunnelCommand:
    """Serves a tunnel by running `argv`: the tunnel into its stdin, its stdout into the tunnel.

    The caller's end of stream closes the command's stdin; the end of the command's output,
    once it exits 0, ends the stream to the caller. A command that exits non-zero resets the
    tunnel with the last line of its stderr. At most `concurrency` run at once: a tunnel beyond
    that is refused (reset) rather than left waiting. Each command runs in a session of its
    own, killed with everything it started when the tunnel is reset or the node closes.
    """

    def __init__(self, argv: Sequence[str], *, concurrency: int) -> None:
        self.argv = list(argv)
        self.concurrency = concurrency
        self.running = 0

    async def __call__(self, tunnel: irismesh.Tunnel) -> None:
        if self.running >= self.concurrency:
            raise TunnelsBusy(f"{self.running} tunnel commands already running (--concurrency)")
        self.running += 1
        try:
            await self._serve(tunnel)
        finally:
            self.running -= 1

    async def _serve(self, tunnel: irismesh.Tunnel) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdin is not None
        assert proc.stdout is not None
        assert proc.stderr is not None
        stdin, stdout = proc.stdin, proc.stdout

        async def feed() -> None:
            """The tunnel into the command's stdin, then its end; once the command stops
            reading, the rest of the stream is read and dropped (the caller is not held up)."""
            writing = True
            async for message in tunnel:
                if writing:
                    try:
                        stdin.write(message)
                        await stdin.drain()
                    except (BrokenPipeError, ConnectionResetError):
                        writing = False
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                stdin.close()
                await stdin.wait_closed()

        async def pump() -> None:
            while block := await stdout.read(BLOCK):
                await tunnel.send(block)

        feeding = asyncio.ensure_future(feed())
        pumping = asyncio.ensure_future(pump())
        errors = asyncio.ensure_future(_tail(proc.stderr))
        try:
            pending: set[asyncio.Future[None]] = {feeding, pumping}
            while pumping in pending:  # a failure either way (a reset) stops the command
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            status = await proc.wait()
            if status != 0:
                lines = (await errors).decode(errors="replace").strip().splitlines()
                raise CommandFailed(lines[-1].strip() if lines else "", status)
            await tunnel.send_eof()
            await feeding  # until the caller ends its side too, or goes away
        finally:
            if proc.returncode is None:
                _kill_session(proc.pid)
                await proc.wait()
            leftovers: tuple[asyncio.Future[Any], ...] = (feeding, pumping, errors)
            for leftover in leftovers:
                if not leftover.done():
                    leftover.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await leftover


async def _tail(stream: asyncio.StreamReader, keep: int = 4096) -> bytes:
    """The last `keep` bytes of a stream, read to its end (a command must never block on it)."""
    data = b""
    while chunk := await stream.read(1 << 16):
        data = (data + chunk)[-keep:]
    return data


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
