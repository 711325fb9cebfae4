"""`mesh bench`: request/reply throughput and latency percentiles against a running cluster."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from irismesh._cli.base import (
    CommandError,
    MeshArgumentParser,
    add_command,
    add_joining_options,
    add_json_option,
    byte_size,
    cluster_name,
    load_keyring,
    make_node,
    positive_int,
    print_json,
    require_discovery,
    seconds,
    settle,
    stderr_console,
    stdout_console,
    wait_for_cluster,
)
from irismesh.errors import MeshError

PERCENTILES = (50, 90, 99)


def register(commands: argparse._SubParsersAction[MeshArgumentParser]) -> None:
    parser = add_command(
        commands,
        "bench",
        summary="measure request/reply throughput and latency against a running cluster",
        description=(
            "Joins the mesh as a client, waits for a member of CLUSTER, checks with one\n"
            "request that the cluster answers, then sends --requests requests of --size bytes\n"
            "keeping --concurrency in flight, with a progress bar on stderr. Prints requests\n"
            "per second and latency percentiles (p50, p90, p99, max; milliseconds, from send\n"
            "to reply). Failed requests are counted; any failure makes the exit status 1.\n"
            "The members do the work: `mesh node --cluster C` echoes, so it measures the mesh."
        ),
        examples=(
            "  mesh node --keys mesh.keys --cluster echo --bind tcp://127.0.0.1:7400 &\n"
            "  mesh bench --keys mesh.keys --seed tcp://127.0.0.1:7400 echo\n"
            "  mesh bench --seed tcp://127.0.0.1:7400 echo -n 20000 -c 100 --size 1024 --json"
        ),
        run=run_bench,
    )
    parser.add_argument("cluster", type=cluster_name, metavar="CLUSTER")
    parser.add_argument(
        "-n",
        "--requests",
        type=positive_int,
        default=5000,
        metavar="N",
        help="requests to send (default: %(default)s)",
    )
    parser.add_argument(
        "-c",
        "--concurrency",
        type=positive_int,
        default=64,
        metavar="C",
        help="requests in flight (default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        type=byte_size,
        default=100,
        metavar="B",
        help="payload bytes (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="per request (default: %(default)s)",
    )
    add_joining_options(
        parser, wait=3.0, wait_help="seconds to wait for a member of CLUSTER to appear"
    )
    add_json_option(parser, "the results as one JSON object")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchResult:
    cluster: str
    members: int
    requests: int
    concurrency: int
    size: int
    seconds: float
    latencies_ms: list[float]  # sorted, one per successful request
    errors: Counter[str]

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    def percentile(self, p: float) -> float | None:
        """Nearest-rank percentile of the latencies."""
        if not self.latencies_ms:
            return None
        rank = max(1, math.ceil(p / 100 * len(self.latencies_ms)))
        return self.latencies_ms[rank - 1]

    def to_json(self) -> dict[str, object]:
        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        latency: dict[str, float | None] = {
            f"p{p}": rounded(self.percentile(p)) for p in PERCENTILES
        }
        latency["max"] = rounded(self.latencies_ms[-1] if self.latencies_ms else None)
        latency["mean"] = rounded(sum(self.latencies_ms) / self.ok if self.latencies_ms else None)
        return {
            "cluster": self.cluster,
            "members": self.members,
            "requests": self.requests,
            "ok": self.ok,
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "concurrency": self.concurrency,
            "size": self.size,
            "seconds": round(self.seconds, 4),
            "requests_per_second": round(self.ok / self.seconds, 1) if self.seconds else 0.0,
            "latency_ms": latency,
        }


async def run_bench(args: argparse.Namespace) -> int:
    require_discovery(args)
    keys = load_keyring(args.keys)
    keys.require(args.cluster)
    payload = bytes(args.size)
    async with make_node(args, keys) as node:
        await wait_for_cluster(node, args, args.cluster)
        await settle(node, args.wait)  # the whole cluster, not just its first member to answer
        members = len(node.members(args.cluster))
        # One request alone first: a cluster that cannot answer fails here with its own error.
        await node.request(args.cluster, payload, timeout=args.timeout)
        latencies: list[float] = []
        errors: Counter[str] = Counter()
        sent = 0

        async def caller() -> None:
            nonlocal sent
            while sent < args.requests:
                sent += 1
                started = time.perf_counter()
                try:
                    await node.request(args.cluster, payload, timeout=args.timeout)
                except MeshError as exc:
                    errors[type(exc).__name__] += 1
                else:
                    latencies.append(time.perf_counter() - started)

        progress = Progress(
            TextColumn("[bold]bench[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=stderr_console(),
            transient=True,
        )
        with progress:
            task = progress.add_task(args.cluster, total=args.requests)

            async def report() -> None:  # cheaper than advancing the bar per reply
                while True:
                    progress.update(task, completed=len(latencies) + sum(errors.values()))
                    await asyncio.sleep(0.1)

            reporter = asyncio.create_task(report())
            started = time.perf_counter()
            try:
                await asyncio.gather(
                    *(caller() for _ in range(min(args.concurrency, args.requests)))
                )
            finally:
                elapsed = time.perf_counter() - started
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
    latencies.sort()
    result = BenchResult(
        cluster=args.cluster,
        members=members,
        requests=args.requests,
        concurrency=args.concurrency,
        size=args.size,
        seconds=elapsed,
        latencies_ms=[s * 1000 for s in latencies],
        errors=errors,
    )
    if args.json:
        print_json(result.to_json())
    else:
        stdout_console().print(result_table(result))
    if errors:
        kinds = ", ".join(f"{n} {kind}" for kind, n in errors.most_common())
        raise CommandError(f"{sum(errors.values())} of {args.requests} requests failed: {kinds}")
    return 0


def result_table(result: BenchResult) -> Table:
    data = result.to_json()
    table = Table(
        title=(
            f"bench {result.cluster!r}: {result.requests} requests of {result.size} B, "
            f"{result.concurrency} in flight, {result.members} member(s)"
        ),
        title_justify="left",
    )
    for name in ("req/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors", "seconds"):
        table.add_column(name, justify="right")
    latency = data["latency_ms"]
    assert isinstance(latency, dict)
    table.add_row(
        f"{data['requests_per_second']:,.0f}",
        *(_ms(latency[key]) for key in ("p50", "p90", "p99", "max")),
        str(data["errors"]),
        f"{result.seconds:.2f}",
    )
    return table


def _ms(value: object) -> str:
    return "-" if value is None else f"{value:.3f}"
