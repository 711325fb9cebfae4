"""Names a package gives on first access: the modules that define them load then.

A package's `__getattr__` (PEP 562) calls `attribute` for a name it does not have yet: one of
its `names` (name -> the module that defines it, and the name there), or one of its
submodules (`irismesh.federation` after `import irismesh`, as when the package imported it).
The value is kept in the package, so each name is looked up once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from typing import Any


def attribute(package: str, name: str, names: Mapping[str, tuple[str, str]]) -> Any:
    """`package`'s attribute `name`, importing what defines it; AttributeError if none does."""
    found = names.get(name)
    if found is not None:
        value = getattr(importlib.import_module(found[0]), found[1])
    elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
        value = importlib.import_module(f"{package}.{name}")
    else:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    setattr(sys.modules[package], name, value)
    return value
