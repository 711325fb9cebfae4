"""A news feed with a memory: a reader that logs in late sees the latest of every story at once,
then the updates as they come, nothing missed and nothing twice.

    python examples/news_feed.py                 # 2 memory members, 50 stories, 5 versions each
    python examples/news_feed.py --stories 500 --json

One process, four nodes on 127.0.0.1 and a keyring made on the spot: two memory members (each
with its database in a temporary directory), a newsroom that publishes every version of every
story with `retain=True` (each held by both memory members before it goes out), and a reader
that subscribes to `news.#` with `reread=True` only after the newsroom has published the first
versions. The reader gets each story's latest version from the memory first, then the newer
versions live while the newsroom goes on publishing; it checks that every story's versions
arrive in order from the one it reread, with none missing and none twice, and prints what it
saw (or a JSON object). The exit status is 1 if anything was missed or repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import irismesh


async def main(stories: int, versions: int) -> dict[str, object]:
    keys = irismesh.Keyring.generate()
    with tempfile.TemporaryDirectory(prefix="irismesh-news-") as tmp:
        first = irismesh.Node(keyring=keys, memory=Path(tmp) / "m1", name="memory-1")
        async with first:
            second = irismesh.Node(
                keyring=keys, memory=Path(tmp) / "m2", seeds=[first.endpoint], name="memory-2"
            )
            newsroom = irismesh.Node(keyring=keys, seeds=[first.endpoint], name="newsroom")
            reader = irismesh.Node(keyring=keys, seeds=[first.endpoint], name="reader")
            async with second, newsroom, reader:
                await newsroom.wait_for_members("_memory", 2, timeout=10)
                await reader.wait_for_members("_memory", 2, timeout=10)
                started = time.perf_counter()
                for version in range(1, versions):  # all but the last, before the reader
                    for story in range(stories):
                        text = f"story {story} version {version}".encode()
                        await newsroom.publish(f"news.story{story}", text, retain=True)
                published = time.perf_counter() - started

                seen: dict[str, list[int]] = {}
                reread = 0

                def read(message: irismesh.Message) -> None:
                    nonlocal reread
                    reread += message.publisher == ""  # from the memory, not live
                    seen.setdefault(message.topic, []).append(int(message.payload.split()[-1]))

                logged_in = time.perf_counter()
                feed = reader.subscribe("news.#", callback=read, reread=True)
                for story in range(stories):  # the last versions, while the reader starts
                    text = f"story {story} version {versions}".encode()
                    await newsroom.publish(f"news.story{story}", text, retain=True)
                deadline = time.monotonic() + 30
                while any(seen.get(f"news.story{s}", [0])[-1] != versions for s in range(stories)):
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                caught_up = time.perf_counter() - logged_in
                feed.close()
    broken = {
        topic: got
        for topic, got in seen.items()
        if got != list(range(got[0], versions + 1)) or got[0] < versions - 1
    }
    missing = stories - len(seen)
    return {
        "stories": stories,
        "versions": versions,
        "publish_seconds": round(published, 3),
        "reread": reread,
        "live": sum(len(v) for v in seen.values()) - reread,
        "duplicates_dropped": feed.duplicates,
        "caught_up_seconds": round(caught_up, 3),
        "missing_stories": missing,
        "broken": broken,
        "ok": not broken and not missing,
    }


def report(result: dict[str, object]) -> str:
    lines = [
        f"newsroom: {result['stories']} stories x {result['versions'] - 1} versions "  # type: ignore[operator]
        f"retained in {result['publish_seconds']} s (each held by 2 memory members)",
        f"reader logged in: {result['reread']} latest versions from the memory, then "
        f"{result['live']} live ({result['duplicates_dropped']} second copies dropped); "
        f"every story current after {result['caught_up_seconds']} s",
    ]
    if result["ok"]:
        lines.append("every story's versions in order from the one reread: none missed, none twice")
    else:
        lines.append(f"PROBLEM: missing {result['missing_stories']}, broken {result['broken']}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stories", type=int, default=50)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    outcome = irismesh.run(main(args.stories, args.versions))
    print(json.dumps(outcome) if args.json else report(outcome))
    sys.exit(0 if outcome["ok"] else 1)
