"""A small replicated key/value service: three replicas, and a blocking client.

    python examples/kv_cluster.py                 # 3 replicas, 20 keys set and read back
    python examples/kv_cluster.py --keys 100 --json

Each replica is a process (this file with `--replica NAME`) serving two clusters: "kv", which
any replica may answer, and "kv.NAME", which only it serves. A SET goes to "kv"; the replica
that takes it stores the value and replicates it by requesting "kv.OTHER" of every other
replica before it answers, so once a SET returns, a GET sent to "kv" finds the value at
whichever replica the mesh picks. A GET of a missing key raises KeyError in the replica; the
client gets it as a typed RemoteError.

The replicas use the asyncio API (`irismesh.Node`); the client uses the blocking one
(`irismesh.sync.Node`): the same calls without `await`, for code that does not run asyncio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import irismesh
from irismesh import sync

REPLICAS = ["r1", "r2", "r3"]


async def run_replica(name: str, seeds: list[str]) -> None:
    store: dict[bytes, bytes] = {}
    keys = irismesh.Keyring.from_env()  # IRISMESH_KEYFILE, set by the client below
    async with irismesh.Node(
        "kv", clusters=[f"kv.{name}"], keyring=keys, seeds=seeds, name=name
    ) as node:

        @node.on_request
        async def handle(payload: bytes) -> bytes:
            verb, _, rest = payload.partition(b" ")
            key, _, value = rest.partition(b" ")
            if verb == b"GET":
                if key not in store:  # raised here, it reaches the client as RemoteError
                    raise KeyError(key.decode())
                return name.encode() + b" " + store[key]
            if verb == b"PUT":  # a copy from the replica that took the SET
                store[key] = value
                return b"OK"
            if verb == b"SET":
                store[key] = value
                others = [f"kv.{r}" for r in REPLICAS if r != name]
                for cluster in others:  # the other replicas may still be linking up
                    await node.wait_for_members(cluster, timeout=5)
                copy = b"PUT " + key + b" " + value
                await asyncio.gather(*(node.request(c, copy, timeout=5) for c in others))
                return b"OK"
            raise ValueError(f"unknown verb {verb!r}: use SET, GET")

        print("READY", node.endpoint, flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()


def start_replica(name: str, seeds: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--replica", name] + [f"--seed={s}" for s in seeds]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def endpoint_of(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    word, _, endpoint = proc.stdout.readline().strip().partition(" ")
    if word != "READY":
        raise RuntimeError("a replica did not start")
    return endpoint


def run_client(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="irismesh-kv-"))
    keyfile = workdir / "mesh.keys"
    keys = irismesh.Keyring.generate()  # one default key '*' for every cluster
    keys.save(keyfile)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    env.pop("IRISMESH_KEYS", None)
    procs = [start_replica(REPLICAS[0], [], env)]
    try:
        first = endpoint_of(procs[0])
        procs += [start_replica(name, [first], env) for name in REPLICAS[1:]]
        for proc in procs[1:]:
            endpoint_of(proc)
        with sync.Node(keyring=keys, seeds=[first], name="client") as client:
            client.wait_for_members("kv", len(REPLICAS), timeout=10)
            say(args, f"{len(REPLICAS)} replicas up; setting {args.keys} keys")
            for i in range(args.keys):
                assert client.request("kv", b"SET k%d v%d" % (i, i), timeout=5) == b"OK"
            served: Counter[str] = Counter()
            wrong = 0
            for i in range(args.keys):  # each GET may land on any replica: all hold every key
                replica, _, value = client.request("kv", b"GET k%d" % i, timeout=5).partition(b" ")
                served[replica.decode()] += 1
                wrong += value != b"v%d" % i
            try:
                client.request("kv", b"GET missing", timeout=5)
                missing, wrong = "no error", wrong + 1
            except irismesh.RemoteError as exc:
                missing = f"{exc.remote_type}: {exc.remote_message}"
        result = {
            "keys": args.keys,
            "wrong": wrong,
            "gets_served_by": dict(sorted(served.items())),
            "missing_key": missing,
        }
        if args.json:
            print(json.dumps(result))
        else:
            say(args, f"read {args.keys} keys back, {wrong} wrong")
            for replica, count in sorted(served.items()):
                say(args, f"  {replica} served {count} GETs")
            say(args, f"GET of a missing key raised RemoteError ({missing})")
        return 1 if wrong else 0
    finally:
        for proc in procs:
            proc.terminate()  # a replica closes cleanly: it says goodbye to its peers
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        keyfile.unlink()
        workdir.rmdir()


def say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=20, help="how many keys to set and get")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    parser.add_argument("--seed", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        irismesh.run(run_replica(args.replica, args.seed))
        return 0
    return run_client(args)


if __name__ == "__main__":
    sys.exit(main())
