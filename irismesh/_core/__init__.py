"""The pure core: frames, links, membership, pending requests, balancing.

Nothing here imports asyncio or zmq, reads a clock or draws randomness of its own: time and
random bytes are passed in. A test enforces it.

Installed from source where a C compiler is present, every module of the core, and the drivers
(irismesh._driver, irismesh._stream), is also compiled to a C extension by mypyc (see
setup.py), which Python imports in preference to the source. The source stays the truth: with
IRISMESH_PURE=1 in the environment, or when a source file is newer than its compiled module
(edited since the last install), the whole core and the drivers are imported from their Python
source instead, so compiled and pure modules never mix.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec, SourceFileLoader
from types import ModuleType
from typing import Final

_HERE: Final = os.path.dirname(os.path.abspath(__file__))


# The drivers (irismesh._driver, irismesh._stream) are compiled with the core, in one group:
# their compiled form calls the core's compiled classes natively, so they run with the compiled
# core or not at all.
_PARENT: Final = os.path.dirname(_HERE)
_DRIVERS: Final = ("_driver", "_stream", "_zmqdriver")


def _compiled_modules() -> dict[str, str]:
    """Each core module with a compiled form here: name -> its extension's path."""
    found: dict[str, str] = {}
    suffix = EXTENSION_SUFFIXES[0]
    for entry in os.listdir(_HERE):
        if entry.endswith(suffix):
            found[entry[: -len(suffix)]] = os.path.join(_HERE, entry)
    return found


def _compiled_drivers() -> dict[str, str]:
    """The drivers' compiled forms that there are: name -> its extension's path."""
    found: dict[str, str] = {}
    for name in _DRIVERS:
        path = os.path.join(_PARENT, name + EXTENSION_SUFFIXES[0])
        if os.path.exists(path):
            found[name] = path
    return found


def _stale(compiled: dict[str, str], folder: str = _HERE) -> list[str]:
    """Modules whose source changed after they were compiled (a second of slack: a wheel
    unpacks both in the same moment)."""
    stale = []
    for name, extension in compiled.items():
        source = os.path.join(folder, name + ".py")
        if os.path.exists(source) and os.path.getmtime(source) > os.path.getmtime(extension) + 1:
            stale.append(name)
    return stale


class _SourceFinder:
    """Imports `irismesh._core.*` from source even where a compiled module is present."""

    prefix = __name__ + "."

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.startswith("irismesh.") and fullname[len("irismesh.") :] in _DRIVERS:
            source = os.path.join(_PARENT, fullname[len("irismesh.") :] + ".py")
        elif not fullname.startswith(self.prefix) or "." in fullname[len(self.prefix) :]:
            return None
        else:
            source = os.path.join(_HERE, fullname[len(self.prefix) :] + ".py")
        if not os.path.exists(source):
            return None
        loader = SourceFileLoader(fullname, source)
        return importlib.util.spec_from_file_location(fullname, source, loader=loader)


def _choose() -> bool:
    compiled = _compiled_modules()
    driver = _compiled_drivers()
    if not compiled:
        if driver:  # a compiled driver cannot drive a pure core
            sys.meta_path.insert(0, _SourceFinder())
        return False
    if os.environ.get("IRISMESH_PURE", "") not in ("", "0"):
        sys.meta_path.insert(0, _SourceFinder())
        return False
    stale = _stale(compiled) + _stale(driver, _PARENT)
    if stale:
        logging.getLogger("irismesh").warning(
            "irismesh: the compiled core is older than its source (%s): running the pure"
            " Python core; reinstall (bash .ci/setup, or pip install -e .) to compile it again",
            ", ".join(sorted(stale)),
        )
        sys.meta_path.insert(0, _SourceFinder())
        return False
    return True


COMPILED: Final = _choose()
"""Whether this process runs the core compiled by mypyc."""
