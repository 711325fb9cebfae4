"""The CLI reference page, made from `mesh`'s parser when the site is built, names every
command, subcommand and flag the parser has (docs/hooks/reference.py)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from irismesh.cli import parser

HOOK = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "reference.py"


def load_hook():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commands(
    command: argparse.ArgumentParser, title: str = "mesh"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(title, command)]
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.extend(commands(sub, f"{title} {name}"))
    return found


def test_the_page_has_every_command_and_flag() -> None:
    page = load_hook().cli_reference()
    assert page.startswith("# CLI reference\n")
    every = commands(parser())
    assert len(every) >= 20
    missing = [title for title, _command in every[1:] if f"`{title}`" not in page]
    assert missing == []
    flags = {flag for _t, c in every for a in c._actions for flag in a.option_strings}
    flags -= {"-h", "--help"}
    assert sorted(flag for flag in flags if f"`{flag}" not in page) == []
