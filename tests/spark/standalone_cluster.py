"""A Spark standalone master and worker on 127.0.0.1, and one report run on them, in the
background.

pip's pyspark has no sbin/start-master.sh, so the master and the worker run as plain `java`
processes from pyspark's own jars, each in a process group of its own; `stop()` ends those
groups (the worker's executors included) and the report's, however the test ends.

Starting two JVMs, then a driver and an executor, takes 20-40 s on a loaded two-core machine,
longer than the rest of the Spark tests together, so conftest starts a `StandaloneRun` when the
session starts and the test only collects its result: the cluster and the local tests overlap.
The run brings its own data (synthetic spool compacted with pyarrow, no Spark), so it needs
nothing from the shared session to begin.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT = 60.0
REPORT_TIMEOUT = 240.0
JOBS = ("fairness", "errors")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group the child leads, then SIGKILL whatever is left of it."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            continue
        break
    # The leader is gone; children it started (executors) may not be.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass(slots=True)
class Outcome:
    """What the background run ended with: a skip reason, or the report's exit and output."""

    skip: str | None = None
    returncode: int | None = None
    stderr: str = ""
    seconds: float = 0.0


class StandaloneRun:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.parquet = base / "parquet"
        self.report = base / "report"
        self.url = ""
        self.outcome = Outcome()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="spark-standalone", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def result(self, timeout: float = START_TIMEOUT + REPORT_TIMEOUT + 30) -> Outcome:
        self._thread.join(timeout)
        if self._thread.is_alive():
            return Outcome(skip=f"the standalone run did not finish within {timeout:.0f} s")
        return self.outcome

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            procs = list(self._procs)
        for proc in reversed(procs):
            stop_group(proc)
        self._thread.join(30)

    def alive(self) -> list[int]:
        return [p.pid for p in self._procs if p.poll() is None]

    # ------------------------------------------------------------------ background thread

    def _spawn(self, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._stopping:
                raise RuntimeError("stopping")
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            self._procs.append(proc)
            return proc

    def _run(self) -> None:
        try:
            self.outcome = self._run_steps()
        except Exception as exc:  # reported by the test, not lost in a thread
            self.outcome = Outcome(skip=None, returncode=-1, stderr=f"{type(exc).__name__}: {exc}")

    def _run_steps(self) -> Outcome:
        java = shutil.which("java")
        if java is None:
            return Outcome(skip="Java not found on PATH: a standalone cluster needs a JRE 17")
        import pyspark

        from irismesh.spark_telemetry.compact import compact
        from irismesh.spark_telemetry.session import JVM_OPTIONS
        from irismesh.spark_telemetry.synthetic import generate, write_spool

        write_spool(self.base / "spool", generate(800, seed=11, sample_every=2, late=0.05))
        compact(self.base / "spool", self.parquet, done="keep")

        home = Path(pyspark.__file__).resolve().parent
        if not (home / "jars").is_dir():
            return Outcome(skip=f"no jars/ in {home}: this pyspark cannot run a standalone cluster")
        env = {
            **os.environ,
            "SPARK_LOCAL_IP": "127.0.0.1",  # the web UIs bind here instead of every interface
            "SPARK_HOME": str(home),
            "SPARK_SCALA_VERSION": "2.13",  # pip's pyspark has no build tree to find it from
            "PYSPARK_PYTHON": sys.executable,
        }
        jvm = [java, "-Xmx256m", *JVM_OPTIONS.split(), "-cp", str(home / "jars" / "*")]
        port = free_port()
        self.url = f"spark://127.0.0.1:{port}"
        master_log, worker_log = self.base / "master.log", self.base / "worker.log"
        self._spawn(
            [
                *jvm,
                "-Dspark.master.rest.enabled=false",
                "org.apache.spark.deploy.master.Master",
                "--host", "127.0.0.1",
                "--port", str(port),
                "--webui-port", str(free_port()),
            ],
            master_log,
            env,
        )  # fmt: skip
        self._spawn(
            [
                *jvm,
                "org.apache.spark.deploy.worker.Worker",
                "--host", "127.0.0.1",
                "--webui-port", str(free_port()),
                "--cores", "2",
                "--memory", "1g",
                "--work-dir", str(self.base / "work"),
                self.url,
            ],
            worker_log,
            env,
        )  # fmt: skip
        if not self._wait_for(worker_log, "Successfully registered with master"):
            tail = "\n".join(
                f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-8:])
                for log in (master_log, worker_log)
            )
            return Outcome(skip=f"standalone cluster not up within {START_TIMEOUT:.0f} s\n{tail}")
        started = time.monotonic()
        report_log = self.base / "report.log"
        proc = self._spawn(
            [
                sys.executable, "-m", "irismesh.spark_telemetry", "report",
                "--parquet", str(self.parquet),
                "--out", str(self.report),
                "--master", self.url,
                "--jobs", ",".join(JOBS),
                "--quiet",
                "--quick-jvm",
            ],
            report_log,
            env,
        )  # fmt: skip
        try:
            code = proc.wait(REPORT_TIMEOUT)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            code = -9
        return Outcome(
            returncode=code,
            stderr=report_log.read_text(errors="replace")[-4000:],
            seconds=time.monotonic() - started,
        )

    def _wait_for(self, log: Path, text: str) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and not self._stopping:
            if text in log.read_text(errors="replace"):
                return True
            if any(p.poll() is not None for p in self._procs):
                return False
            time.sleep(0.2)
        return False
