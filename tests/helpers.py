"""Helpers shared by the tests: condition waits with deadlines, worker processes, `mesh` runs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
MESH = [sys.executable, "-m", "irismesh"]  # the `mesh` tool, as a subprocess

_P = ParamSpec("_P")


def run_with_deadline(coro: Awaitable[None], timeout: float) -> None:
    """Run a test's coroutine in a fresh event loop; TimeoutError fails it after `timeout` s."""

    async def bounded() -> None:
        await asyncio.wait_for(coro, timeout)

    asyncio.run(bounded())


def deadline(
    timeout: float,
) -> Callable[[Callable[_P, Awaitable[None]]], Callable[_P, None]]:
    """An async test, run by `run_with_deadline` (pytest passes it the fixtures it names)."""

    def wrap(test: Callable[_P, Awaitable[None]]) -> Callable[_P, None]:
        @functools.wraps(test)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
            run_with_deadline(test(*args, **kwargs), timeout)

        return run

    return wrap


async def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll `predicate` every 5 ms; return seconds taken, or fail the test at the deadline."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        if loop.time() - start > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)
    return loop.time() - start


async def until_no_responders(node: Any, cluster: str, timeout: float) -> None:
    """Call `cluster` from `node` until a request fails at once with NoResponders (membership
    has heard that nobody serves it); each attempt waits 0.5 s at most. Fails the test at
    the deadline."""
    import irismesh

    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while loop.time() < until:
        try:
            await node.request(cluster, b"", timeout=0.5)
        except irismesh.NoResponders:
            return
        except irismesh.MeshError:  # timed out, or refused: asked again
            continue
    pytest.fail(f"requests to {cluster} did not fail with NoResponders within {timeout} s")


def wait_until_sync(
    predicate: Callable[[], object], timeout: float, what: str, step: float = 0.005
) -> float:
    """`wait_until` for code without an event loop: poll every `step` seconds."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)
    return time.monotonic() - start


class Workers:
    """Worker processes of examples/failover.py, killed at teardown whatever happens."""

    def __init__(self, keyfile: Path) -> None:
        self.env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
        self.env.pop("IRISMESH_KEYS", None)
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str, seeds: list[str] = (), delay: float = 0.0) -> str:  # type: ignore[assignment]
        cmd = [sys.executable, str(ROOT / "examples" / "failover.py"), "--worker", name]
        cmd += ["--delay", str(delay)]
        for seed in seeds:
            cmd += ["--seed", seed]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=self.env)
        self.procs[name] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["READY"], f"worker {name} did not start: {line!r}"
        return line[1]

    def close(self) -> None:
        kill_all(self.procs.values())


def kill_all(procs: Iterable[subprocess.Popen[Any]], *, drain: bool = False) -> None:
    """Kill each of `procs` that still runs, then reap them all (`drain`: reading what is
    left in their pipes, which closes them)."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        if drain:
            proc.communicate(timeout=10)
        else:
            proc.wait(timeout=10)


def echo_or_boom(payload: bytes) -> bytes:
    """A request handler: the payload back, or ValueError("boom") for b"boom"."""
    if payload == b"boom":
        raise ValueError("boom")
    return payload


def run_mesh(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    timeout: float = 60,
    input: str | bytes | None = None,
    text: bool = True,
) -> subprocess.CompletedProcess[Any]:
    """`mesh ARGS` run to its end: its exit status, stdout and stderr (bytes with `text=False`).
    It reads `input`, else nothing: never this process's standard input."""
    return subprocess.run(
        [*MESH, *args],
        input=input,
        stdin=subprocess.DEVNULL if input is None else None,
        capture_output=True,
        text=text,
        env=env,
        timeout=timeout,
        check=False,
    )


def assert_error(result: subprocess.CompletedProcess[str], status: int, *fragments: str) -> None:
    """One line `mesh: ...` on stderr, the right exit status, no traceback, nothing on stdout."""
    where = f"stdout={result.stdout!r} stderr={result.stderr!r}"
    assert result.returncode == status, where
    lines = result.stderr.splitlines()
    assert len(lines) == 1, where
    assert lines[0].startswith("mesh: "), where
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], where
    assert result.stdout == "", where


def run_all(
    cases: Sequence[tuple[Sequence[str], int, str]],
    env: dict[str, str],
    cwd: Path | None = None,
    timeout: float = 60,
) -> None:
    """Run `mesh` error cases in parallel: (argv, exit status, fragment of the one-line message)."""
    procs = [
        subprocess.Popen(
            [*MESH, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        for argv, _, _ in cases
    ]
    failures = []
    try:
        for proc, (argv, status, fragment) in zip(procs, cases, strict=True):
            out, err = proc.communicate(timeout=timeout)
            result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            try:
                assert_error(result, status, fragment)
            except AssertionError as exc:
                failures.append(f"mesh {' '.join(argv)}: {exc}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert not failures, "\n".join(failures)


def assert_usage_errors(
    cases: Sequence[tuple[Sequence[str], str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`mesh` error cases run in-process (`cli.main`), to spare an interpreter per case: each
    (argv, fragment) exits 2 with one line `mesh: ...` holding `fragment`, and nothing on stdout."""
    from irismesh import cli

    failures = []
    for argv, fragment in cases:
        status: int | str | None
        try:
            status = cli.main(list(argv))
        except SystemExit as exit_:  # argparse's own errors
            status = exit_.code
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        if status != 2 or len(lines) != 1 or not lines[0].startswith("mesh: ") or captured.out:
            failures.append(f"mesh {' '.join(argv)}: status {status}, {captured!r}")
        elif fragment not in lines[0]:
            failures.append(f"mesh {' '.join(argv)}: {fragment!r} not in {lines[0]!r}")
    assert not failures, "\n".join(failures)


async def calls_of_each_outcome(client: Any, count: int) -> None:
    """`count` requests to "db" (served by `echo_or_boom`) that succeed, one the member fails
    (a RemoteError) and one to a cluster nobody serves (NoResponders)."""
    import irismesh

    await client.wait_for_members("db", timeout=5)
    await asyncio.gather(*(client.request("db", b"%d" % i) for i in range(count)))
    with pytest.raises(irismesh.RemoteError):
        await client.request("db", b"boom")
    with pytest.raises(irismesh.NoResponders):
        await client.request("nobody", b"x")


def mesh_workdir(
    factory: pytest.TempPathFactory, name: str, scopes: Sequence[str] = ("*",), **files: str
) -> tuple[Path, dict[str, str]]:
    """A fresh directory holding a new keyring (mesh.keys, keys for `scopes`) and `files`
    (file name -> text), and the environment in which `mesh` commands use that keyring."""
    import irismesh

    workdir = factory.mktemp(name)
    keyfile = workdir / "mesh.keys"
    irismesh.Keyring.generate(list(scopes)).save(keyfile)
    for file, text in files.items():
        (workdir / file).write_text(text)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile), COLUMNS="160")
    env.pop("IRISMESH_KEYS", None)
    return workdir, env


def commands_help(names: Sequence[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Each command's --help (in-process), once `mesh --help` is seen to list it and run it in
    its tour, and the command's own examples to run it."""
    from irismesh import cli

    top = subprocess.run([*MESH, "--help"], capture_output=True, text=True, check=True)
    texts = {}
    for name in names:
        assert f"\n    {name} " in top.stdout or f"\n    {name}\n" in top.stdout, top.stdout
        assert f"mesh {name} " in top.stdout  # in the tour
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--help"])
        assert exit_.value.code == 0
        texts[name] = capsys.readouterr().out
        assert f"mesh {name}" in texts[name].partition("examples:")[2], name
    return texts


class InProcess:
    """`mesh` error cases run in-process (`cli.main`) against a test's running mesh."""

    def __init__(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        self._tmp_path, self._monkeypatch, self._capsys = tmp_path, monkeypatch, capsys

    def join(self, env: dict[str, str]) -> Path:
        """Take the keyring from `env`, as the mesh's processes do; return a keyring file
        with a key for 'db' only, for the "no key for ..." cases."""
        import irismesh

        self._monkeypatch.setenv("IRISMESH_KEYFILE", str(env["IRISMESH_KEYFILE"]))
        self._monkeypatch.delenv("IRISMESH_KEYS", raising=False)
        db_only = self._tmp_path / "db_only.keys"
        irismesh.Keyring.generate(["db"]).save(db_only)
        return db_only

    def assert_usage_errors(self, cases: Sequence[tuple[Sequence[str], str]]) -> None:
        assert_usage_errors(cases, self._capsys)


def run_example(name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run examples/`name` in a process group of its own, all of which dies at the end (the
    members it starts join the group, so none outlives the test); it must exit 0."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / name), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{name} took over {timeout} s:\n{out}\n{err}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out + err
    assert "Traceback" not in err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


async def memory_members(keys: Any, *directories: Path) -> list[Any]:
    """Started memory members (irismesh.Node), one storing in each of `directories`, each
    joining through the first."""
    import irismesh

    nodes: list[Any] = []
    for directory in directories:
        seeds = [nodes[0].endpoint] if nodes else []
        node = irismesh.Node(keyring=keys, memory=directory, seeds=seeds)
        nodes.append(await node.start())
    return nodes


@contextlib.asynccontextmanager
async def memory_mesh(keys: Any, *directories: Path) -> AsyncIterator[tuple[list[Any], Any]]:
    """Memory members storing in `directories` (`memory_members`) and a client node joined
    through the first that sees them all; every node closed at the end."""
    import irismesh

    members = await memory_members(keys, *directories)
    client = irismesh.Node(keyring=keys, seeds=[members[0].endpoint])
    try:
        await client.start()
        await client.wait_for_members("_memory", len(members), timeout=10)
        yield members, client
    finally:
        await asyncio.gather(client.close(), *(member.close() for member in reversed(members)))


@contextlib.asynccontextmanager
async def all_started(discoveries: Iterable[Any]) -> AsyncIterator[None]:
    """Each of `discoveries` started (`await start()`) in turn; all closed at the end."""
    discoveries = list(discoveries)
    try:
        for discovery in discoveries:
            await discovery.start()
        yield
    finally:
        for discovery in discoveries:
            await discovery.close()


async def end_child(proc: asyncio.subprocess.Process, timeout: float) -> None:
    """Close a child's stdin (its signal to exit) and wait for it; killed after `timeout` s."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()


@dataclass
class Discovering:
    """A node under discovery in a test: its id and endpoint, and the candidates its
    discovery reported (`candidate_recorder`)."""

    node_id: bytes
    endpoint: str
    seen: set[tuple[bytes, str]]

    @property
    def me(self) -> tuple[bytes, str]:
        return (self.node_id, self.endpoint)


_D = TypeVar("_D", bound=Discovering)


async def realms_kept_apart(
    blue_a: _D,
    blue_b: _D,
    green: _D,
    dropped: Callable[[_D], int],
    at_least: tuple[int, int],
    timeout: float,
) -> None:
    """Two nodes of one realm (blue) see each other, and a node of another (green) sees
    neither and is seen by neither. The wait is over once green has dropped at least
    `at_least[0]` of blue's datagrams (`dropped` counts them) and each blue `at_least[1]` of
    green's: each side has heard the other, so its silence is not luck."""
    await wait_until(
        lambda: blue_a.seen == {blue_b.me} and blue_b.seen == {blue_a.me},
        timeout,
        "the two blue nodes see each other",
    )
    green_least, blue_least = at_least
    await wait_until(
        lambda: (
            dropped(green) >= green_least
            and dropped(blue_a) >= blue_least
            and dropped(blue_b) >= blue_least
        ),
        timeout,
        "each realm's datagrams dropped by the other",
    )
    assert green.seen == set()
    assert green.me not in blue_a.seen | blue_b.seen


def candidate_recorder(
    *, raising: bool = False
) -> tuple[set[tuple[bytes, str]], Callable[[bytes, str], None]]:
    """A discovery's `on_candidate` that keeps what it is told in the set returned with it;
    with `raising` it also raises, as a buggy handler would."""
    seen: set[tuple[bytes, str]] = set()

    def on_candidate(candidate_id: bytes, candidate_endpoint: str) -> None:
        seen.add((candidate_id, candidate_endpoint))
        if raising:
            raise RuntimeError("a buggy candidate handler")

    return seen, on_candidate


def burn(seconds: float) -> None:
    """Busy CPU, as a handler that computes."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class LoadStalled(AssertionError):
    """A load's requests have all failed for a while: its members are gone (the test fails)."""


class RequestLoad:
    """Workers that keep `workers` requests to `cluster` in flight, in bounded memory.

    Every outcome is counted (replies, wrong replies, failures by error type, with the first
    `SAMPLES` failures kept as examples), never listed. A failed request is retried after a
    pause of `backoff`, as a real client would. `wait_until` waits on a condition like the
    module's `wait_until`, and fails at once, saying so, when no request has succeeded for
    `stall` seconds while failures came: the members died, and waiting longer only spins.
    """

    SAMPLES = 5

    def __init__(
        self,
        node: Any,
        cluster: str,
        *,
        workers: int = 16,
        timeout: float = 5.0,
        stall: float = 3.0,
        backoff: float = 0.01,
    ) -> None:
        self.node = node
        self.cluster = cluster
        self.timeout = timeout
        self.stall = stall
        self.backoff = backoff
        self.served = 0
        self.wrong = 0
        self.failed: Counter[str] = Counter()
        self.samples: list[str] = []
        self._last_ok = time.monotonic()
        self._running = True
        self._tasks = [asyncio.ensure_future(self._worker(w)) for w in range(workers)]

    @property
    def failures(self) -> int:
        return sum(self.failed.values())

    def summary(self) -> str:
        kinds = ", ".join(f"{count} {kind}" for kind, count in self.failed.most_common())
        return f"{self.served} served, {self.wrong} wrong, {self.failures} failed" + (
            f" ({kinds}; first: {self.samples})" if kinds else ""
        )

    def stalled(self) -> bool:
        return bool(self.failed) and time.monotonic() - self._last_ok > self.stall

    async def _worker(self, worker: int) -> None:
        i = 0
        while self._running:
            payload = b"%d-%d" % (worker, i)
            i += 1
            try:
                reply = await self.node.request(self.cluster, payload, timeout=self.timeout)
            except Exception as exc:  # every failure is a count, never a crash of the load
                self.failed[type(exc).__name__] += 1
                if len(self.samples) < self.SAMPLES:
                    self.samples.append(f"{payload!r}: {exc!r}")
                await asyncio.sleep(self.backoff)
                continue
            self._last_ok = time.monotonic()
            if not reply.endswith(payload):
                self.wrong += 1
            self.served += 1

    async def wait_until(self, predicate: Callable[[], object], timeout: float, what: str) -> float:
        """Poll `predicate` every 5 ms; fail the test at the deadline, or as the load stalls."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not predicate():
            if self.stalled():
                pytest.fail(
                    f"the load on {self.cluster!r} stalled while waiting for {what}: no reply "
                    f"for {self.stall} s, its members are gone ({self.summary()})"
                )
            if loop.time() - start > timeout:
                pytest.fail(f"timed out after {timeout} s waiting for {what} ({self.summary()})")
            await asyncio.sleep(0.005)
        return loop.time() - start

    async def stop(self) -> None:
        """End the workers (each within its request's timeout) and wait for them."""
        self._running = False
        _done, pending = await asyncio.wait(self._tasks, timeout=self.timeout + 1)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class NumberedCalls:
    """`total` requests to `cluster`, numbered from 0 and sent by many callers at once; each
    reply must end in ':<its number>' (the answering worker's name before the colon).

    Counted, never listed: the replies of each worker (`served`), and the wrong ones (the first
    `SAMPLES` kept as examples). A request that fails fails the test.
    """

    SAMPLES = 5

    def __init__(self, client: Any, cluster: str, total: int) -> None:
        self.client = client
        self.cluster = cluster
        self.total = total
        self.served: Counter[str] = Counter()
        self.wrong = 0
        self.samples: list[str] = []
        self._next = 0

    @property
    def done(self) -> int:
        return sum(self.served.values())

    async def run(self, in_flight: int, *alongside: Awaitable[None]) -> None:
        """Send every request, `in_flight` at a time, while the `alongside` coroutines run."""
        await asyncio.gather(*alongside, *(self._caller() for _ in range(in_flight)))

    async def _caller(self) -> None:
        while self._next < self.total:
            i = self._next
            self._next += 1
            reply = await self.client.request(self.cluster, b"%d" % i, timeout=10)
            who, _, echoed = reply.partition(b":")
            if echoed != b"%d" % i:
                self.wrong += 1
                if len(self.samples) < self.SAMPLES:
                    self.samples.append(f"{i}: {reply!r}")
            self.served[who.decode()] += 1
