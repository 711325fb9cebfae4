"""The code blocks of the documentation: README.md and every page of docs/.

A fenced block opens with three backticks, a language and, optionally, attributes
(`title="service.py"`), possibly indented inside a list; its code is dedented by the fence's
indent. Pages that show files for the reader to write give them a title; the other Python
blocks of a page make one program, run in order (tests/integration/test_docs_examples.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_OPEN = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)(?P<attrs>.*)$")
_TITLE = re.compile(r'title="(?P<title>[^"]+)"')


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    page: str  # relative to the repository's top
    line: int  # of the block's first line of code
    lang: str
    title: str
    code: str


def pages() -> list[Path]:
    """README.md and every Markdown page of the site."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(ROOT))
    number = 0
    while number < len(lines):
        opening = _OPEN.match(lines[number])
        number += 1
        if opening is None:
            continue
        indent = len(opening["indent"])
        start = number
        while number < len(lines) and lines[number].strip() != "```":
            number += 1
        body = [line[indent:] if line[:indent].isspace() else line for line in lines[start:number]]
        number += 1  # the closing fence
        title = _TITLE.search(opening["attrs"])
        found.append(
            Block(
                page=page,
                line=start + 1,
                lang=opening["lang"],
                title=title["title"] if title else "",
                code="\n".join(body) + "\n",
            )
        )
    return found


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]
