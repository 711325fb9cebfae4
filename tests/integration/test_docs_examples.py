"""Every example in the documentation runs: README.md and every page of docs/.

- A page's Python blocks run in order as one program, as a reader would run them in
  `python -m asyncio` (tests/docs_runner.py), in a process of its own whose working directory
  holds a fresh keyring `mesh.keys`. Its nodes discover each other as a reader's do (on
  127.0.0.1), and their keyring is the page's own, so no node of another test or program
  becomes their peer.
- Blocks with a title are the files a tutorial has its reader write; the tutorial's own test
  runs them (tests/e2e/test_tutorial.py), and no other page may have one.
- Every `mesh ...` line of a shell block parses with `mesh`'s own parser; TOML and YAML blocks
  parse.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from docs_blocks import ROOT, Block, all_blocks, blocks, pages

import irismesh
from irismesh.cli import parser

TUTORIALS = {"docs/getting-started.md"}
PAGE_TIMEOUT = 90.0


def python_pages() -> list[tuple[str, list[Block]]]:
    found = []
    for path in pages():
        code = [b for b in blocks(path) if b.lang == "python" and not b.title]
        if code:
            found.append((str(path.relative_to(ROOT)), code))
    return found


def test_the_documentation_has_examples() -> None:
    names = [name for name, _blocks in python_pages()]
    assert "README.md" in names
    assert "docs/patterns/request-reply.md" in names
    assert len(names) >= 10


def test_only_tutorials_have_files_to_write() -> None:
    titled = {b.page for b in all_blocks() if b.title}
    assert titled <= TUTORIALS


@pytest.mark.parametrize(
    ("page", "code"), [pytest.param(*page, id=page[0]) for page in python_pages()]
)
def test_the_examples_of_a_page_run(page: str, code: list[Block], tmp_path: Path) -> None:
    irismesh.Keyring.generate().save(tmp_path / "mesh.keys")
    program = tmp_path / "blocks.json"
    program.write_text(json.dumps([[str(ROOT / b.page), b.line, b.code] for b in code]))
    env = dict(os.environ, IRISMESH_DISCOVERY="1", XDG_CONFIG_HOME=str(tmp_path / "config"))
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "docs_runner.py"), str(program)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=PAGE_TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{page}: its examples did not finish in {PAGE_TIMEOUT} s\n{exc.stderr!r}")
    assert done.returncode == 0, f"{page}:\n{done.stdout}\n{done.stderr}"


def mesh_commands() -> list[tuple[str, list[str]]]:
    """Each `mesh ...` command of the shell blocks, as the arguments it passes."""
    found = []
    for block in all_blocks():
        if block.lang not in ("bash", "sh", "shell"):
            continue
        for line in block.code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in [*words, "|"]:
                if word in ("|", "&", "&&", ";", "||"):
                    if command[:1] == ["mesh"]:
                        found.append((f"{block.page}:{block.line}", command[1:]))
                    command = []
                else:
                    command.append(word.rstrip("&;") if word.endswith(("&", ";")) else word)
    return found


def test_the_documentation_shows_mesh_commands() -> None:
    assert len(mesh_commands()) >= 30


@pytest.mark.parametrize(
    ("where", "argv"),
    [pytest.param(*c, id=f"{c[0]} mesh {shlex.join(c[1])}") for c in mesh_commands()],
)
def test_each_mesh_command_shown_parses(where: str, argv: list[str]) -> None:
    try:
        parser().parse_args(argv)
    except SystemExit as exc:  # --help and --version exit 0; a usage error exits 2
        if exc.code != 0:
            pytest.fail(f"{where}: mesh {shlex.join(argv)} does not parse")


@pytest.mark.parametrize(
    "block",
    [b for b in all_blocks() if b.lang in ("toml", "yaml")],
    ids=lambda b: f"{b.page}:{b.line}",
)
def test_each_configuration_block_parses(block: Block) -> None:
    if block.lang == "toml":
        tomllib.loads(block.code)
    else:
        yaml = pytest.importorskip("yaml", reason="PyYAML comes with the docs extra")
        yaml.safe_load(block.code)


def test_the_readme_links_to_pages_that_exist() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert len(targets) >= 10
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert missing == []
