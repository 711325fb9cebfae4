"""How irismesh's commands end their process."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def end_process(code: int) -> NoReturn:
    """End this process with `code`, once Python's exit handlers have run.

    A process that loaded pyarrow skips the interpreter's own teardown: a worker of pyarrow's
    thread pool still alive then (its work done) makes C++ abort the process at exit
    (std::terminate, SIGABRT), now and then on a busy machine, after a command that had
    succeeded. What the teardown would still do for such a command is what the exit handlers
    do (logging's flush, Spark's JVM stopped, temporary files removed) and flushing output."""
    if "pyarrow" not in sys.modules:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe or stream: nothing more to write there.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
