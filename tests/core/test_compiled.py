"""The core runs compiled (mypyc) where it was built so, and as plain Python on request or when
its source changed since: never a mix of the two."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import irismesh._core as core
from irismesh._core import _stale

PROBE = (
    "import irismesh, irismesh._core as c, irismesh._core.calls as calls, "
    "irismesh._core.frames as frames, irismesh._driver as driver, irismesh._stream as stream; "
    "print(c.COMPILED, calls.__file__, frames.__file__, driver.__file__, stream.__file__)"
)


def _probe(**env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.split()


def test_irismesh_pure_runs_every_core_module_from_source() -> None:
    compiled, calls, frames, driver, stream = _probe(IRISMESH_PURE="1")
    assert compiled == "False"
    assert calls.endswith("calls.py")
    assert frames.endswith("frames.py")
    assert driver.endswith("_driver.py")  # compiled with the core: never with a pure one
    assert stream.endswith("_stream.py")


def test_a_compiled_core_is_used_whole() -> None:
    compiled, *files = _probe(IRISMESH_PURE="0")
    if compiled == "True":
        assert not any(file.endswith(".py") for file in files)
    else:  # built without a compiler, or edited since: all from source
        assert all(file.endswith(".py") for file in files)
    assert compiled == str(core.COMPILED) or "IRISMESH_PURE" in os.environ


def test_a_source_edited_after_compiling_is_stale(tmp_path: Path) -> None:
    extension = tmp_path / "calls.so"
    source = tmp_path / "calls.py"
    source.write_text("x = 1\n")
    extension.write_bytes(b"")
    compiled = {"calls": str(extension), "frames": str(tmp_path / "frames.so")}
    (tmp_path / "frames.so").write_bytes(b"")
    assert _stale(compiled, str(tmp_path)) == []  # compiled after (or with) its source
    later = time.time() + 10
    os.utime(source, (later, later))
    assert _stale(compiled, str(tmp_path)) == ["calls"]
