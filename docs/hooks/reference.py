"""MkDocs hooks: the pages made from the code at build time, so that they cannot drift from it.

Theory of operation
-------------------
`on_startup` (and `on_config`, for each rebuild) copies the sources into a tree shaped like
the installed package (`build/docs-api/irismesh`, with `patterns/`, `discovery/`, `security/`
and `spark_telemetry/` moved under it as setuptools' package-dir mapping installs them), so
that mkdocstrings reads the API reference from the sources whatever way the package was
installed. (Copies, not
links: the reader follows a link to the file's real place and looks for submodules there.)

`on_files` adds `reference/cli.md`, written from `mesh`'s own argparse parser: every command
and subcommand, its description, usage, arguments with their help, and the examples its
`--help` shows. A flag added to the parser is on the page at the next build.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
API_TREE = ROOT / "build" / "docs-api"
MAPPED = ("patterns", "discovery", "security", "spark_telemetry")
CLI_PAGE = "reference/cli.md"


def on_startup(command: str, dirty: bool) -> None:
    # Before any plugin's on_config: mkdocstrings fixes its search paths there, and a path
    # that does not exist yet (a fresh checkout) is dropped, leaving the installed package.
    _lay_out_api_tree()


def on_config(config: Any) -> Any:
    _lay_out_api_tree()  # again for each rebuild of `mkdocs serve`: the sources may have changed
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    return files


def _lay_out_api_tree() -> None:
    package = API_TREE / "irismesh"
    shutil.rmtree(API_TREE, ignore_errors=True)
    sources = shutil.ignore_patterns("*.so", "*.pyc", "__pycache__", "*.md")
    shutil.copytree(ROOT / "irismesh", package, ignore=sources)
    for name in MAPPED:
        shutil.copytree(ROOT / name, package / name, ignore=sources)


# ----------------------------------------------------------------- the CLI reference


def cli_reference() -> str:
    from irismesh.cli import parser

    root = parser()
    out = [
        "# CLI reference",
        "",
        "Generated from `mesh`'s own parser when the site is built; `mesh COMMAND --help` "
        "prints the same. Every command that talks to the mesh runs a node of its own and "
        "takes the joining options described in "
        "[Operations](../operations.md#joining-from-the-cli).",
        "",
        "```text",
        _usage(root),
        "```",
        "",
        _paragraphs(root.description or ""),
        "",
        _options_table(root),
        "",
    ]
    for name, command in _subcommands(root):
        out.extend(_command(f"mesh {name}", command, level=2))
    return "\n".join(out).rstrip() + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: dict[int, tuple[str, argparse.ArgumentParser]] = {}
            for name, sub in action.choices.items():
                seen.setdefault(id(sub), (name, sub))  # aliases point to the same parser
            return list(seen.values())
    return []


def _command(title: str, parser: argparse.ArgumentParser, *, level: int) -> list[str]:
    description = (parser.description or "").split("\n\n", 1)
    out = [
        f"{'#' * level} `{title}`",
        "",
        _paragraphs(description[0]),
        "",
        "```text",
        _usage(parser),
        "```",
        "",
    ]
    if len(description) > 1:
        out.extend([_paragraphs(description[1]), ""])
    table = _options_table(parser)
    if table:
        out.extend([table, ""])
    epilog = parser.epilog or ""
    if epilog.startswith("examples:\n"):
        lines = [line.strip() for line in epilog.removeprefix("examples:\n").splitlines()]
        out.extend(["Examples:", "", "```bash", *[line for line in lines if line], "```", ""])
    for name, sub in _subcommands(parser):
        out.extend(_command(f"{title} {name}", sub, level=level + 1))
    return out


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage lines without argparse's `usage: ` and the indent it leaves under it."""
    prefix = "usage: "
    lines = parser.format_usage().rstrip().splitlines()
    return "\n".join(line.removeprefix(prefix).removeprefix(" " * len(prefix)) for line in lines)


def _options_table(parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = (
                formatter._format_args(action, action.dest.upper()) if action.nargs != 0 else ""
            )
            spelled = [f"{flag} {metavar}" if metavar else flag for flag in action.option_strings]
            name = ", ".join(f"`{flag}`" for flag in spelled)
        else:
            name = f"`{formatter._metavar_formatter(action, action.dest.upper())(1)[0]}`"
        text = formatter._expand_help(action) if action.help else ""
        if action.choices is not None and not action.option_strings:
            text = f"{text} (one of: {', '.join(map(str, action.choices))})".strip()
        rows.append(f"| {_cell(name)} | {_cell(text)} |")
    if not rows:
        return ""
    return "\n".join(["| argument | what |", "| --- | --- |", *rows])


def _cell(text: str) -> str:
    return _plain(" ".join(text.split())).replace("|", "\\|")


def _paragraphs(text: str) -> str:
    """argparse's hand-wrapped text as Markdown paragraphs: lines joined, blank lines kept."""
    blocks = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(
        _plain(" ".join(line.strip() for line in block.splitlines())) for block in blocks
    )


_SPECIAL = re.compile(r"([\\*_\[\]])")


def _plain(text: str) -> str:
    """Help text shown as written: Markdown's emphasis, links and HTML escaped outside its
    `code` spans (`'*'` is a key's scope, `<node>` a placeholder)."""
    parts = text.split("`")
    for number in range(0, len(parts), 2):  # the even parts are outside code spans
        escaped = _SPECIAL.sub(r"\\\1", parts[number])
        parts[number] = escaped.replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)
