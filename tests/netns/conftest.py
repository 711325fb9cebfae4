"""Fixtures of the namespace tests: a lab per test, skipped unless root with `ip netns`.

Every figure a test measures goes through `report`: printed at once (seen with -s) and listed
again in a section of the terminal summary, so a plain `pytest tests/netns` shows them too.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netlab import Lab, built_lab, unavailable

HOSTS = ("c", "n1", "n2", "n3", "n4", "n5")  # c: a pure client; n1..n5: members of "work"

FIGURES: list[str] = []
_probe: dict[str, str | None] = {}


def _why_not() -> str | None:
    if "reason" not in _probe:
        _probe["reason"] = unavailable()
    return _probe["reason"]


@pytest.fixture
def lab(tmp_path: Path, keyfile: Path) -> Iterator[Lab]:
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
    with built_lab(HOSTS, tmp_path, keyfile) as built:
        yield built


@pytest.fixture
def nft() -> str:
    path = shutil.which("nft")
    if path is None:
        pytest.skip("`nft` is not installed (Debian: apt-get install -y nftables)")
    return path


@pytest.fixture
def loss_tool() -> str:
    for tool in ("nft", "iptables"):
        if shutil.which(tool):
            return tool
    pytest.skip("neither `nft` nor `iptables` is installed (apt-get install -y nftables)")


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    def add(line: str) -> None:
        text = f"{request.node.name}: {line}"
        FIGURES.append(text)
        print(text, flush=True)
        request.node.user_properties.append(("figure", line))

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("irismesh netns figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
