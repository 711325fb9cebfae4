"""`mesh telemetry collect`: the whole mesh's telemetry records, spooled on this machine.

Joins the mesh as a client and runs an `irismesh.telemetry.export.Collector`: it subscribes to
the reserved topics `_mesh.telemetry.<node>` on which nodes with telemetry publish their
records, and writes each node's records into spool files named after it, exactly as the node
would have spooled them locally, so `mesh telemetry report --spool DIR` and the Spark jobs read
the directory as any other. Stops after --seconds or at Ctrl-C (SIGINT, SIGTERM), completes
every file and prints a summary.

Wiring: `register_collect(family)` adds the command to the `mesh telemetry` group, where
`family` is the subparsers action of that group (see `irismesh._cli.telemetry.register`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

from irismesh._cli.base import (
    CommandError,
    Commands,
    UsageError,
    add_command,
    add_directory,
    add_shared_options,
    client_keyring,
    make_node,
    print_json,
    reload_keys_on_hangup,
    seconds,
    short_id,
    stderr_console,
    stdout_console,
    stop_on_signals,
    where,
)
from irismesh.telemetry.export import TOPIC_SCOPE, Collector, CollectStats

PROGRESS_EVERY = 1.0  # seconds between progress updates on stderr


def register_collect(family: Commands) -> None:
    """Add `collect` to the subcommands of `mesh telemetry`."""
    parser = add_command(
        family,
        "collect",
        summary="write the telemetry records every node publishes into a local spool directory",
        description=(
            "Export without shared disks: nodes started with telemetry (TelemetryConfig) also\n"
            "publish their records on the reserved topics _mesh.telemetry.<node id>, whenever\n"
            "some node subscribes to them. This command joins the mesh as a client, subscribes,\n"
            "and writes each node's records into --out as spool files named after that node,\n"
            "exactly as the node would have spooled them locally: `mesh telemetry report\n"
            "--spool DIR` and the Spark jobs read them like any others. It runs until Ctrl-C\n"
            "or for --seconds, showing records and nodes so far on stderr, then completes every\n"
            "file and prints a summary (--json: an object with out, seconds, nodes (records by\n"
            "node id), records, messages, files, bytes and the losses corrupt, rejected, missed\n"
            "and dropped). Records exist from when a node sees this subscription: older ones are\n"
            "only in the node's local spool, if it has one. A node that cannot keep up with its\n"
            "records' export (a slow collector) drops them and counts them as `drop` records\n"
            "named telemetry_export. Do not collect into a directory where the same nodes spool\n"
            "locally. The records are sealed under the keyring's '_mesh' key, else its '*' key.\n"
            "Exit status 2 if --out cannot be written; 1 if no node of the mesh was found."
        ),
        examples=(
            "  mesh telemetry collect --seed tcp://10.0.0.5:7400 --out spool\n"
            "  mesh telemetry collect --out spool --seconds 60 --json\n"
            "  mesh telemetry report --spool spool --out report"
        ),
        run=run_collect,
    )
    add_directory(parser, "--out", "spool directory (made if need be)")
    parser.add_argument(
        "--seconds",
        type=seconds,
        metavar="SECONDS",
        help="collect for this long, then stop (default: until Ctrl-C)",
    )
    parser.add_argument(
        "--file-age",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="complete each node's current file at least this often (default: %(default)s)",
    )
    add_shared_options(
        parser,
        joining=(None, ""),
        json="a JSON object summing up what was written, instead of the summary",
    )


def spool_directory(out: Path) -> Path:
    """--out, made if need be and writable; else one line and exit status 2."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make --out {out}: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to --out {out}: permission denied")
    return out


async def run_collect(args: argparse.Namespace) -> int:
    keys = client_keyring(args)
    out = spool_directory(args.out)
    keys.require(TOPIC_SCOPE)  # no key to read the records with: say so now
    stop = stop_on_signals()
    started = time.monotonic()
    deadline = None if args.seconds is None else started + args.seconds
    peers_seen = False
    async with make_node(args, keys) as node:
        reload_keys_on_hangup(node)
        collector = Collector(node, out, max_age=args.file_age)
        try:
            await collector.start()
        except OSError as exc:
            raise UsageError(f"cannot write to --out {out}: {exc}") from None
        try:
            with Progress() as progress:
                while not stop.is_set():
                    wait = PROGRESS_EVERY
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                    if wait > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), wait)
                    peers_seen = peers_seen or bool(node.peers())
                    progress.show(collector.stats(), time.monotonic() - started)
                    if deadline is not None and time.monotonic() >= deadline:
                        break
        finally:
            stats = await collector.stop()
    elapsed = time.monotonic() - started
    if stats.write_errors:
        raise UsageError(
            f"could not write {stats.dropped} records to {out} "
            f"({stats.records - stats.dropped} written): {stats.last_error}"
        )
    if not peers_seen and not stats.records:
        raise CommandError(
            f"no node of the mesh answered in {elapsed:.0f} s (looked via {where(args)}; "
            "is a node running there, with the same keyring?)"
        )
    if args.json:
        print_json(summary_json(stats, out, elapsed))
    else:
        print_summary(stats, out, elapsed)
    return 0


class Progress:
    """Records and nodes so far, on stderr: a status line on a terminal, else a plain line
    each time the counts change (so a log of an idle collect stays empty)."""

    def __init__(self) -> None:
        self.console = stderr_console()
        self._status = self.console.status("collecting: no records yet")
        self._shown = (0, 0, 0)

    def __enter__(self) -> Progress:
        if self.console.is_terminal:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.console.is_terminal:
            self._status.stop()

    def show(self, stats: CollectStats, elapsed: float) -> None:
        counts = (stats.records, len(stats.nodes), stats.files)
        line = (
            f"collecting: {stats.records} records from {len(stats.nodes)} nodes, "
            f"{stats.files} files complete, {elapsed:.0f} s"
        )
        if self.console.is_terminal:
            self._status.update(line)
        elif counts != self._shown:
            print(line, file=sys.stderr, flush=True)
        self._shown = counts


def summary_json(stats: CollectStats, out: Path, elapsed: float) -> dict[str, object]:
    return {
        "out": str(out.resolve()),
        "seconds": round(elapsed, 3),
        "nodes": stats.nodes,
        "records": stats.records,
        "messages": stats.messages,
        "files": stats.files,
        "bytes": stats.bytes,
        "corrupt": stats.corrupt,
        "rejected": stats.rejected,
        "missed": stats.missed,
        "dropped": stats.dropped,
    }


def print_summary(stats: CollectStats, out: Path, elapsed: float) -> None:
    console = stdout_console()
    console.print(
        f"collected {stats.records} records from {len(stats.nodes)} nodes in {elapsed:.1f} s: "
        f"{stats.files} files, {stats.bytes} bytes in {out}",
        markup=False,
    )
    for node_id, records in sorted(stats.nodes.items()):
        console.print(f"  {short_id(node_id)}  {records} records", markup=False)
    losses = {
        "corrupt": stats.corrupt,
        "rejected (claimed another node)": stats.rejected,
        "missed in transit": stats.missed,
        "not written": stats.dropped,
    }
    if any(losses.values()):
        console.print("lost: " + ", ".join(f"{n} {what}" for what, n in losses.items() if n))
    if not stats.nodes:
        console.print(
            "no node published telemetry: nodes export their records only when started with "
            "telemetry (TelemetryConfig)",
            markup=False,
        )
