"""A load test whose members are SIGKILLed fails at once, saying so, in bounded memory.

Its workers' requests then fail at once (NoResponders), and a loop retrying them used to keep
its event loop to itself and list every failure: the test's own timeout could not end it. The
load runs in a process of its own (tests/e2e/stalling_load.py), which reports its own peak
memory.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import irismesh

SCRIPT = Path(__file__).with_name("stalling_load.py")
STALL = 1.0  # seconds without a reply before the load says its members are gone
MAX_RSS_MB = 200


def test_a_load_whose_members_die_fails_within_its_timeout_saying_why(tmp_path: Path) -> None:
    keyfile = tmp_path / "mesh.keys"
    irismesh.Keyring.generate().save(keyfile)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(keyfile), str(STALL)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(90, proc.kill)  # whatever happens, it does not outlive the test
    timer.start()
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        assert proc.stdout.readline().strip() == "KILLED", proc.stderr.read()
        killed = time.monotonic()
        proc.wait()
        took = time.monotonic() - killed
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        timer.cancel()
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert "stalled" in err, err
    assert "members are gone" in err, err
    assert took < STALL + 10, f"the load failed {took:.1f} s after its members died"
    peak = [line.split() for line in out.splitlines() if line.startswith("PEAK_RSS_KB")]
    assert peak, out
    peak_mb = int(peak[-1][1]) / 1024
    assert peak_mb < MAX_RSS_MB, f"the load's process reached {peak_mb:.0f} MB"
