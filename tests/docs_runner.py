"""Runs one page's Python blocks as an asyncio REPL would: in order, in one namespace, with
`await` allowed at the top level, on irismesh's event loop.

    python tests/docs_runner.py BLOCKS.json

BLOCKS.json is a list of [page, line, code]. Each block is compiled with its page's name and
padded to its line, so a traceback points at the page. Exits 1 at the first block that raises.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import traceback
from typing import Any

import irismesh


async def run_blocks(blocks: list[tuple[str, int, str]]) -> int:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for page, line, code in blocks:
        try:
            compiled = compile(
                "\n" * (line - 1) + code,
                page,
                "exec",
                flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                dont_inherit=True,
            )
            result = eval(compiled, namespace)
            if inspect.iscoroutine(result):
                await result
        except BaseException:
            print(f"the block at {page}:{line} failed:", file=sys.stderr)
            traceback.print_exc()
            return 1
    return 0


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as file:
        blocks = [tuple(block) for block in json.load(file)]
    return irismesh.run(run_blocks(blocks))  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
