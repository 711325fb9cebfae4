"""What telemetry costs request/reply: irismesh with telemetry off, counters only, and spooled.

    python bench/telemetry_cost.py [--rounds 8] [--window 2] [--sizes 100,1024] [--control]
                                   [--fresh] [--json out.json] [--variants off,counters,spooled]
                                   [--baseline off] [--scrape SECONDS]

A server and a client process per variant, all started at once and left idle, then measured in
rounds: in each round every variant's client runs `--outstanding` requests in flight for
`--window` seconds, one variant after the other, in an order that rotates from round to round.
So the variants share the machine's drift and noise, and each round gives a ratio of two
figures taken seconds apart. The table shows each variant's median req/s, the median of its
per-round ratios to telemetry off (with their range), and CPU per request of server and
client. Variants:

* off: `telemetry=False`, no counters, no records;
* counters: `telemetry=True`, exact counters and latency histograms, no spool;
* spooled: `TelemetryConfig(spool_dir)`, the counters plus per-request records at the default
  sampling (one in 100) written to rotating spool files, and published for collectors;
  `--sample-every K` measures another sampling instead;
* scraped (not run unless `--variants` names it): the counters, and Prometheus metrics served
  by both nodes (`Node(metrics=...)`), which the parent scrapes every `--scrape` seconds as a
  Prometheus server would (bench/metrics_cost.py runs it against counters);
* off-again (with `--control`): a second pair as the baseline (off unless `--baseline` says
  otherwise), whose ratio to it is the noise floor of the run (what two identical setups
  differ by on this machine).

With `--fresh` every variant's pair is started anew before each round: two pairs of identical
processes kept for a whole run differ by a few per cent on their own (where each landed: its
memory layout, its ports, which core its threads share), and that difference would be read
as the cost of telemetry in every round; started anew, it is noise the median evens out.

The target: spooled / off >= 0.97 (telemetry costs at most 3% of request/reply throughput).
On a busy machine req/s moves by far more than that from one window to the next, so the table
also gives the ratio by CPU per request (both sides, same round), the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import _harness as harness

VARIANTS = ("off", "counters", "spooled", "scraped")
DEFAULT_VARIANTS = "off,counters,spooled"
CONTROL = "off-again"  # --control: a second pair as the baseline, the noise floor
CLUSTER = "bench"
TARGET = 0.97
TICKS = os.sysconf("SC_CLK_TCK")


def node_options(variant: str, spool: str, sample_every: int | None) -> dict[str, Any]:
    import irismesh

    if variant in ("off", CONTROL):
        return {"telemetry": False}
    if variant == "counters":
        return {"telemetry": True}
    if variant == "scraped":
        return {"telemetry": True, "metrics": "127.0.0.1:0"}
    if sample_every is None:  # the default
        return {"telemetry": irismesh.TelemetryConfig(spool_dir=spool)}
    return {"telemetry": irismesh.TelemetryConfig(spool_dir=spool, sample_every=sample_every)}


# ============================================================================================
# Children


async def serve(keyring: str, variant: str, spool: str, sample_every: int | None) -> None:
    import irismesh

    keys = irismesh.Keyring.load(keyring)
    async with irismesh.Node(
        cluster=CLUSTER, keyring=keys, **node_options(variant, spool, sample_every)
    ) as node:

        async def echo(payload: bytes) -> bytes:
            return payload

        node.on_request(echo)
        print("READY", node.endpoint, node.metrics_address, flush=True)
        await asyncio.Event().wait()  # until the parent closes our stdin


async def client(
    keyring: str,
    variant: str,
    spool: str,
    sample_every: int | None,
    endpoint: str,
    outstanding: int,
) -> None:
    import irismesh

    keys = irismesh.Keyring.load(keyring)
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str] = asyncio.Queue()

    def read_commands() -> None:  # the parent writes one command a line: "run SIZE SECONDS"
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        os._exit(0)  # stdin closed: the parent is done with us

    async with irismesh.Node(
        keyring=keys, seeds=[endpoint], **node_options(variant, spool, sample_every)
    ) as node:
        await node.wait_for_members(CLUSTER, count=1, timeout=15)
        print("READY", node.metrics_address, flush=True)
        threading.Thread(target=read_commands, daemon=True).start()
        while True:
            _run, size, seconds = (await commands.get()).split()
            print(json.dumps(await pump(node, int(size), float(seconds), outstanding)), flush=True)


async def pump(node: Any, size: int, seconds: float, outstanding: int) -> dict[str, float]:
    import irismesh

    payload = os.urandom(size)
    completed = 0
    shed = 0
    running = True

    async def worker() -> None:
        nonlocal completed, shed
        while running:
            try:
                reply = await node.request(CLUSTER, payload, timeout=10)
            except irismesh.Overloaded:
                # The member's admission turned it away (a machine shared with other work can
                # stall the member long enough): counted, and the load goes on.
                shed += 1
                continue
            if reply != payload:
                raise harness.BenchError("echo mismatch")
            completed += 1

    workers = [asyncio.create_task(worker()) for _ in range(outstanding)]
    await asyncio.sleep(0.3)  # warm-up: every worker in its loop
    c0, t0, cpu0 = completed, time.perf_counter(), time.process_time()
    print("MARK", flush=True)
    await asyncio.sleep(seconds)
    c1, t1, cpu1 = completed, time.perf_counter(), time.process_time()
    running = False
    await asyncio.gather(*workers)
    return {"requests": c1 - c0, "seconds": t1 - t0, "client_cpu": cpu1 - cpu0, "shed": shed}


def run_child(args: argparse.Namespace) -> None:
    from irismesh import run

    harness.exit_after(args.max_seconds)
    if args.role == "server":
        harness.on_stdin_eof(lambda: os._exit(0))
        # irismesh's own loop, as reqrep.py's mesh children: uvloop where installed.
        run(serve(args.keyring, args.variant, args.spool, args.sample_every))
    else:
        run(
            client(
                args.keyring,
                args.variant,
                args.spool,
                args.sample_every,
                args.endpoint,
                args.outstanding,
            )
        )


# ============================================================================================
# Parent


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


class Scraper:
    """Scrapes every metrics address it is given each `every` seconds, as Prometheus would,
    on a thread of the parent (the nodes pay for serving the scrape, nothing else)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.addresses: list[str] = []
        self.scrapes = 0
        self.failures = 0
        self.bytes = 0
        # Per address, as the node reports it: (wall clock, its loop's seconds spent answering
        # scrapes so far, its scrapes so far), first and last seen.
        self.first: dict[str, tuple[float, float, float]] = {}
        self.last: dict[str, tuple[float, float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        if self.every > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(self.every):
            for address in list(self.addresses):
                try:
                    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
                        text = r.read()
                except OSError:
                    self.failures += 1
                    continue
                self.scrapes += 1
                self.bytes += len(text)
                own = dict.fromkeys(("scrape_seconds", "scrapes"), 0.0)
                for line in text.decode().splitlines():
                    name, _, value = line.partition(" ")
                    stem = name.removeprefix("irismesh_metrics_").removesuffix("_total")
                    if stem in own and name.startswith("irismesh_metrics_"):
                        own[stem] = float(value)
                seen = (time.monotonic(), own["scrape_seconds"], own["scrapes"])
                self.first.setdefault(address, seen)
                self.last[address] = seen

    def loop_share(self) -> tuple[float, float, float]:
        """Answering scrapes, as the nodes measured it (their loop's CPU time): the median
        and the largest share of a node's time it took, over nodes scraped for at least 5 s,
        and the median CPU time of one answer."""
        shares, each = [], []
        for address, (t0, busy0, n0) in self.first.items():
            t1, busy1, n1 = self.last[address]
            if t1 - t0 >= 5 and n1 > n0:
                shares.append((busy1 - busy0) / (t1 - t0))
                each.append((busy1 - busy0) / (n1 - n0))
        if not shares:
            return 0.0, 0.0, 0.0
        return statistics.median(shares), max(shares), statistics.median(each)


def start_pairs(
    procs: harness.ChildProcesses,
    args: argparse.Namespace,
    tmp: str,
    common: list[str],
    scraper: Scraper | None = None,
) -> tuple[dict[str, harness.Child], dict[str, harness.Child]]:
    """A server and a client per variant, each client linked to its server and ready; the
    metrics addresses of those that serve metrics go to `scraper`."""
    me = os.path.abspath(__file__)
    servers, clients = {}, {}
    addresses = []
    for variant in variants_of(args):
        spool = os.path.join(tmp, f"spool-{variant}")
        options = args.baseline if variant == CONTROL else variant
        extra = [*common, "--variant", options, "--spool", spool]
        server = procs.spawn(f"{variant} server", [sys.executable, me, "--role", "server", *extra])
        endpoint, *metrics = server.expect_prefix("READY ", timeout=30).split()
        servers[variant] = server
        client_argv = [sys.executable, me, "--role", "client", *extra, "--endpoint", endpoint]
        client_proc = procs.spawn(
            f"{variant} client", [*client_argv, "--outstanding", str(args.outstanding)]
        )
        metrics += client_proc.expect_prefix("READY", timeout=30).split()
        clients[variant] = client_proc
        addresses += metrics
    if scraper is not None:
        scraper.addresses = addresses
    return servers, clients


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import irismesh

    results: dict[str, Any] = {}
    scraper = Scraper(args.scrape)
    with (
        tempfile.TemporaryDirectory(prefix="irismesh-telcost-") as tmp,
        harness.ChildProcesses() as procs,
    ):
        keyring = os.path.join(tmp, "bench.keys")
        irismesh.Keyring.generate().save(keyring)
        common = ["--keyring", keyring, "--max-seconds", str(args.max_seconds)]
        if args.sample_every is not None:
            common += ["--sample-every", str(args.sample_every)]
        variants = variants_of(args)
        servers, clients = start_pairs(procs, args, tmp, common, scraper)
        scraper.start()
        subject = variants[-1] if variants[-1] != CONTROL else variants[-2]
        base = args.baseline
        for size in args.sizes:
            rounds: list[dict[str, dict[str, float]]] = []
            for index in range(args.rounds):
                if args.fresh and (index or size != args.sizes[0]):
                    # New processes for every variant: where a pair landed (its memory layout,
                    # ports, which core its threads share) differs from pair to pair, and a
                    # pair kept for the whole run would carry its own bias into every round.
                    scraper.addresses = []  # a stopped node is no failed scrape
                    for child in (*clients.values(), *servers.values()):
                        procs.stop(child)
                    servers, clients = start_pairs(procs, args, tmp, common, scraper)
                turn = index % len(variants)
                order = variants[turn:] + variants[:turn]
                if index % 2:
                    order = order[::-1]
                figures: dict[str, dict[str, float]] = {}
                for variant in order:
                    child, server = clients[variant], servers[variant]
                    assert child.proc.stdin is not None
                    child.proc.stdin.write(f"run {size} {args.window}\n".encode())
                    child.proc.stdin.flush()
                    child.expect_prefix("MARK", timeout=30)
                    server_cpu0 = cpu_seconds(server.pid)
                    line = child.expect_prefix("{", timeout=args.window + 30)
                    server_cpu = cpu_seconds(server.pid) - server_cpu0
                    result = json.loads("{" + line)
                    requests = result["requests"]
                    figures[variant] = {
                        "shed": result.get("shed", 0),
                        "rps": requests / result["seconds"],
                        "server_us": server_cpu / requests * 1e6,
                        "client_us": result["client_cpu"] / requests * 1e6,
                    }
                rounds.append(figures)
                ratio = figures[subject]["rps"] / figures[base]["rps"]
                cpu_ratio = cpu_us(figures[base]) / cpu_us(figures[subject])
                harness.progress(
                    f"{size} B round {index + 1}/{args.rounds}: "
                    + ", ".join(f"{v} {figures[v]['rps']:,.0f} req/s" for v in variants)
                    + f"; {subject}/{base} {ratio:.3f}, by CPU {cpu_ratio:.3f}"
                    + "".join(
                        f"; {v} shed {figures[v]['shed']:.0f}"
                        for v in variants
                        if figures[v]["shed"]
                    )
                )
            results[str(size)] = rounds
    scraper.stop()
    if scraper.every > 0 and scraper.scrapes:
        share, most, each = scraper.loop_share()
        if not each:
            harness.progress(
                f"scraped {scraper.scrapes} times; no node was scraped for 5 s or more"
            )
            return results
        harness.progress(
            f"scraped {scraper.scrapes} times every {scraper.every:g} s "
            f"({scraper.bytes / max(scraper.scrapes, 1):,.0f} B each), {scraper.failures} failed;"
            f" answering one took {each * 1e3:.2f} ms of a node's loop CPU (median), in all "
            f"{share:.3%} of a node's time (median; at most {most:.3%})"
        )
        results["scrapes"] = {
            "loop_share_median": share,
            "loop_share_max": most,
            "cpu_seconds_each_median": each,
        }
    return results


def variants_of(args: argparse.Namespace) -> tuple[str, ...]:
    variants = tuple(args.variants)
    return (*variants, CONTROL) if args.control else variants


def cpu_us(figures: dict[str, float]) -> float:
    """CPU per request of server and client together."""
    return figures["server_us"] + figures["client_us"]


def summarise(
    results: dict[str, Any], variants: tuple[str, ...], base: str = "off"
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for size, rounds in results.items():
        if not size.isdigit():  # the scraper's figures, not a size's rounds
            continue
        rows: dict[str, Any] = {}
        for variant in variants:
            ratios = [r[variant]["rps"] / r[base]["rps"] for r in rounds]
            # What the CPU allows: the baseline's CPU per request (both sides) over the
            # variant's, in the same round. A busy machine moves req/s far more than CPU per
            # request.
            cpu_ratios = [cpu_us(r[base]) / cpu_us(r[variant]) for r in rounds]
            pooled: dict[str, float] = {}
            if CONTROL in variants and variant not in (base, CONTROL):
                # Against both baseline pairs of the same round: half their own noise.
                pooled = {
                    "pooled_ratio_median": statistics.median(
                        r[variant]["rps"] / ((r[base]["rps"] + r[CONTROL]["rps"]) / 2)
                        for r in rounds
                    ),
                    "pooled_cpu_ratio_median": statistics.median(
                        (cpu_us(r[base]) + cpu_us(r[CONTROL])) / 2 / cpu_us(r[variant])
                        for r in rounds
                    ),
                }
            rows[variant] = {
                **pooled,
                "rps": statistics.median(r[variant]["rps"] for r in rounds),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "cpu_ratio_median": statistics.median(cpu_ratios),
                "cpu_ratio_min": min(cpu_ratios),
                "cpu_ratio_max": max(cpu_ratios),
                "server_us": statistics.median(r[variant]["server_us"] for r in rounds),
                "client_us": statistics.median(r[variant]["client_us"] for r in rounds),
            }
        summary[size] = rows
    return summary


def print_table(summary: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from irismesh import TelemetryConfig

    base = args.baseline
    table = Table(
        title=f"telemetry's cost to request/reply: {args.rounds} rounds of {args.window:g} s per "
        f"variant, {args.outstanding} outstanding, spooled records one in "
        f"{args.sample_every or TelemetryConfig(spool_dir='.').sample_every}"
        + (f", scraped every {args.scrape:g} s" if "scraped" in args.variants else "")
        + ", medians",
        caption=f"/ {base}: the variant's req/s / {base}'s in the same round (target: >= "
        f"{args.target}); / {base} by CPU: {base}'s CPU per request (server + client) / the "
        "variant's, in the same round (the steadier figure on a busy machine); CPU: of the "
        "process, per request",
    )
    for column in (
        "size",
        "telemetry",
        "req/s",
        f"/ {base}",
        "range",
        f"/ {base} by CPU",
        "range ",
        "CPU us server",
        "CPU us client",
    ):
        table.add_column(column, justify="left" if column in ("size", "telemetry") else "right")
    for size, rows in summary.items():
        for variant in variants_of(args):
            row = rows[variant]
            table.add_row(
                f"{int(size):,} B",
                variant,
                f"{row['rps']:,.0f}",
                f"{row['ratio_median']:.3f}x",
                f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}",
                f"{row['cpu_ratio_median']:.3f}x",
                f"{row['cpu_ratio_min']:.2f}-{row['cpu_ratio_max']:.2f}",
                f"{row['server_us']:.1f}",
                f"{row['client_us']:.1f}",
            )
        table.add_section()
    Console().print(table)
    for size, rows in summary.items():
        for variant, row in rows.items():
            if "pooled_ratio_median" in row:
                print(
                    f"{int(size):,} B {variant} / both {base} pairs of the same round,"
                    f" medians: {row['pooled_ratio_median']:.3f}x by req/s,"
                    f" {row['pooled_cpu_ratio_median']:.3f}x by CPU per request"
                )


def main() -> int:
    parser = harness.bench_parser(__doc__, "also write every figure to this file")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per size (default 8)")
    parser.add_argument(
        "--window", type=float, default=2.0, help="seconds measured per variant and round"
    )
    parser.add_argument("--sizes", default="100,1024", help="payload sizes (default 100,1024)")
    parser.add_argument("--outstanding", type=int, default=100, help="requests in flight")
    parser.add_argument(
        "--sample-every",
        type=int,
        metavar="K",
        help="spooled: one record in K (default: TelemetryConfig's default)",
    )
    parser.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"what to measure, comma-separated, of {', '.join(VARIANTS)} (default "
        f"{DEFAULT_VARIANTS}); the last is the one each round's progress line compares",
    )
    parser.add_argument(
        "--baseline", default="off", help="the variant the others are divided by (default off)"
    )
    parser.add_argument(
        "--scrape",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="scraped: seconds between two scrapes of each node's metrics (default 1)",
    )
    parser.add_argument("--target", type=float, default=TARGET, help=argparse.SUPPRESS)
    parser.add_argument(
        "--control",
        action="store_true",
        help=f"also measure a second pair as the baseline ({CONTROL}): the noise floor",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start new processes for every variant before each round (each pair's own bias,"
        " from where it landed on the machine, becomes noise that the median evens out)",
    )
    parser.add_argument("--max-seconds", type=float, default=900.0, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--keyring", help=argparse.SUPPRESS)
    parser.add_argument("--spool", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = harness.parse_args(parser)
    if args.role:
        run_child(args)
        return 0
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: comma-separated byte counts, not {args.sizes!r}")
    if args.rounds < 1 or args.window <= 0 or args.outstanding < 1:
        parser.error("--rounds, --window and --outstanding must be positive")
    if args.sample_every is not None and args.sample_every < 1:
        parser.error("--sample-every must be at least 1")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or args.baseline not in args.variants or len(args.variants) < 2:
        parser.error(
            f"--variants: two or more of {', '.join(VARIANTS)}, the baseline among them "
            f"(got {args.variants}, baseline {args.baseline})"
        )

    harness.raise_keyboard_interrupt_on_sigterm()
    try:
        results = measure(args)
    except harness.BenchError as exc:
        harness.progress(f"FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        harness.progress("interrupted; every child process has been stopped")
        return 130
    summary = summarise(results, variants_of(args), args.baseline)
    print_table(summary, args)
    if args.json:
        harness.write_json(
            args.json, {"rounds": results, "summary": summary, "settings": vars(args)}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
