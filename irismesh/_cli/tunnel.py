"""`mesh tunnel`: netcat through the mesh (`mesh node` serves tunnels: see `_cli.serve`).

The caller's standard input goes into the tunnel in blocks (one tunnel message each), what the
member sends comes out on standard output as it arrives. The end of input half-closes the
tunnel (the member sees the end of the stream and may still answer); the command ends when the
member has finished sending. `mesh node` echoes every message back and half-closes when the
caller did, or with --tunnel-exec runs a command per tunnel between the two directions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator

import irismesh
from irismesh._cli.base import (
    MEMBER_WAIT,
    CommandError,
    Commands,
    StdinReader,
    StdoutWriter,
    add_command,
    add_shared_options,
    client_keyring,
    cluster_client,
    cluster_name,
    stderr_console,
)
from irismesh.errors import EndOfStream, RequestTimeout, TunnelReset

BLOCK = 64 << 10  # bytes read from stdin at a time: one tunnel message (one chunk on the wire)


def register(commands: Commands) -> None:
    parser = add_command(
        commands,
        "tunnel",
        summary="stream standard input to a member of a cluster and its answer to stdout",
        description=(
            "Like netcat, through the mesh. Joins as a client, waits up to --wait seconds for a\n"
            "member of CLUSTER, opens a tunnel to one of them (any live member may take it;\n"
            "--timeout seconds for it to accept), then copies standard input into the tunnel in\n"
            f"blocks of up to {BLOCK // 1024} KiB, and what the member sends to standard output, "
            "byte for byte\n"
            "(binary safe), in both directions at once. The end of input half-closes the tunnel:\n"
            "the member sees the end of the stream and may still answer. The command exits 0\n"
            "once the member has finished sending (even if input has not ended), 1 with one line\n"
            "on stderr if the tunnel is refused or reset (the member left, died, or its handler\n"
            "failed; what had arrived is written first). `mesh node` serves tunnels: it echoes\n"
            "them, or with --tunnel-exec pipes each one through a command. Standard output\n"
            "carries only the data; a progress line is shown on a terminal's stderr when both\n"
            "stdin and stdout are redirected."
        ),
        examples=(
            "  mesh node --cluster echo &\n"
            "  echo hello | mesh tunnel echo\n"
            "  mesh node --cluster upper --tunnel-exec 'tr a-z A-Z' &\n"
            "  mesh tunnel upper < notes.txt > NOTES.txt\n"
            "  mesh node --cluster unpack --tunnel-exec 'tar xf -' &\n"
            "  tar cf - docs | mesh tunnel unpack"
        ),
        run=run_tunnel,
    )
    parser.add_argument("cluster", type=cluster_name, metavar="CLUSTER")
    add_shared_options(
        parser, timeout="most seconds for the member to accept the tunnel", joining=MEMBER_WAIT
    )


# ----------------------------------------------------------------- the caller


async def run_tunnel(args: argparse.Namespace) -> int:
    keys = client_keyring(args, args.cluster)
    async with cluster_client(args, keys, args.cluster) as node:
        try:
            tunnel = await node.tunnel(args.cluster, timeout=args.timeout)
        except RequestTimeout:
            raise CommandError(
                f"no member of {args.cluster!r} accepted the tunnel within {args.timeout:g} s"
            ) from None
        except TunnelReset as exc:
            raise CommandError(f"tunnel to {args.cluster!r} refused: {exc.reason}") from None
        out = StdoutWriter()
        try:
            async with _progress(tunnel):
                await _pump(tunnel, StdinReader(BLOCK), out)
        except TunnelReset as exc:
            raise CommandError(
                f"tunnel to {args.cluster!r} was reset after {tunnel.bytes_sent:,} bytes sent "
                f"and {tunnel.bytes_received:,} received: {exc.reason}"
            ) from None
        finally:
            await tunnel.close()
            await out.close()
    return 0


async def _pump(tunnel: irismesh.Tunnel, stdin: StdinReader, out: StdoutWriter) -> None:
    """Both directions at once; returns when the member has finished sending."""

    async def send() -> None:
        while block := await stdin.get():
            await tunnel.send(block)
        await tunnel.send_eof()

    async def receive() -> None:
        with contextlib.suppress(EndOfStream):
            while True:
                await out.write(await tunnel.recv())

    sending = asyncio.ensure_future(send())
    receiving = asyncio.ensure_future(receive())
    try:
        pending: set[asyncio.Future[None]] = {sending, receiving}
        while receiving in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure in either direction ends both
    finally:
        for task in (sending, receiving):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


@contextlib.asynccontextmanager
async def _progress(tunnel: irismesh.Tunnel) -> AsyncIterator[None]:
    """Bytes each way and the rate, on stderr, when it is a terminal that data does not use."""
    console = stderr_console()
    if not console.is_terminal or sys.stdin.isatty() or sys.stdout.isatty():
        yield
        return
    started = time.monotonic()
    with console.status(f"tunnel to {tunnel.cluster!r}") as status:

        async def update() -> None:
            while True:
                await asyncio.sleep(0.25)
                sent, received = tunnel.bytes_sent, tunnel.bytes_received
                rate = (sent + received) / (time.monotonic() - started) / 1e6
                status.update(
                    f"tunnel to {tunnel.cluster!r}: {sent / 1e6:,.1f} MB sent, "
                    f"{received / 1e6:,.1f} MB received ({rate:,.1f} MB/s)"
                )

        updating = asyncio.ensure_future(update())
        try:
            yield
        finally:
            updating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await updating
