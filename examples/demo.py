"""The main demo: a local mesh of processes, traffic in every pattern, a crash, a Spark report.

    python examples/demo.py [--out DIR] [--requests 3000] [--no-report]

1. Three worker processes join cluster "work" (each a separate OS process with its own node).
2. A client sends requests with 64 in flight and SIGKILLs one worker a third of the way in:
   the requests it held are resent to the others and the client sees no failure.
3. The client broadcasts to every live worker, surveys them, and sends hedged requests.
4. It publishes 1000 orders on `orders.<region>` topics; each worker subscribes to `orders.#`
   and must get every one, in order (a survey collects their counts).
5. It sends 16 MiB through a tunnel to one worker, which answers the SHA-256 it computed.
6. Every node spools telemetry; a PySpark job turns the spool into an HTML report with charts,
   and the demo checks that the report's request counts equal the client's exact counters.

Everything stays on 127.0.0.1. Exit status 0 means: no request failed, and the report agrees.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import irismesh
from irismesh.node import TelemetryConfig

CLUSTER = "work"
# Kinds only the client records (a tunnel is recorded at both of its ends, so not compared).
COMPARED = ("request", "broadcast", "survey", "publish")


def say(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------- the workers


async def run_worker(name: str, seeds: list[str], spool: Path) -> None:
    telemetry = TelemetryConfig(spool_dir=spool, sample_every=1, gauge_interval=1.0)
    keys = irismesh.Keyring.from_env()
    async with irismesh.Node(
        CLUSTER, keyring=keys, seeds=seeds, telemetry=telemetry, name=name
    ) as node:
        prefix = name.encode() + b":"
        flushed = 0

        @node.on_request
        async def handle(payload: bytes) -> bytes:
            await asyncio.sleep(0.001)  # some work
            return prefix + payload

        @node.on_broadcast
        def on_broadcast(payload: bytes) -> None:
            nonlocal flushed
            flushed += 1

        orders = {"received": 0, "out_of_order": 0}

        async def take_orders() -> None:
            async with node.subscribe("orders.#") as sub:
                async for message in sub:
                    if int(message.payload) != orders["received"] or message.missed:
                        orders["out_of_order"] += 1
                    orders["received"] += 1

        ordering = asyncio.get_running_loop().create_task(take_orders())

        @node.on_survey
        def on_survey(payload: bytes) -> bytes:
            if payload == b"orders?":
                return b"%d %d" % (orders["received"], orders["out_of_order"])
            return b"%s flushed=%d peers=%d" % (name.encode(), flushed, len(node.peers()))

        @node.on_tunnel
        async def checksum(tunnel: irismesh.Tunnel) -> None:
            digest = hashlib.sha256()
            async for block in tunnel:
                digest.update(block)
            await tunnel.send(digest.hexdigest().encode())

        print("READY", node.endpoint, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()
        ordering.cancel()


def start_worker(
    name: str, seeds: list[str], env: dict[str, str], spool: Path
) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, __file__, "--worker", name, "--spool", str(spool)]
    for seed in seeds:
        cmd += ["--seed", seed]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "READY":
        proc.kill()
        raise RuntimeError(f"worker {name} did not start")
    return proc, line[1]


# ---------------------------------------------------------------------------- the client


async def run_client(
    args: argparse.Namespace,
    keys: irismesh.Keyring,
    first: str,
    procs: dict[str, subprocess.Popen[str]],
    spool: Path,
) -> dict[str, object]:
    telemetry = TelemetryConfig(spool_dir=spool, sample_every=1, gauge_interval=1.0)
    async with irismesh.Node(
        keyring=keys, seeds=[first], telemetry=telemetry, name="client"
    ) as client:
        await client.wait_for_members(CLUSTER, len(procs), timeout=10)
        say(f"[1/6] {len(procs)} workers up; {args.requests} requests with 64 in flight")
        served: Counter[str] = Counter()
        failures: list[str] = []
        next_id = 0
        victim = sorted(procs)[-1]
        killed = False
        killed_at = 0.0

        async def caller() -> None:
            nonlocal next_id, killed, killed_at
            while next_id < args.requests:
                i = next_id
                next_id += 1
                payload = b"%d" % i
                try:
                    reply = await client.request(CLUSTER, payload, timeout=5)
                except irismesh.MeshError as exc:
                    failures.append(f"{i}: {exc}")
                    continue
                who, _, echoed = reply.partition(b":")
                if echoed != payload:
                    failures.append(f"{i}: wrong reply {reply!r}")
                served[who.decode()] += 1
                if not killed and sum(served.values()) >= args.requests // 3:
                    killed = True
                    procs[victim].send_signal(signal.SIGKILL)
                    killed_at = time.perf_counter()
                    say(
                        f"      SIGKILLed {victim} with "
                        f"{client.stats['requests_pending']} requests in flight"
                    )

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(64)))
        elapsed = time.perf_counter() - started
        say(
            f"      {sum(served.values())} replies in {elapsed:.2f} s, "
            f"{client.stats.get('requests_resent', 0)} resent after the kill, "
            f"{len(failures)} failed; " + ", ".join(f"{w}: {n}" for w, n in sorted(served.items()))
        )
        await client.wait_for_members(CLUSTER, len(procs) - 1, timeout=5)
        # The client took the victim out of its own routing as soon as its connection dropped
        # and its endpoint refused a new one; membership's verdict, for the whole mesh (and
        # the report's deaths), comes from its probes.
        verdict = "not within 10 s"
        while time.perf_counter() - killed_at < 10:
            if any(p.name == victim and p.state == "dead" for p in client.peers(departed=True)):
                verdict = f"{time.perf_counter() - killed_at:.2f} s after the kill"
                break
            await asyncio.sleep(0.02)
        say(f"      membership declared {victim} dead {verdict}")

        received = await client.broadcast(CLUSTER, b"flush caches", timeout=5)
        say(f"[2/6] broadcast reached {len(received)} live workers")

        survey = await client.survey(CLUSTER, b"status?", timeout=2)
        say(
            f"[3/6] survey: {len(survey.answers)} answered, {len(survey.missing)} missing: "
            + "; ".join(sorted(a.decode() for a in survey.answers.values()))
        )

        hedged = await asyncio.gather(
            *(client.request(CLUSTER, b"h%d" % i, timeout=5, hedge=True) for i in range(200))
        )
        say(
            f"[4/6] 200 hedged requests answered "
            f"({client.stats.get('requests_hedged', 0)} copies sent)"
        )

        live = len(client.members(CLUSTER))
        await client.wait_for_subscribers("orders.eu", live, timeout=5)
        regions = ("eu", "us", "asia")
        for i in range(1000):
            await client.publish(f"orders.{regions[i % 3]}", b"%d" % i)
        counts: list[tuple[int, int]] = []
        for _attempt in range(50):  # until each worker has read all 1000, or 5 s
            tally = await client.survey(CLUSTER, b"orders?", timeout=2)
            counts = [(int(a.split()[0]), int(a.split()[1])) for a in tally.answers.values()]
            if len(counts) == live and all(n == 1000 for n, _bad in counts):
                break
            await asyncio.sleep(0.1)
        published_ok = len(counts) == live and all(c == (1000, 0) for c in counts)
        say(
            f"[5/6] 1000 orders published to {live} subscribed workers: "
            + ", ".join(f"{n} received, {bad} out of order" for n, bad in counts)
        )
        if not published_ok:
            failures.append(f"pub/sub: workers counted {counts}")

        blob = hashlib.sha256(b"demo").digest() * (16 << 15)  # 16 MiB
        tunnel_started = time.perf_counter()
        async with client.tunnel(CLUSTER, timeout=5) as tunnel:
            for offset in range(0, len(blob), 1 << 20):
                await tunnel.send(blob[offset : offset + (1 << 20)])
            await tunnel.send_eof()
            answer = (await tunnel.recv()).decode()
        tunnel_s = time.perf_counter() - tunnel_started
        verified = answer == hashlib.sha256(blob).hexdigest()
        worker = next((p.name for p in client.peers() if p.node_id == tunnel.peer), tunnel.peer)
        say(
            f"[6/6] 16 MiB through a tunnel to worker {worker} in {tunnel_s:.2f} s: "
            f"SHA-256 {'verified' if verified else 'MISMATCH'}"
        )
        if not verified:
            failures.append("tunnel: the checksum differs")
        assert client.recorder is not None
        client.flush_telemetry()
        counts: Counter[str] = Counter()
        for (kind, _cluster, outcome), n in client.recorder.counts.items():
            if kind in COMPARED:
                counts[f"{kind}/{outcome}"] += n
        return {
            "failures": failures,
            "hedged_ok": len(hedged),
            "broadcast": len(received),
            "survey_answers": len(survey.answers),
            "client_counts": dict(counts),
            "client_node": client.node_id.hex(),
        }


# ---------------------------------------------------------------------------- the report


def run_report(spool: Path, out: Path) -> dict[str, object] | None:
    say("")
    say(f"telemetry: {len(list(spool.glob('*.msgpack')))} spool files -> Spark report in {out}")
    cmd = [
        sys.executable,
        "-m",
        "irismesh.spark_telemetry",
        "report",
        "--spool",
        str(spool),
        "--out",
        str(out),
    ]
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    result = subprocess.run(cmd, env=env, timeout=600)
    if result.returncode != 0:
        say(f"the Spark report failed (exit {result.returncode})")
        return None
    summary = out / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("irismesh-demo"), help="run directory")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--no-report", action="store_true", help="skip the Spark report")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seed", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--spool", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        irismesh.run(run_worker(args.worker, args.seed, args.spool))
        return 0
    if args.requests < 30:
        parser.error("--requests must be at least 30")

    run_dir: Path = args.out.resolve()
    spool = run_dir / "spool"
    if spool.exists():
        for stale in spool.iterdir():
            stale.unlink()
    spool.mkdir(parents=True, exist_ok=True)
    keys = irismesh.Keyring.generate()
    keyfile = run_dir / "mesh.keys"
    keys.save(keyfile, overwrite=True)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    env.pop("IRISMESH_KEYS", None)

    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        procs["w1"], first = start_worker("w1", [], env, spool)
        for name in ("w2", "w3"):
            procs[name], _ = start_worker(name, [first], env, spool)
        outcome = irismesh.run(run_client(args, keys, first, procs, spool))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()  # a clean stop flushes each worker's spool
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    failures = outcome["failures"]
    assert isinstance(failures, list)
    if failures:
        say(f"FAILED: {len(failures)} requests failed, e.g. {failures[:3]}")
        return 1
    if args.no_report:
        return 0
    summary = run_report(spool, run_dir / "report")
    if summary is None:
        return 1
    return check_agreement(outcome, summary, run_dir / "report")


def check_agreement(outcome: dict[str, object], summary: dict[str, object], report: Path) -> int:
    """The report's caller-side totals for this run must equal the client's exact counters."""
    counts = outcome["client_counts"]
    assert isinstance(counts, dict)
    tables = summary.get("tables", {})
    rows = tables.get("totals", []) if isinstance(tables, dict) else []
    # The client is the only node that makes calls, so the report's totals of the caller-side
    # kinds must equal its exact counters (records are not sampled in the demo).
    reported = {
        f"{row['kind']}/{row['outcome']}": row["events"]
        for row in rows
        if row.get("kind") in COMPARED
    }
    mismatches = [
        f"{key}: node counted {counts.get(key)}, report says {reported.get(key)}"
        for key in sorted(set(counts) | set(reported))
        if counts.get(key) != reported.get(key)
    ]
    say("")
    if mismatches:
        say("report and node counters DISAGREE: " + "; ".join(mismatches))
        return 1
    say(
        "report agrees with the client's counters: "
        + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    )
    say(f"open {report / 'index.html'}")
    shot = screenshot(report)
    if shot is not None:
        say(f"screenshot of it (headless Chromium): {shot}")
    return 0


def screenshot(report: Path) -> Path | None:
    """The report as a person sees it, when Chromium is installed; problems in one line."""
    try:
        from irismesh.spark_telemetry.browser import screenshot_page

        return screenshot_page(report / "index.html", report / "screenshot.png")
    except Exception as exc:  # a screenshot is a courtesy: say why there is none, go on
        say(f"no screenshot: {type(exc).__name__}: {exc}")
        return None


if __name__ == "__main__":
    sys.exit(main())
