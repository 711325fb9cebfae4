"""The `mesh` config file: named contexts (a keyring, seeds, an interface), one of them current.

    # irismesh contexts (`mesh context` writes this file)
    current = "prod"

    [contexts.prod]
    keyring = "/etc/irismesh/prod.keys"
    seeds = ["tcp://10.0.0.5:7400", "tcp://10.0.0.6:7400"]
    interface = "10.0.0.5"

It lives at $IRISMESH_CONFIG, else config.toml in $XDG_CONFIG_HOME/irismesh (~/.config/
irismesh). Read with `tomllib`, written with `tomli_w`; a missing file is an empty config. A
relative keyring path is relative to the file's directory. Anything wrong is one
`ConfigurationError` naming the file and, where it can tell, the line.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from irismesh import _env
from irismesh.errors import ConfigurationError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_CONTEXT_KEYS = ("keyring", "seeds", "interface")
_HEADER = "# irismesh contexts (`mesh context` writes this file; comments are not kept)\n"
# tcp://HOST:PORT, as `--seed` takes it.
_SEED = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})")


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """Where one mesh is: its keyring, seeds to join through and the discovery interface."""

    name: str
    keyring: Path | None = None
    seeds: tuple[str, ...] = ()
    interface: str | None = None


@dataclass(slots=True, kw_only=True)
class Config:
    path: Path
    current: str | None = None
    contexts: dict[str, Context] = field(default_factory=dict)

    def get(self, name: str) -> Context:
        context = self.contexts.get(name)
        if context is None:
            known = ", ".join(sorted(self.contexts)) or "none yet: `mesh context add NAME`"
            raise ConfigurationError(f"no context {name!r} in {self.path} (contexts: {known})")
        return context

    def save(self) -> None:
        """Write the file atomically (a new file renamed over the old), mode 0600."""
        data: dict[str, Any] = {}
        if self.current is not None:
            data["current"] = self.current
        data["contexts"] = {
            c.name: _context_table(c) for c in sorted(self.contexts.values(), key=_by_name)
        }
        text = _HEADER + tomli_w.dumps(data)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".config-", suffix=".toml")
        try:
            with os.fdopen(fd, "w") as file:
                file.write(text)
            os.replace(temporary, self.path)
        except BaseException:
            os.unlink(temporary)
            raise


def _by_name(context: Context) -> str:
    return context.name


def _context_table(context: Context) -> dict[str, Any]:
    table: dict[str, Any] = {}
    if context.keyring is not None:
        table["keyring"] = str(context.keyring)
    if context.seeds:
        table["seeds"] = list(context.seeds)
    if context.interface is not None:
        table["interface"] = context.interface
    return table


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"bad context name {name!r}: 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_interface(text: str) -> str:
    """The IPv4 address of one interface (not 0.0.0.0, not multicast)."""
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:
        raise ConfigurationError(f"bad interface {text!r}: give its IPv4 address") from None
    if address.is_unspecified or address.is_multicast or address.is_reserved:
        raise ConfigurationError(f"bad interface {text}: the address of one interface, please")
    return text


def load(path: Path | None = None) -> Config:
    """The config file (a missing one is empty)."""
    path = _env.config_file() if path is None else path
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Config(path=path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read config file {path}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib says "... (at line 3, column 7)": put the place first, as compilers do.
        match = re.search(r"\(at line (\d+), column \d+\)$", str(exc))
        where = f"{path} line {match[1]}" if match else str(path)
        message = str(exc)[: match.start()].rstrip() if match else str(exc)
        raise ConfigurationError(f"{where}: {message} (not valid TOML)") from None
    return _parse(path, text, data)


def _parse(path: Path, text: str, data: dict[str, Any]) -> Config:
    lines = text.splitlines()

    def fail(message: str, key: str, context: str | None = None) -> ConfigurationError:
        line = _line_of(lines, key, context)
        where = f"{path} line {line}" if line else str(path)
        return ConfigurationError(f"{where}: {message}")

    for key in data:
        if key not in ("current", "contexts"):
            raise fail(f"unknown setting {key!r} (expected current, [contexts.NAME])", key)
    tables = data.get("contexts", {})
    if not isinstance(tables, dict):
        raise fail("'contexts' must be a table: [contexts.NAME]", "contexts")
    contexts: dict[str, Context] = {}
    for name, table in tables.items():
        if not _NAME.fullmatch(name):
            raise fail(f"bad context name {name!r}", name, name)
        if not isinstance(table, dict):
            raise fail(f"context {name!r} must be a table: [contexts.{name}]", name)
        for key in table:
            if key not in _CONTEXT_KEYS:
                raise fail(
                    f"context {name!r}: unknown setting {key!r} (expected keyring, seeds, "
                    "interface)",
                    key,
                    name,
                )
        keyring = table.get("keyring")
        if keyring is not None and (not isinstance(keyring, str) or not keyring):
            raise fail(f"context {name!r}: keyring must be a path in quotes", "keyring", name)
        seeds = table.get("seeds", [])
        if isinstance(seeds, str):
            seeds = [seeds]
        if not isinstance(seeds, list) or not all(
            isinstance(s, str) and _SEED.fullmatch(s) for s in seeds
        ):
            raise fail(
                f'context {name!r}: seeds must be a list of "tcp://HOST:PORT"', "seeds", name
            )
        interface = table.get("interface")
        if interface is not None:
            try:
                if not isinstance(interface, str):
                    raise ConfigurationError("interface must be an IPv4 address in quotes")
                check_interface(interface)
            except ConfigurationError as exc:
                raise fail(f"context {name!r}: {exc}", "interface", name) from None
        contexts[name] = Context(
            name=name,
            keyring=None if keyring is None else _resolve(path, keyring),
            seeds=tuple(seeds),
            interface=interface,
        )
    current = data.get("current")
    if current is not None and (not isinstance(current, str) or current not in contexts):
        raise fail(f"current = {current!r} names no context of this file", "current")
    return Config(path=path, current=current, contexts=contexts)


def _resolve(config_path: Path, keyring: str) -> Path:
    path = Path(keyring).expanduser()
    return path if path.is_absolute() else config_path.parent / path


def _line_of(lines: list[str], key: str, context: str | None) -> int | None:
    """The line (1-based) where `key` is set, within [contexts.<context>] if given; best effort."""
    start = 0
    if context is not None:
        header = re.compile(rf"\s*\[\s*contexts\s*\.\s*[\"']?{re.escape(context)}[\"']?\s*\]")
        found = next((i for i, line in enumerate(lines) if header.match(line)), None)
        if found is None:
            return None
        if key == context:
            return found + 1
        start = found + 1
    setting = re.compile(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=")
    for i in range(start, len(lines)):
        if context is not None and lines[i].lstrip().startswith("["):
            break
        if setting.match(lines[i]):
            return i + 1
    if context is None:  # a table header, e.g. [contexts]
        table = re.compile(rf"\s*\[\s*{re.escape(key)}\b")
        return next((i + 1 for i, line in enumerate(lines) if table.match(line)), None)
    return None
