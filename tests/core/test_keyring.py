"""The keyring: file format, permissions, default-key fallback and rotation."""

from __future__ import annotations

import base64
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from irismesh.errors import ConfigurationError, NoKey
from irismesh.security.keyring import Keyring, ScopeKey

HEADER = "# irismesh keyring v1\n"
posix_only = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX only")


def secret(n: int) -> bytes:
    return bytes([n]) * 32


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def counter_bytes() -> Callable[[int], bytes]:
    """A deterministic stand-in for os.urandom: 1*32, 2*32, ..."""
    calls = iter(range(1, 256))
    return lambda size: bytes([next(calls)]) * size


def test_generate_to_text_from_text_round_trip() -> None:
    ring = Keyring.generate(["*", "db", "feeds.sport"])
    assert ring.scopes == ("*", "db", "feeds.sport")
    assert len(ring) == 3
    assert Keyring.from_text(ring.to_text()) == ring


def test_generate_uses_the_given_randomness_and_computes_key_ids() -> None:
    ring = Keyring.generate(["db"], randbytes=counter_bytes())
    (key,) = ring
    assert key.secret == secret(1)
    assert re.fullmatch(r"[0-9a-f]{8}", key.key_id)
    assert key == ScopeKey(scope="db", secret=secret(1))


def test_save_load_round_trip_creates_a_0600_file(tmp_path: Path) -> None:
    ring = Keyring.generate(["*", "db"])
    path = tmp_path / "mesh.keys"
    ring.save(path)
    if os.name == "posix":
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Keyring.load(path) == ring
    assert [p.name for p in tmp_path.iterdir()] == ["mesh.keys"]  # no temp file left behind


def test_save_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "mesh.keys"
    first, second = Keyring.generate(), Keyring.generate()
    first.save(path)
    with pytest.raises(ConfigurationError, match=r"already exists.*overwrite=True"):
        second.save(path)
    assert Keyring.load(path) == first
    second.save(path, overwrite=True)
    assert Keyring.load(path) == second
    assert len(list(tmp_path.iterdir())) == 1


def test_save_refuses_an_empty_keyring(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="empty"):
        Keyring().save(tmp_path / "mesh.keys")


@posix_only
def test_load_refuses_a_file_others_can_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Keyring.generate().save("mesh.keys")
    os.chmod("mesh.keys", 0o644)
    message = "keyring mesh.keys is readable by others (mode 0644): run chmod 600 mesh.keys"
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        Keyring.load("mesh.keys")
    os.chmod("mesh.keys", 0o620)
    with pytest.raises(ConfigurationError, match=r"mode 0620.*chmod 600"):
        Keyring.load("mesh.keys")
    os.chmod("mesh.keys", 0o400)
    assert len(Keyring.load("mesh.keys")) == 1


def test_load_reports_missing_and_unusable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"nothere\.keys not found"):
        Keyring.load(tmp_path / "nothere.keys")
    with pytest.raises(ConfigurationError, match=r"cannot read keyring|not a regular file"):
        Keyring.load(tmp_path)
    binary = tmp_path / "binary.keys"
    binary.write_bytes(b"\xff\xfe\x00")
    binary.chmod(0o600)
    with pytest.raises(ConfigurationError, match="not UTF-8"):
        Keyring.load(binary)


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("", 1, "header"),
        ("\n\n", 3, "header"),
        ("* " + b64(secret(1)) + "\n", 1, "first line must be '# irismesh keyring v1'"),
        ("# irismesh keyring v2\n", 1, "first line must be"),
        (HEADER, 2, "no keys"),
        (HEADER + "# only comments\n\n", 4, "no keys"),
        (HEADER + "db\n", 2, "found 1 fields"),
        (HEADER + "db " + b64(secret(1)) + " # old\n", 2, "found 4 fields"),
        (HEADER + "feeds.* " + b64(secret(1)) + "\n", 2, "bad scope name 'feeds.*'"),
        (HEADER + "x" * 201 + " " + b64(secret(1)) + "\n", 2, "bad scope name"),
        (HEADER + "\n# c\ndb not*base64\n", 4, "not valid base64"),
        (HEADER + "db " + b64(secret(1))[:-1] + "\n", 2, "not valid base64"),
        (HEADER + "db " + b64(b"\x01" * 31) + "\n", 2, "31 bytes, not 32"),
        (HEADER + "db " + b64(b"\x01" * 33) + "\n", 2, "33 bytes, not 32"),
        (HEADER + f"db {b64(secret(1))}\n* {b64(secret(2))}\ndb {b64(secret(1))}\n", 4, "line 2"),
        (
            HEADER + "".join(f"db {b64(secret(n))}\n" for n in (1, 2, 3)),
            4,
            "third key for 'db' (after line 2, line 3): rotation allows two",
        ),
    ],
)
def test_every_file_problem_names_the_source_and_line(text: str, line: int, what: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Keyring.from_text(text, source="mesh.keys")
    message = str(caught.value)
    assert message.startswith(f"mesh.keys:{line}: ")
    assert what in message
    assert "\n" not in message


def test_comments_blank_lines_and_layout_are_free() -> None:
    text = (
        "\n  # irismesh keyring v1  \r\n# written by hand\r\n\r\n"
        f"\t*\t{b64(secret(1))}\r\n   db    {b64(secret(2))}   \r\n"
    )
    ring = Keyring.from_text(text)
    assert ring == Keyring(
        [ScopeKey(scope="*", secret=secret(1)), ScopeKey(scope="db", secret=secret(2))]
    )


def test_the_same_secret_may_serve_two_scopes() -> None:
    # Moving a scope off the default key starts with the default key copied under its name.
    ring = Keyring.from_text(HEADER + f"* {b64(secret(1))}\ndb {b64(secret(1))}\n")
    assert ring.primary("db") == ScopeKey(scope="db", secret=secret(1))
    shared = ring.require("db").key_id
    with pytest.raises(ConfigurationError, match="pass scope="):
        ring.without_key(shared)
    assert ring.without_key(shared, scope="db").scopes == ("*",)


def test_default_key_serves_scopes_without_their_own() -> None:
    ring = Keyring.from_text(HEADER + f"* {b64(secret(1))}\ndb {b64(secret(2))}\n")
    default, db = ring
    assert ring.primary("cache") is default
    assert ring.accepted("cache") == (default,)
    assert ring.require("feeds.sport") is default
    # A scope with keys of its own never falls back to the default.
    assert ring.primary("db") is db
    assert ring.accepted("db") == (db,)


def test_no_key_names_the_scope_when_there_is_no_default() -> None:
    ring = Keyring.from_text(HEADER + f"db {b64(secret(1))}\n")
    assert ring.primary("cache") is None
    assert ring.accepted("cache") == ()
    with pytest.raises(NoKey) as caught:
        ring.require("cache")
    assert caught.value.scope == "cache"
    assert "'cache'" in str(caught.value)
    assert isinstance(caught.value, ConfigurationError)


def test_rotation_add_switch_retire() -> None:
    old = Keyring.generate(["*", "db"], randbytes=counter_bytes())
    old_key = old.require("db")

    staged = old.with_key("db", secret(9), primary=False)  # 1: everyone accepts the new key
    new_key = ScopeKey(scope="db", secret=secret(9))
    assert staged.primary("db") == old_key
    assert staged.accepted("db") == (old_key, new_key)

    switched = staged.without_key(new_key.key_id).with_key("db", secret(9))  # 2: send with it
    assert switched.primary("db") == new_key
    assert switched.accepted("db") == (new_key, old_key)
    assert Keyring.from_text(switched.to_text()) == switched

    retired = switched.without_key(old_key.key_id)  # 3: the old key is gone
    assert retired.accepted("db") == (new_key,)
    assert retired.require("*") == old.require("*")
    assert len(retired) == 2


def test_with_key_puts_a_primary_key_first_and_keeps_scope_order() -> None:
    ring = Keyring.generate(["*", "db", "cache"]).with_key("db", randbytes=lambda n: b"\x07" * n)
    assert ring.scopes == ("*", "db", "cache")
    assert ring.require("db").secret == b"\x07" * 32
    assert len(ring.accepted("db")) == 2


def test_more_than_two_keys_for_a_scope_are_refused() -> None:
    ring = Keyring.generate(["db"]).with_key("db")
    with pytest.raises(ConfigurationError, match=r"third key for 'db'.*retire"):
        ring.with_key("db")
    with pytest.raises(ConfigurationError, match="third key"):
        Keyring([*ring, ScopeKey(scope="db", secret=secret(3))])


def test_duplicate_keys_and_unknown_key_ids_are_refused() -> None:
    ring = Keyring.generate(["db"], randbytes=counter_bytes())
    with pytest.raises(ConfigurationError, match="repeats"):
        ring.with_key("db", secret(1))
    with pytest.raises(ConfigurationError, match="no key '00000000'"):
        ring.without_key("00000000")


@pytest.mark.parametrize(
    "make",
    [
        lambda: ScopeKey(scope="db", secret=b"short"),
        lambda: ScopeKey(scope="a b", secret=secret(1)),
        lambda: ScopeKey(scope="db", secret=secret(1), key_id="deadbeef"),
        lambda: Keyring.generate([]),
        lambda: Keyring.generate(["db", "db"]),
        lambda: Keyring.generate(["#"]),
        lambda: Keyring().with_key("db", b"\x00" * 16),
    ],
)
def test_caller_misuse_is_a_configuration_error(make: Callable[[], object]) -> None:
    with pytest.raises(ConfigurationError):
        make()


def test_secrets_never_appear_in_repr_or_str() -> None:
    ring = Keyring.generate(["*", "db"]).with_key("db")
    shown = [repr(ring), str(ring), *(repr(k) for k in ring), *(str(k) for k in ring)]
    for key in ring:
        for text in shown:
            assert b64(key.secret) not in text
            assert repr(key.secret) not in text
            assert key.secret.hex() not in text
        assert key.key_id in repr(ring)
    assert "'db'" in repr(ring)


def test_from_env_reads_text_or_file_and_else_returns_none(tmp_path: Path) -> None:
    ring = Keyring.generate(["*", "db"])
    path = tmp_path / "mesh.keys"
    ring.save(path)
    assert Keyring.from_env({"IRISMESH_KEYS": ring.to_text()}) == ring
    assert Keyring.from_env({"IRISMESH_KEYFILE": str(path)}) == ring
    assert Keyring.from_env({}) is None
    assert Keyring.from_env({"IRISMESH_KEYS": "", "HOME": "/root"}) is None
    with pytest.raises(ConfigurationError, match=r"^\$IRISMESH_KEYS:1: "):
        Keyring.from_env({"IRISMESH_KEYS": "not a keyring"})
    with pytest.raises(ConfigurationError, match="both set"):
        Keyring.from_env({"IRISMESH_KEYS": ring.to_text(), "IRISMESH_KEYFILE": str(path)})


def test_keyrings_compare_by_keys_not_by_scope_order() -> None:
    a, b, c = (ScopeKey(scope=s, secret=secret(n)) for n, s in enumerate("xyx", start=1))
    assert Keyring([a, b, c]) == Keyring([b, a, c])
    assert hash(Keyring([a, b, c])) == hash(Keyring([b, a, c]))
    assert Keyring([a, b, c]) != Keyring([c, a, b])  # the primary of "x" differs
    assert Keyring([a]) != a


scope_names = st.one_of(
    st.just("*"), st.text(alphabet="abcXYZ019_.:-", min_size=1, max_size=12), st.just("s" * 200)
)
secrets_ = st.binary(min_size=32, max_size=32)


@given(
    st.dictionaries(
        scope_names, st.lists(secrets_, min_size=1, max_size=2, unique=True), min_size=1
    )
)
def test_any_valid_keyring_round_trips_through_text(keys: dict[str, list[bytes]]) -> None:
    ring = Keyring(ScopeKey(scope=s, secret=k) for s, ks in keys.items() for k in ks)
    again = Keyring.from_text(ring.to_text())
    assert again == ring
    assert list(again) == list(ring)
    for scope, secrets in keys.items():
        assert again.require(scope).secret == secrets[0]


text_pieces = st.sampled_from(
    [
        HEADER,
        "# irismesh keyring v1",
        "#",
        "\n",
        "\r\n",
        " ",
        "\t",
        "*",
        "db",
        "feeds.sport",
        b64(secret(1)),
        b64(secret(2)),
        b64(secret(3)),
        b64(b"\x00" * 31),
        "=",
        "\x00",
        "\u2028",
        "\ufeff",
        "é",
    ]
)


@given(st.one_of(st.text(), st.lists(st.one_of(text_pieces, st.text(max_size=3))).map("".join)))
def test_from_text_returns_a_keyring_or_raises_configuration_error(text: str) -> None:
    try:
        ring = Keyring.from_text(text, source="fuzz")
    except ConfigurationError as exc:
        message = str(exc)
        assert message.startswith("fuzz:")
        assert "\n" not in message
    else:
        assert len(ring) >= 1
        assert Keyring.from_text(ring.to_text()) == ring


def test_save_into_a_missing_directory_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot write keyring"):
        Keyring.generate().save(tmp_path / "missing" / "mesh.keys")


def test_the_mesh_key_is_its_own_scope_else_the_default_key() -> None:
    star_only = Keyring.generate()
    assert star_only.mesh_keys() == star_only.accepted("*")
    with_mesh = Keyring.generate(["*", "@mesh"])
    assert with_mesh.mesh_keys() == with_mesh.accepted("@mesh") != with_mesh.accepted("*")
    assert Keyring.generate(["db"]).mesh_keys() == ()  # an open mesh
    text = with_mesh.to_text()
    assert "@mesh " in text
    assert Keyring.from_text(text) == with_mesh
    with pytest.raises(ConfigurationError):
        Keyring.generate(["@other"])
