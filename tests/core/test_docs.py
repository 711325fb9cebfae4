"""The Python shown in the documentation is Python: every ```python block parses."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    path
    for pattern in ("*.md", "*/README.md")
    for path in ROOT.glob(pattern)
    if ".venv" not in path.parts
)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, int, str]]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            found.append((str(path.relative_to(ROOT)), line, match.group(1)))
    return found


def test_the_documents_show_python() -> None:
    assert any(name == "README.md" for name, _line, _code in blocks())


@pytest.mark.parametrize(("name", "line", "code"), blocks(), ids=lambda v: str(v)[:40])
def test_each_python_block_parses(name: str, line: int, code: str) -> None:
    try:
        ast.parse(code)
    except SyntaxError as exc:
        pytest.fail(f"{name}, the block at line {line}: {exc}")


@pytest.mark.parametrize(("name", "most"), [("README.md", 200), ("bench/README.md", 300)])
def test_the_readmes_stay_short(name: str, most: int) -> None:
    """The README is a short page into the site, and bench/'s says how to run each benchmark
    and its current figures: history belongs in the CHANGELOG."""
    lines = (ROOT / name).read_text(encoding="utf-8").count("\n")
    assert lines <= most, f"{name} has {lines} lines, at most {most} wanted"
