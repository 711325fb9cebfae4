"""Shared by the pure-core tests.

The suite runs with --import-mode=importlib, which puts no test directory on sys.path; this
directory goes there so its tests can `from memnet import ...` (the in-memory network).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
