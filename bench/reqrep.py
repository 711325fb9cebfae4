"""Request/reply benchmark: irismesh beside raw pyzmq, raw asyncio+pyzmq and NATS, one run.

    python bench/reqrep.py [--quick] [--json out.json] [--duration SECONDS]
                           [--only raw,raw-asyncio,nats,mesh] [--mesh-opt KEY=VALUE ...]
                           [--split VERSION=WEIGHT,...]

Each system runs its server and its client in two OS processes (NATS adds nats-server as a
third). The parent only orchestrates: it starts the children, relays their progress, samples
RSS and CPU during the sustained run and prints the tables. bench/README.md says how to read
them. The same file is the children's program (`--role server|client`).
"""

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import _harness as harness
import zmq

SYSTEMS = (
    "raw",
    "raw-asyncio",
    "nats",
    "mesh",
    "mesh-null",
    "mesh-notel",
    "mesh-zmq",
    "mesh-grants",
)
DEFAULT_SYSTEMS = ("raw", "raw-asyncio", "nats", "mesh")
LABELS = {
    "raw": "raw pyzmq",
    "raw-asyncio": "raw-asyncio",
    "nats": "NATS",
    "mesh": "irismesh",
    "mesh-null": "irismesh, null sealer",
    "mesh-notel": "irismesh, telemetry off",
    "mesh-zmq": "irismesh, zmq links",
    "mesh-grants": "irismesh, grants required",
}
# irismesh variants run as "mesh" children with these Node options added: what sealing and
# telemetry cost, and what the default transport gains over zmq's, is the default system
# divided by its variant, measured in the same run.
MESH_VARIANTS = {
    "mesh": [],
    "mesh-null": ["sealing=false"],
    "mesh-notel": ["telemetry=false"],
    "mesh-zmq": ["transport=zmq"],
    "mesh-grants": ["grants=true"],
}
ALIASES = {"irismesh": "mesh", "pyzmq": "raw", "asyncio": "raw-asyncio"}
SIZES = (100, 1024)
SCENARIOS = ("throughput", "latency", "sustained")
SUBJECT = "bench"  # NATS subject and irismesh cluster alike

Request = Callable[[bytes], Awaitable[bytes]]

# Plain ints: zmq's constants are IntFlag enums, and enum arithmetic on the hot path is slow
# enough to show in the raw-asyncio figures.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What one client process runs, for one payload size."""

    size: int
    outstanding: int
    warmup_s: float
    window_s: float
    latency_warmup: int
    latency_n: int
    sustained_s: float
    request_timeout_s: float = 5.0

    def budget_s(self) -> float:
        """A hard ceiling on the client's run time: generous, but finite."""
        latency = (self.latency_warmup + self.latency_n) * 0.005  # 5 ms a request is very slow
        return 2 * self.warmup_s + self.window_s + self.sustained_s + latency + 45.0


def payload_of(size: int) -> bytes:
    return bytes(i % 251 for i in range(size))


def parse_mesh_opts(pairs: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs for irismesh.Node: ints, floats and true/false convert, the rest stay str."""
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--mesh-opt wants KEY=VALUE, got {pair!r}")
        value: Any = text
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            for convert in (int, float):
                try:
                    value = convert(text)
                    break
                except ValueError:
                    pass
        opts[key] = value
    return opts


# ============================================================================================
# Children: servers


def socket_fd(sock: zmq.Socket[bytes]) -> int:
    fd = sock.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    return fd


def has_input(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits; asking also makes libzmq process pending commands."""
    events = sock.getsockopt(_EVENTS)
    assert isinstance(events, int)
    return bool(events & _POLLIN)


def serve_raw() -> None:
    """The ceiling: a sync ROUTER echoing in the tightest loop pyzmq allows."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    harness.on_stdin_eof(lambda: os._exit(0))
    print(f"READY tcp://127.0.0.1:{port}", flush=True)
    recv, send = sock.recv_multipart, sock.send_multipart
    while True:
        send(recv())


@contextlib.asynccontextmanager
async def until_stopped() -> AsyncIterator[asyncio.Event]:
    """An event set by SIGTERM or by EOF on stdin (the parent's polite stop)."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopped.set)
    harness.on_stdin_eof(lambda: loop.call_soon_threadsafe(stopped.set))
    try:
        yield stopped
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def serve_raw_asyncio() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def drain() -> None:
        while True:
            try:
                msg = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                # The FD is edge-triggered and our sends may have consumed the edge.
                if has_input(sock):
                    continue
                return
            sock.send_multipart(msg)

    loop = asyncio.get_running_loop()
    loop.add_reader(socket_fd(sock), drain)
    async with until_stopped() as stopped:
        print(f"READY tcp://127.0.0.1:{port}", flush=True)
        drain()
        await stopped.wait()
    loop.remove_reader(socket_fd(sock))
    sock.close()
    ctx.term()


async def serve_nats(url: str) -> None:
    import nats

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)

    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(SUBJECT, cb=echo)
    await nc.flush()
    async with until_stopped() as stopped:
        print(f"READY {url}", flush=True)
        await stopped.wait()
    await nc.close()


def granted(keys: Any, opts: dict[str, Any], **rights: Any) -> Any:
    """With the option grants=true: the keyring requiring grants, and this node's identity
    and grant (of `rights`) in `opts`. The authority derives from the keyring's '*' key, so
    that the server and the client, two processes, trust the same one (benchmarks only)."""
    if not opts.pop("grants", False):
        return keys
    import hashlib

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from irismesh._core.rights import Rights
    from irismesh.security.grants import Authority
    from irismesh.security.identity import Identity

    seed = hashlib.sha256(b"bench authority" + keys.primary("*").secret).digest()
    authority = Authority(Ed25519PrivateKey.from_private_bytes(seed))
    identity = Identity.generate()
    opts["identity"] = identity
    opts["grant"] = authority.grant(identity.public, Rights(**rights), expires_in=3600)
    return keys.with_trust([authority.public], require_grants=True)


async def serve_mesh(keyring_path: str, opts: dict[str, Any]) -> None:
    import irismesh

    keys = granted(irismesh.Keyring.load(keyring_path), opts, serve=(SUBJECT,))
    async with irismesh.Node(
        cluster=SUBJECT, keyring=keys, bind="tcp://127.0.0.1:0", survey=False, **opts
    ) as node:

        async def echo(payload: bytes) -> bytes:
            return payload

        node.on_request(echo)
        async with until_stopped() as stopped:
            print("READY", node.endpoint, flush=True)
            await stopped.wait()


# ============================================================================================
# Children: clients


def _raw_recv(sock: zmq.Socket[bytes], payload: bytes) -> None:
    try:
        reply = sock.recv()
    except zmq.Again:
        raise harness.BenchError("no reply within the request timeout") from None
    if reply != payload:
        raise harness.BenchError(f"echo mismatch: sent {len(payload)} B, got {len(reply)} B")


def _raw_pump(
    sock: zmq.Socket[bytes],
    payload: bytes,
    plan: Plan,
    window_s: float,
    on_start: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Keep `plan.outstanding` requests in flight; count replies over `window_s` after warm-up."""
    for _ in range(plan.outstanding):
        sock.send(payload)
    clock = time.perf_counter
    start_at = clock() + plan.warmup_s
    end_at = t0 = now = 0.0
    count = 0
    measuring = False
    while True:
        _raw_recv(sock, payload)
        now = clock()
        if measuring:
            count += 1
            if now >= end_at:
                break
        elif now >= start_at:
            measuring, t0, end_at = True, now, now + window_s
            if on_start is not None:
                on_start()
        sock.send(payload)
    for _ in range(plan.outstanding - 1):  # leave nothing in flight for the next scenario
        _raw_recv(sock, payload)
    return {"requests": float(count), "seconds": now - t0, "rps": count / (now - t0)}


def client_raw(endpoint: str, plan: Plan) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = int(plan.request_timeout_s * 1000)
    sock.connect(endpoint)
    payload = payload_of(plan.size)
    try:
        harness.emit("phase", scenario="throughput")
        harness.emit(
            "result", scenario="throughput", **_raw_pump(sock, payload, plan, plan.window_s)
        )

        harness.emit("phase", scenario="latency")
        for _ in range(plan.latency_warmup):
            sock.send(payload)
            _raw_recv(sock, payload)
        clock = time.perf_counter_ns
        samples = []
        for _ in range(plan.latency_n):
            t = clock()
            sock.send(payload)
            _raw_recv(sock, payload)
            samples.append(clock() - t)
        harness.emit("result", scenario="latency", **harness.latency_summary_us(samples))

        harness.emit("phase", scenario="sustained")
        result = _raw_pump(sock, payload, plan, plan.sustained_s, lambda: harness.emit("mark"))
        harness.emit("result", scenario="sustained", **result)
    finally:
        sock.close()
        ctx.term()


class AsyncioDealer:
    """A DEALER on asyncio via add_reader: a Future per request, replies drained in batches."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.connect(endpoint)
        self._fd = socket_fd(self._sock)
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._next_id = 0
        self._drain_scheduled = False
        self._loop.add_reader(self._fd, self._drain)

    async def request(self, payload: bytes) -> bytes:
        rid = self._next_id
        self._next_id += 1
        future: asyncio.Future[bytes] = self._loop.create_future()
        self._pending[rid] = future
        # One frame: [8-byte id | payload]. A second frame would cost more than the id does.
        self._sock.send(rid.to_bytes(8, "little") + payload)
        if not self._drain_scheduled:
            # A send can swallow the FD's edge for replies that are already queued.
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)
        try:
            return await future
        finally:
            self._pending.pop(rid, None)

    def _drain(self) -> None:
        self._drain_scheduled = False
        sock, pending = self._sock, self._pending
        while True:
            try:
                frame = sock.recv(_NOBLOCK)
            except zmq.Again:
                if has_input(sock):
                    continue
                return
            future = pending.get(int.from_bytes(frame[:8], "little"))
            if future is not None and not future.done():
                future.set_result(frame[8:])

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        self._sock.close()


@contextlib.asynccontextmanager
async def raw_asyncio_requester(endpoint: str) -> AsyncIterator[Request]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = AsyncioDealer(ctx, endpoint)
    try:
        yield dealer.request
    finally:
        dealer.close()
        ctx.term()


@contextlib.asynccontextmanager
async def nats_requester(url: str, request_timeout: float) -> AsyncIterator[Request]:
    import nats

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)

    async def request(payload: bytes) -> bytes:
        msg = await nc.request(SUBJECT, payload, timeout=request_timeout)
        data: bytes = msg.data
        return data

    try:
        yield request
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def mesh_requester(
    endpoint: str, keyring_path: str, opts: dict[str, Any], request_timeout: float, split: str = ""
) -> AsyncIterator[Request]:
    import irismesh

    keys = granted(irismesh.Keyring.load(keyring_path), opts, call=(SUBJECT,))
    async with irismesh.Node(keyring=keys, seeds=[endpoint], survey=False, **opts) as client:
        await client.wait_for_members(SUBJECT, count=1, timeout=10)
        if split:  # every request then draws a version first (one group: its cheapest path)
            weights = {v: int(w) for v, _, w in (pair.partition("=") for pair in split.split(","))}
            await client.set_split(SUBJECT, weights, timeout=5)
        # `node.request` itself, as an application calls it (a coroutine of our own around it
        # would add a frame per request that raw-asyncio's requester does not have).
        yield functools.partial(client.request, SUBJECT, timeout=request_timeout)


async def _async_pump(
    request: Request,
    payload: bytes,
    plan: Plan,
    window_s: float,
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """`plan.outstanding` tasks each looping one request; count completions over `window_s`."""
    completed = errors = 0
    first_error = ""
    running = True

    async def worker() -> None:
        nonlocal completed, errors, first_error
        while running:
            try:
                reply = await request(payload)
            except Exception as exc:
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.01)  # an error raised at once must not starve the loop
                continue
            if reply != payload:
                raise harness.BenchError(
                    f"echo mismatch: sent {len(payload)} B, got {len(reply)} B"
                )
            completed += 1

    workers = [asyncio.create_task(worker()) for _ in range(plan.outstanding)]
    try:
        await asyncio.sleep(plan.warmup_s)
        c0, t0 = completed, time.perf_counter()
        if on_start is not None:
            on_start()
        await asyncio.sleep(window_s)
        c1, t1 = completed, time.perf_counter()
        running = False
        await asyncio.wait_for(asyncio.gather(*workers), plan.request_timeout_s + 5.0)
    finally:
        for task in workers:
            task.cancel()
    result: dict[str, Any] = {"requests": c1 - c0, "seconds": t1 - t0, "rps": (c1 - c0) / (t1 - t0)}
    if errors:
        result.update(errors=errors, first_error=first_error)
    return result


async def _async_latency(request: Request, payload: bytes, plan: Plan) -> dict[str, float]:
    for _ in range(plan.latency_warmup):
        await request(payload)
    clock = time.perf_counter_ns
    samples = []
    for _ in range(plan.latency_n):
        t = clock()
        reply = await request(payload)
        samples.append(clock() - t)
        if reply != payload:
            raise harness.BenchError(f"echo mismatch: sent {len(payload)} B, got {len(reply)} B")
    return harness.latency_summary_us(samples)


async def client_async(args: argparse.Namespace, plan: Plan) -> None:
    requester: contextlib.AbstractAsyncContextManager[Request]
    if args.system == "raw-asyncio":
        requester = raw_asyncio_requester(args.endpoint)
    elif args.system == "nats":
        requester = nats_requester(args.endpoint, plan.request_timeout_s)
    else:
        opts = parse_mesh_opts(args.mesh_opt)
        requester = mesh_requester(
            args.endpoint, args.keyring, opts, plan.request_timeout_s, args.split
        )
    payload = payload_of(plan.size)
    async with requester as request:
        harness.emit("phase", scenario="throughput")
        harness.emit(
            "result",
            scenario="throughput",
            **await _async_pump(request, payload, plan, plan.window_s),
        )
        harness.emit("phase", scenario="latency")
        harness.emit("result", scenario="latency", **await _async_latency(request, payload, plan))
        harness.emit("phase", scenario="sustained")
        sustained = await _async_pump(
            request, payload, plan, plan.sustained_s, lambda: harness.emit("mark")
        )
        harness.emit("result", scenario="sustained", **sustained)


def irismesh_run(main: Coroutine[Any, Any, None]) -> None:
    from irismesh import run

    run(main)


def run_child(args: argparse.Namespace) -> None:
    if args.role == "server":
        harness.exit_after(args.max_seconds)
        if args.system == "raw":
            serve_raw()
        elif args.system == "raw-asyncio":
            asyncio.run(serve_raw_asyncio())
        elif args.system == "nats":
            asyncio.run(serve_nats(args.endpoint))
        else:  # on irismesh's own loop: uvloop where installed (IRISMESH_LOOP=asyncio: not)
            irismesh_run(serve_mesh(args.keyring, parse_mesh_opts(args.mesh_opt)))
        return
    plan = Plan(**json.loads(args.plan))
    if args.system == "raw":
        client = functools.partial(client_raw, args.endpoint, plan)
    elif args.system == "mesh":
        client = functools.partial(irismesh_run, client_async(args, plan))
    else:
        client = functools.partial(asyncio.run, client_async(args, plan))
    harness.child_main(args.max_seconds, client, eof_status=1)
    harness.emit("done")


# ============================================================================================
# Parent: orchestration


@dataclass(kw_only=True, slots=True)
class ReqrepRun(harness.Run):
    """Settings of one benchmark run and everything it measured."""

    mesh_opts: list[str]
    split: str = ""


def child_argv(role: str, system: str, run: ReqrepRun, *extra: str) -> list[str]:
    options: list[str] = []
    if system in MESH_VARIANTS:
        for opt in [*run.mesh_opts, *MESH_VARIANTS[system]]:
            options += ["--mesh-opt", opt]
        if run.split:
            options += ["--split", run.split]
    budget = sum(plan.budget_s() for plan in run.plans) + 60.0
    child_system = "mesh" if system in MESH_VARIANTS else system
    options += ["--max-seconds", f"{budget:.0f}", *extra]
    return run.child_argv(__file__, role, child_system, *options)


def describe(system: str, plan: Plan, scenario: str) -> str:
    what = {
        "throughput": f"{plan.outstanding} outstanding, {plan.window_s:g} s",
        "latency": f"1 outstanding, {plan.latency_n} requests",
        "sustained": f"sustained {plan.sustained_s:g} s at {plan.outstanding} outstanding, RSS",
    }[scenario]
    return f"{LABELS[system]} {harness.size_label(plan.size)}, {what} ..."


def run_client(
    procs: harness.ChildProcesses,
    run: ReqrepRun,
    system: str,
    plan: Plan,
    endpoint: str,
    server_pids: dict[str, int],
) -> None:
    """One client process for one payload size; results land in `run.results` as they come."""
    name = f"{system} client {harness.size_label(plan.size)}"
    argv = child_argv("client", system, run, "--endpoint", endpoint, "--plan")
    client = procs.spawn(name, [*argv, json.dumps(dataclasses.asdict(plan))])
    results = run.results.setdefault(system, {}).setdefault(str(plan.size), {})
    events = harness.Events([client], plan.budget_s())
    try:
        for _, kind, event in events:
            if kind == "phase":
                run.announce(describe(system, plan, event["scenario"]))
            elif kind == "mark":
                events.sample({**server_pids, "client": client.pid})
            elif kind == "result":
                scenario = event.pop("scenario")
                if scenario == "sustained":
                    event.update(events.sampled())
                if event.get("errors"):
                    harness.progress(
                        f"  {event['errors']} errors, first: {event.get('first_error')}"
                    )
                results[scenario] = event
            elif kind == "done":
                try:
                    code = client.proc.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    code = None
                if code != 0:
                    harness.progress(
                        f"  warning: {name} did not exit cleanly after its results ({code})"
                    )
                return
    finally:
        procs.stop(client, grace=5.0)


def run_system(run: ReqrepRun, system: str) -> None:
    """Start the system's server(s), run one client per payload size, stop everything."""
    with harness.ChildProcesses() as procs:
        server_pids: dict[str, int] = {}
        extra: list[str] = []
        if system == "nats":
            broker, url = harness.start_nats_server(procs)
            server_pids["broker"] = broker.pid
            extra = ["--endpoint", url]
        name = f"{system} server"
        server = procs.spawn(name, child_argv("server", system, run, *extra))
        endpoint = harness.check_local(name, server.expect_prefix("READY ", timeout=30.0))
        server_pids["server"] = server.pid
        for plan in run.plans:
            run_client(procs, run, system, plan, endpoint, server_pids)


def make_plans(args: argparse.Namespace) -> list[Plan]:
    quick = args.quick
    sustained = args.duration if args.duration is not None else (5.0 if quick else 15.0)
    window = args.window if args.window is not None else (1.0 if quick else 3.0)
    return [
        Plan(
            size=size,
            outstanding=args.outstanding,
            warmup_s=0.25 if quick else 0.5,
            window_s=window,
            latency_warmup=100 if quick else 300,
            latency_n=1000 if quick else 4000,
            sustained_s=sustained,
        )
        for size in SIZES
    ]


def main_parent(args: argparse.Namespace) -> int:
    run = ReqrepRun(
        systems=harness.parse_only(args.only, SYSTEMS, ALIASES),
        labels=LABELS,
        mesh_systems=MESH_VARIANTS,
        plans=make_plans(args),
        steps_per_plan=len(SCENARIOS),
        mesh_opts=args.mesh_opt,
        split=args.split,
    )
    measure = functools.partial(run.each_system, functools.partial(run_system, run))
    report, figures = functools.partial(print_tables, run), functools.partial(ratios, run)
    settings = {"mesh_opts": parse_mesh_opts(run.mesh_opts), "split": run.split}
    return harness.run_parent(run, measure, report, figures, args.json, **settings)


# ============================================================================================
# Parent: report


def _cell(run: ReqrepRun, system: str, size: int, scenario: str) -> dict[str, Any] | None:
    result: dict[str, Any] | None = run.results.get(system, {}).get(str(size), {}).get(scenario)
    return result


def _figures(run: ReqrepRun, system: str, size: int, scenario: str) -> tuple[float, ...] | None:
    """The numbers a table cell shows: (req/s,) or (p50 us, p99 us)."""
    result = _cell(run, system, size, scenario)
    if result is None:
        return None
    if scenario == "latency":
        return (result["p50_us"], result["p99_us"])
    return (result["rps"],)


def ratios(run: ReqrepRun) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """irismesh divided by each baseline, per scenario and size, figure by figure."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for baseline in ("raw", "raw-asyncio", "nats"):
        for scenario in SCENARIOS:
            for size in SIZES:
                mesh = _figures(run, "mesh", size, scenario)
                base = _figures(run, baseline, size, scenario)
                if mesh and base:
                    key = f"mesh/{baseline}"
                    names = ("p50", "p99") if scenario == "latency" else ("rps",)
                    out.setdefault(key, {}).setdefault(scenario, {})[str(size)] = {
                        name: m / b for name, m, b in zip(names, mesh, base, strict=True)
                    }
    return out


def _show(figures: tuple[float, ...] | None, absent: str) -> str:
    if figures is None:
        return absent
    if len(figures) == 2:
        return f"{figures[0]:,.0f} [{figures[1]:,.0f}]"
    return f"{figures[0]:,.0f}"


def _show_ratio(run: ReqrepRun, baseline: str, size: int, scenario: str) -> str:
    mesh = _figures(run, "mesh", size, scenario)
    base = _figures(run, baseline, size, scenario)
    if not mesh or not base:
        return "-"
    parts = [f"{m / b:.2f}x" for m, b in zip(mesh, base, strict=True)]
    return parts[0] if len(parts) == 1 else f"{parts[0]} [{parts[1]}]"


def print_tables(run: ReqrepRun) -> None:
    from rich.text import Text

    out = harness.console(140)
    requested = run.requested

    def absent(system: str) -> str:
        if system not in requested:
            return "-"
        if system in run.skipped:
            return "skipped"
        return "failed" if system in run.failed else "-"

    rows = {
        "throughput": "throughput, 100 outstanding (req/s)",
        "latency": "latency, 1 outstanding (us p50 [p99])",
        "sustained": "sustained, 100 outstanding (req/s)",
    }
    table = harness.table(
        f"request/reply on 127.0.0.1, server and client in separate processes "
        f"({run.elapsed_s:.0f} s run)",
        ["scenario"],
        [
            "size",
            *(LABELS[system] for system in SYSTEMS),
            "irismesh / raw pyzmq",
            "irismesh / NATS",
        ],
        "req/s: higher is better, so a ratio below 1 means irismesh is slower; "
        "latency: lower is better, so a ratio above 1 means irismesh is slower",
    )
    for scenario in SCENARIOS:
        for size in SIZES:
            cells = [
                _show(_figures(run, system, size, scenario), absent(system)) for system in SYSTEMS
            ]
            row = [
                rows[scenario].replace("100", str(run.plans[0].outstanding)),
                harness.size_label(size),
                *cells,
                _show_ratio(run, "raw", size, scenario),
                _show_ratio(run, "nats", size, scenario),
            ]
            table.add_row(*(Text(cell) for cell in row))  # Text: "[p99]" is not markup
        table.add_section()
    out.print(table)
    variants = [
        v for v in ("mesh-null", "mesh-notel", "mesh-zmq", "mesh-grants") if v in run.systems
    ]
    harness.print_costs(
        out,
        "what sealing and telemetry cost, and the transport gains: irismesh / its variant, "
        "same run",
        ["scenario", "size"],
        [LABELS[variant] for variant in variants] if "mesh" in run.systems else [],
        (
            [
                scenario,
                harness.size_label(size),
                *(_show_ratio(run, v, size, scenario) for v in variants),
            ]
            for scenario in SCENARIOS
            for size in SIZES
        ),
    )

    memory = harness.table(
        "memory and CPU over the sustained run (RSS sampled once a second after warm-up)",
        ["system", "size", "process"],
        ["req/s", "start MB", "peak MB", "end MB", "growth MB", "CPU us/req", "others' CPU"],
        "flat memory: growth (end - start) stays near zero; CPU us/req: CPU time of "
        "that process / requests served in the window; others' CPU: share of the machine used "
        "by other processes meanwhile (well above 0% = disturbed figures)",
    )
    for system in SYSTEMS:
        for size in SIZES:
            result = _cell(run, system, size, "sustained")
            if result is None:
                continue
            for index, (role, mem) in enumerate(result.get("memory", {}).items()):
                requests = result["requests"] or 1
                others = result.get("others_cpu_percent")
                memory.add_row(
                    LABELS[system],
                    harness.size_label(size),
                    role,
                    f"{result['rps']:,.0f}",
                    f"{mem['start_mb']:.1f}",
                    f"{mem['peak_mb']:.1f}",
                    f"{mem['end_mb']:.1f}",
                    f"{mem['growth_mb']:+.2f}",
                    f"{mem['cpu_s'] / requests * 1e6:.1f}",
                    f"{others:.0f}%" if index == 0 and others is not None else "",
                )
        memory.add_section()
    if memory.row_count:
        out.print(memory)
    harness.print_footnotes(out, run)


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter runs (about a minute)")
    parser.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="length of the sustained (memory) run per size; default 15, 5 with --quick",
    )
    parser.add_argument(
        "--window",
        type=float,
        metavar="SECONDS",
        help="throughput measuring window after warm-up; default 3, 1 with --quick",
    )
    parser.add_argument("--outstanding", type=int, default=100, help=argparse.SUPPRESS)
    harness.add_only(
        parser,
        DEFAULT_SYSTEMS,
        "also mesh-null: sealing off, mesh-notel: telemetry off, mesh-zmq: links on zmq, "
        "mesh-grants: the keyring requires grants and each node holds one; irismesh = mesh",
    )
    parser.add_argument(
        "--mesh-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra irismesh.Node keyword for server and client (repeatable), e.g. sealer=null",
    )
    parser.add_argument(
        "--split",
        default="",
        metavar="VERSION=WEIGHT,...",
        help="irismesh: the client sets this traffic split on the cluster before measuring "
        "(name the member's version with --mesh-opt version=V)",
    )
    harness.add_child_arguments(parser, ("server", "client"), SYSTEMS)
    return parser


if __name__ == "__main__":
    sys.exit(harness.bench_main(build_parser(), run_child, main_parent))
