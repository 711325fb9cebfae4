"""Plain classes that behave as the dataclasses they stand for: a record's repr, `==` and hash.

On Python 3.11 a dataclass costs its module's import about 0.45 ms: its `__init__`, repr, `==`
and hash are generated as source text and compiled, class by class, and compiled by mypyc its
`__init__` stays interpreted. The core's thirty-odd records, events and link tables are plain
classes instead: each declares its fields (annotations in the class body, in order) and writes
its own `__init__` (native code once compiled), and one of these bases gives it what
`@dataclass` would have:

- `Plain`: a dataclass's repr, `Name(a=1, b='x')`; `==` and hash by identity (`eq=False`).
- `Value`: also `==` by type and fields, and no hash (a mutable dataclass).
- `Frozen`: also a hash over the fields (a frozen dataclass). Its fields are `Final`: read-only
  compiled, and mypy keeps the source from writing them (from source they could be written).

A class's fields are found once, when first needed: compiled, mypyc lists a native class's
attributes in declaration order (`__mypyc_attrs__`, what its pickling reads); from source,
the class's annotations but its `ClassVar`s. The repr, `==` and hash are not on any hot path;
a class compared or hashed often gives its own `_values`.
"""

from __future__ import annotations

import inspect
from typing import Final

# Each class's fields, in order: found on first use (`_fields_of`).
_FIELDS: Final[dict[type, tuple[str, ...]]] = {}


def _fields_of(cls: type) -> tuple[str, ...]:
    fields = _FIELDS.get(cls)
    if fields is None:
        native = cls.__dict__.get("__mypyc_attrs__")
        if native is not None:
            fields = tuple(native)
        else:
            notes: dict[str, object] = {}
            for klass in reversed(cls.__mro__):  # a subclass's fields follow its bases'
                notes.update(inspect.get_annotations(klass))
            fields = tuple(name for name, note in notes.items() if "ClassVar" not in str(note))
        _FIELDS[cls] = fields
    return fields


class Plain:
    """A record's repr from its fields; identity for `==` and hash."""

    __slots__ = ()

    def __repr__(self) -> str:
        items = [f"{name}={getattr(self, name)!r}" for name in _fields_of(type(self))]
        return f"{type(self).__qualname__}({', '.join(items)})"

    def _values(self) -> tuple[object, ...]:
        """What `==` and the hash compare: every field, in order."""
        return tuple([getattr(self, name) for name in _fields_of(type(self))])


class Value(Plain):
    """A record equal to another of its very type with equal fields; unhashable (mutable)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self) or not isinstance(other, Value):
            return NotImplemented
        return self._values() == other._values()


class Frozen(Value):
    """An immutable record: `==` and a hash by its fields."""

    __slots__ = ()

    def __hash__(self) -> int:
        return hash(self._values())
