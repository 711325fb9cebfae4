"""Rereading a keyring file (security.rotation.KeyringFile): when a change is taken, and how a
bad file is refused (one logged line, the keys in use kept)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from irismesh.errors import ConfigurationError
from irismesh.security.keyring import Keyring
from irismesh.security.rotation import KeyringFile


@pytest.fixture
def keyfile(tmp_path: Path) -> tuple[Path, Keyring]:
    path = tmp_path / "mesh.keys"
    keyring = Keyring.generate(["*"])
    keyring.save(path)
    return path, Keyring.load(path)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_load_remembers_the_file_and_derived_keyrings_do_not(keyfile: tuple[Path, Keyring]) -> None:
    path, keyring = keyfile
    assert keyring.path == str(path)
    assert keyring.with_key("db").path is None
    assert Keyring.from_text(keyring.to_text()).path is None
    assert Keyring.from_text(keyring.to_text()) == keyring  # the path is not part of equality


def test_an_unchanged_file_gives_nothing(keyfile: tuple[Path, Keyring]) -> None:
    path, keyring = keyfile
    watch = KeyringFile(str(path), keyring)
    assert [watch.poll() for _ in range(3)] == [None, None, None]


def test_a_change_is_taken_once_the_file_stays_the_same_for_one_poll(
    keyfile: tuple[Path, Keyring],
) -> None:
    path, keyring = keyfile
    watch = KeyringFile(str(path), keyring)
    rotated = keyring.with_key("*", primary=False)
    rotated.save(path, overwrite=True)
    assert watch.poll() is None  # it may still be being written
    assert watch.poll() == rotated
    assert watch.keyring == rotated
    assert watch.poll() is None  # taken once


def test_a_file_still_changing_is_not_read_until_it_settles(keyfile: tuple[Path, Keyring]) -> None:
    path, keyring = keyfile
    watch = KeyringFile(str(path), keyring)
    final = keyring.with_key("*", primary=False)
    text = final.to_text()
    with open(path, "w") as file:  # written in place, in two pieces, a poll between them
        file.write(text[: len(text) // 2])
        file.flush()
        assert watch.poll() is None
        file.write(text[len(text) // 2 :])
    assert watch.poll() is None  # changed again since the last poll
    assert watch.poll() == final
    assert watch.refused == 0  # the half-written file was never read


def test_reload_reads_at_once(keyfile: tuple[Path, Keyring]) -> None:
    path, keyring = keyfile
    watch = KeyringFile(str(path), keyring)
    rotated = keyring.with_key("*", primary=True)
    rotated.save(path, overwrite=True)
    assert watch.reload() == rotated
    assert watch.poll() is None
    assert watch.reload() is None  # nothing new


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: os.chmod(p, 0o644), "chmod 600"),
        (lambda p: p.write_text("# irismesh keyring v1\n"), "no keys"),
        (lambda p: p.write_text("# irismesh keyring v1\n*   q2x"), "not valid base64"),
        (lambda p: p.write_text("<html>\n"), "is this a keyring?"),
        (lambda p: p.unlink(), "not found"),
    ],
    ids=["permissions", "truncated", "cut-mid-key", "not-a-keyring", "deleted"],
)
def test_a_bad_file_is_refused_with_one_line_and_the_keys_are_kept(
    keyfile: tuple[Path, Keyring],
    caplog: pytest.LogCaptureFixture,
    damage: object,
    message: str,
) -> None:
    path, keyring = keyfile
    watch = KeyringFile(str(path), keyring)
    assert callable(damage)
    damage(path)
    assert [watch.poll() for _ in range(5)] == [None] * 5
    [line] = _warnings(caplog)  # once, however often it is polled
    assert str(path) in line
    assert message in line
    assert f"keeping keys *:{next(iter(keyring)).key_id}" in line
    assert "\n" not in line
    assert watch.keyring == keyring
    # Fixed, it is taken.
    fixed = keyring.with_key("*", primary=False)
    if path.exists():
        path.unlink()
    fixed.save(path)
    assert watch.poll() is None
    assert watch.poll() == fixed


def test_keys_the_node_cannot_use_are_refused(
    keyfile: tuple[Path, Keyring], caplog: pytest.LogCaptureFixture
) -> None:
    path, _ = keyfile
    keyring = Keyring.generate(["db"])
    keyring.save(path, overwrite=True)

    def check(new: Keyring) -> None:
        if new.primary("db") is None:
            raise ConfigurationError("no key for cluster 'db', which this node serves")

    watch = KeyringFile(str(path), Keyring.load(path), check=check)
    Keyring.generate(["cache"]).save(path, overwrite=True)
    assert watch.poll() is None
    assert watch.poll() is None
    [line] = _warnings(caplog)
    assert "no key for cluster 'db'" in line


def test_a_touched_file_with_the_same_keys_changes_nothing(
    keyfile: tuple[Path, Keyring], caplog: pytest.LogCaptureFixture
) -> None:
    path, keyring = keyfile
    watch = KeyringFile(str(path), keyring)
    os.utime(path, ns=(1, 1))
    assert [watch.poll() for _ in range(3)] == [None, None, None]
    assert _warnings(caplog) == []
    assert watch.refused == 0
