"""A lab of network namespaces for multi-host tests, torn down whatever happens.

Layout (see shared/NETLAB.md): one namespace holds a bridge `br0` and nothing else; each host
is a namespace of its own with one veth `eth0` (address 10.77.0.N/24) whose peer `pN` sits in
the bridge's namespace. Every link is created from inside the namespaces, so nothing in the
host namespace is touched; the machine's eth0 is never on the path. Namespace names carry the
test process's pid, and labs that a killed run left behind (their pid is gone) are removed when
the next lab is built.

Faults: packet loss with an nft (or iptables) statistic rule inside one host's namespace, a
partition with an nft `bridge` table in the bridge's namespace, crashes and stalls with
SIGKILL/SIGSTOP to the node's process (`ip netns exec` execs the program: its pid is the
node's).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

NODE_SCRIPT = Path(__file__).resolve().parent / "meshnode.py"
SUBNET = "10.77.0"
PORT = 7400
PREFIX = "imtest"  # every namespace this module creates: imtest<pid>x<n>-<host>
_NAME = re.compile(rf"^{PREFIX}(\d+)x\d+-")
_counter = itertools.count(1)


class LabError(Exception):
    """A lab step failed; the message says which and why."""


def _cmd(argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> str:
    result = subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be used here (None when they can): root, `ip`, a probe netns."""
    if os.geteuid() != 0:
        return "network namespace tests need root (run pytest as root)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}x0-probe"
    try:
        _cmd(["ip", "netns", "add", probe])
    except (LabError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` is not permitted here: {exc}"
    try:
        _cmd(["ip", "netns", "del", probe])
    except (LabError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns del` failed: {exc}"
    return None


@contextlib.contextmanager
def built_lab(host_names: Iterable[str], workdir: Path, keyfile: Path) -> Iterator[Lab]:
    """A lab built for one test, closed after it; then each node's stderr tail is printed
    (pytest shows it when the test failed)."""
    lab = Lab(host_names, workdir, keyfile)
    try:
        lab.build()
        yield lab
    finally:
        lab.close()
        for name, node in lab.nodes.items():
            tail = node.stderr_tail()
            if tail:
                print(f"--- {name} stderr ---\n{tail}")


def _netns_list() -> list[str]:
    out = _cmd(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str) -> None:
    """SIGKILL whatever still runs in `ns`, by pid (never by name)."""
    with contextlib.suppress(LabError, OSError, subprocess.TimeoutExpired):
        for word in _cmd(["ip", "netns", "pids", ns]).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(word), signal.SIGKILL)


def _delete_netns(ns: str) -> None:
    _kill_netns_pids(ns)
    with contextlib.suppress(LabError, OSError, subprocess.TimeoutExpired):
        _cmd(["ip", "netns", "del", ns])


def remove_stale_labs() -> list[str]:
    """Delete the namespaces of earlier runs of this module whose process is gone."""
    removed = []
    for ns in _netns_list():
        match = _NAME.match(ns)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            _delete_netns(ns)
            removed.append(ns)
    return removed


def _pdeathsig() -> Any:
    """preexec_fn: the child gets SIGKILL if the test process dies (survives `ip netns exec`)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return preexec


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    ns: str
    addr: str
    port_name: str  # its veth's peer in the bridge namespace

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.addr}:{PORT}"


class MeshProcess:
    """One meshnode.py in its host's namespace, spoken to in JSON lines."""

    def __init__(self, host: Host, argv: Sequence[str], env: dict[str, str], logdir: Path) -> None:
        self.host = host
        self.name = host.name
        self.stderr_path = logdir / f"{host.name}.stderr"
        self._stderr: IO[bytes] = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            preexec_fn=_pdeathsig(),  # spawned from the test's main thread only
        )
        self.pid = self.proc.pid
        self.info: dict[str, Any] = {}
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._replies: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._eof = False
        self._ids = itertools.count(1)
        threading.Thread(target=self._pump, name=f"{self.name}-stdout", daemon=True).start()

    @property
    def node_id(self) -> str:
        return str(self.info["id"])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                message = {"event": "raw", "text": raw.decode(errors="replace")}
            with self._cond:
                if isinstance(message, dict) and isinstance(message.get("re"), int):
                    self._replies[message["re"]] = message
                elif isinstance(message, dict) and message.get("event") == "ready":
                    self.info = message
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def stderr_tail(self, lines: int = 20) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def _failed(self, why: str) -> LabError:
        return LabError(f"{self.name}: {why}\n--- {self.name} stderr ---\n{self.stderr_tail()}")

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        with self._cond:
            while not self.info:
                if self._eof:
                    raise self._failed(f"exited with status {self.proc.wait(5)} before ready")
                if not self._cond.wait(deadline - time.monotonic()) and not self.info:
                    raise self._failed("not ready by the deadline")
        return self.info

    def send(self, cmd: str, **fields: Any) -> int:
        """Send a command; the answer is picked up with `reply(id, ...)`."""
        ident = next(self._ids)
        line = json.dumps({"cmd": cmd, "id": ident, **fields}) + "\n"
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise self._failed(f"cannot send {cmd}: {exc}") from exc
        return ident

    def reply(self, ident: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while ident not in self._replies:
                if self._eof:
                    raise self._failed(f"exited (status {self.proc.poll()}) before answering")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._failed(f"no answer to command {ident} within {timeout} s")
                self._cond.wait(remaining)
            return self._replies.pop(ident)

    def call(self, cmd: str, timeout: float = 10.0, **fields: Any) -> dict[str, Any]:
        answer = self.reply(self.send(cmd, **fields), timeout)
        if not answer.get("ok"):
            raise self._failed(f"{cmd} failed: {answer.get('error', answer)}")
        return answer

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # a stopped process dies of SIGKILL too, but be sure
            self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._stderr.close()


class Lab:
    """Namespaces, a bridge, the node processes; `close()` removes everything it made."""

    def __init__(self, host_names: Iterable[str], workdir: Path, keyfile: Path) -> None:
        self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(host_names, start=1):
            ns = f"{self.tag}-{name}"
            self.hosts[name] = Host(name, ns, f"{SUBNET}.{i}", f"p{i}")
        self.workdir = workdir
        self.env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile), PYTHONUNBUFFERED="1")
        self.env.pop("IRISMESH_KEYS", None)
        self.nodes: dict[str, MeshProcess] = {}
        self._made: list[str] = []
        self._partitioned = False

    # ------------------------------------------------------------- build and tear down

    def build(self) -> float:
        """Create the namespaces and links; returns the seconds it took."""
        started = time.monotonic()
        remove_stale_labs()
        sw = self.switch
        self._add_netns(sw)
        _cmd(["ip", "-n", sw, "link", "set", "lo", "up"])
        bridge = ["mcast_snooping", "0", "stp_state", "0", "forward_delay", "0"]
        _cmd(["ip", "-n", sw, "link", "add", "br0", "type", "bridge", *bridge])
        _cmd(["ip", "-n", sw, "link", "set", "br0", "up"])
        for host in self.hosts.values():
            ns = host.ns
            self._add_netns(ns)
            # Made from inside the host's namespace, its peer created in the bridge's.
            peer = ["peer", "name", host.port_name, "netns", sw]
            _cmd(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", *peer])
            _cmd(["ip", "-n", sw, "link", "set", host.port_name, "master", "br0"])
            _cmd(["ip", "-n", sw, "link", "set", host.port_name, "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{host.addr}/24", "dev", "eth0"])
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            _cmd(["ip", "-n", ns, "link", "set", "eth0", "up"])
            for route in ("224.0.0.0/4", "255.255.255.255/32"):
                _cmd(["ip", "-n", ns, "route", "add", route, "dev", "eth0"])
        return time.monotonic() - started

    def _add_netns(self, ns: str) -> None:
        _cmd(["ip", "netns", "add", ns])
        self._made.append(ns)

    def close(self) -> None:
        """Kill every node by pid, then delete every namespace; never raises."""
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                node.kill()
        for ns in reversed(self._made):
            _delete_netns(ns)
        self._made.clear()
        leftovers = [ns for ns in _netns_list() if ns.startswith(self.tag + "-")]
        for ns in leftovers:
            _delete_netns(ns)

    # ------------------------------------------------------------- nodes

    def start(
        self,
        names: Iterable[str],
        *,
        cluster: str = "work",
        discovery: str = "survey",
        seeds: Iterable[str] = (),
        delay: float = 0.002,
        clients: Iterable[str] = (),
        timeout: float = 15.0,
        extra: Mapping[str, Sequence[str]] | None = None,
    ) -> dict[str, MeshProcess]:
        """Start nodes on the named hosts (all at once), wait until every one is ready.

        Hosts in `clients` join no cluster: they only send requests. `extra` adds arguments
        to some hosts' nodes (`meshnode.py --identity FILE --grant FILE`).
        """
        clients = set(clients)
        started: dict[str, MeshProcess] = {}
        for name in names:
            host = self.hosts[name]
            argv = [sys.executable, str(NODE_SCRIPT), "--name", name, "--addr", host.addr]
            argv += ["--port", str(PORT), "--discovery", discovery, "--delay", str(delay)]
            argv += ["--cluster", "" if name in clients else cluster, "--target", cluster]
            for seed in seeds:
                argv += ["--seed", seed]
            argv += list((extra or {}).get(name, ()))  # e.g. an identity and a grant
            node = MeshProcess(host, argv, self.env, self.workdir)
            self.nodes[name] = started[name] = node
        deadline = time.monotonic() + timeout
        for node in started.values():
            node.wait_ready(deadline)
        return started

    def ids(self, names: Iterable[str]) -> list[str]:
        return [self.nodes[n].node_id for n in names]

    def wait_all(
        self,
        expectations: Mapping[str, tuple[Sequence[str], Sequence[str]]],
        timeout: float,
    ) -> dict[str, float]:
        """For each node, wait until it sees `present` as members and none of `absent`.

        Every node waits at once; returns the monotonic time at which each one's condition
        started to hold. Raises LabError with each unhappy node's view at the deadline.
        """
        sent = {}
        for name, (present, absent) in expectations.items():
            sent[name] = self.nodes[name].send(
                "wait", present=self.ids(present), absent=self.ids(absent), timeout=timeout
            )
        at: dict[str, float] = {}
        problems = []
        for name, ident in sent.items():
            answer = self.nodes[name].reply(ident, timeout + 5.0)
            if answer.get("ok"):
                at[name] = float(answer["at"])
            else:
                names = self.names_of(answer.get("members", []))
                problems.append(f"{name} sees {names}")
        if problems:
            raise LabError(f"membership not reached within {timeout} s: " + "; ".join(problems))
        return at

    def name_of(self, node_id: str) -> str:
        for name, node in self.nodes.items():
            if node.info.get("id") == node_id:
                return name
        return node_id[:8]

    def names_of(self, ids: Iterable[str]) -> list[str]:
        return sorted(self.name_of(i) for i in ids)

    # ------------------------------------------------------------- faults

    def nft(self, ns: str, script: str) -> None:
        _cmd(["ip", "netns", "exec", ns, "nft", "-f", "-"], stdin=script)

    def loss(self, name: str, percent: int, tool: str, *, both_ways: bool = True) -> str:
        """Lose `percent`% of the packets arriving at the host (and leaving it, `both_ways`).

        A drop in the host's own output path is no loss: the kernel tells the sending TCP at
        once (EPERM) and it sends the segment again with its next write, with no
        retransmission timeout (measured: no retransmits, no added latency). So the packets
        the host sends are dropped as they enter the bridge (a rule in the bridge's
        namespace), and those it receives as they arrive (a rule in its own namespace): every
        sender sees real loss. iptables (without nft) can only drop the arriving packets.
        Returns a description of what was done.
        """
        host = self.hosts[name]
        match = f"numgen random mod 100 < {percent} drop"
        if tool == "nft":
            self.nft(
                host.ns,
                "table inet imloss {\n"
                "  chain in { type filter hook prerouting priority -300; policy accept;\n"
                f'    iifname "eth0" {match}\n'
                "  }\n"
                "}\n",
            )
            if not both_ways:
                return f"nft `{match}` on arrival in {name}"
            self.nft(
                self.switch,
                "table bridge imloss {\n"
                "  chain in { type filter hook prerouting priority -300; policy accept;\n"
                f'    iifname "{host.port_name}" {match}\n'
                "  }\n"
                "}\n",
            )
            return f"nft `{match}` on arrival in {name} and on {name}'s bridge port"
        if both_ways:
            raise LabError("iptables cannot drop what a host sends: that needs nft")
        args = ["-t", "raw", "-A", "PREROUTING", "-i", "eth0", "-m", "statistic"]
        args += ["--mode", "random", "--probability", f"{percent / 100:.2f}", "-j", "DROP"]
        _cmd(["ip", "netns", "exec", host.ns, "iptables", *args])
        return f"iptables {' '.join(args)} in {name}"

    def partition(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        """Drop every frame the bridge would forward between the two sets of hosts."""

        def ports(names: Iterable[str]) -> str:
            return ", ".join(f'"{self.hosts[n].port_name}"' for n in names)

        a, b = ports(side_a), ports(side_b)
        self.nft(
            self.switch,
            "table bridge impart {\n"
            "  chain cut { type filter hook forward priority 0; policy accept;\n"
            f"    iifname {{ {a} }} oifname {{ {b} }} drop\n"
            f"    iifname {{ {b} }} oifname {{ {a} }} drop\n"
            "  }\n"
            "}\n",
        )
        self._partitioned = True

    def heal(self) -> None:
        if self._partitioned:
            _cmd(["ip", "netns", "exec", self.switch, "nft", "delete", "table", "bridge", "impart"])
            self._partitioned = False

    def tcp_retransmits(self, name: str) -> int:
        """Segments TCP retransmitted in the host's namespace so far (/proc/net/snmp)."""
        text = _cmd(["ip", "netns", "exec", self.hosts[name].ns, "cat", "/proc/net/snmp"])
        rows = [line.split() for line in text.splitlines() if line.startswith("Tcp:")]
        header, values = rows[0], rows[1]
        return int(values[header.index("RetransSegs")])
