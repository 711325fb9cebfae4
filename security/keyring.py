"""The keyring: which 32-byte secret guards each cluster or topic.

A keyring maps scope names (cluster or topic names) to shared secrets. The scope ``*`` is the
default for every scope without keys of its own, so a one-key deployment is one line. A scope
may hold two keys at once so that a key can be rotated without downtime: the first listed is
its *primary* (used to send and to prove membership), and every listed key is *accepted*.
A scope with keys of its own never falls back to ``*``.

File format (UTF-8 text, written by ``mesh keygen`` or :meth:`Keyring.save`)::

    # irismesh keyring v1
    # <scope> <base64 of 32 bytes>; the first key listed for a scope is its primary
    *  q2x...=
    db 9Zk...=
    db Ab3...=

- The first non-empty line is exactly ``# irismesh keyring v1``; other lines starting with
  ``#`` and blank lines are comments. A key line is a scope and a key, nothing else.
- A scope is ``*``, ``@mesh`` (the mesh key: see :meth:`Keyring.mesh_keys`) or 1-200
  characters of ``A-Z a-z 0-9 _ . : -`` (``feeds.sport`` is one
  scope name; there are no wildcards other than the lone ``*``).
- A scope lists at most two keys, and never the same key twice.
- The file is private to its owner (``chmod 600``): :meth:`Keyring.load` refuses it otherwise.
- Trust in grants (`irismesh.security.grants`): ``@authority <base64 of a 32-byte Ed25519
  public key>`` names an authority whose grants and revocations this node trusts (any number
  of lines), and ``@require-grants`` makes the node require grants of its peers and itself.
  Without ``@require-grants`` grants are neither presented nor checked: the shared keys alone
  decide, as before grants.

Rotating the key of one scope, reloading every node between steps:

1. Add the new key *after* the old one on every node (``with_key(scope, primary=False)``, or a
   new line under the old key). Nodes still send with the old key and now accept both.
2. Once every node holds both, make the new key primary everywhere (move its line first, or
   ``without_key(new.key_id).with_key(scope, new.secret)``). Nodes not yet switched still
   accept what the switched ones send.
3. Once every node sends with the new key, retire the old one (``without_key(old.key_id)``).

Key ids are a short hash of the secret, safe to log and to compare across nodes. Secrets never
appear in a repr or an error message.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from irismesh.errors import ConfigurationError, NoKey

__all__ = ["AUTHORITY_LINE", "MESH_SCOPE", "REQUIRE_GRANTS_LINE", "Keyring", "ScopeKey"]

# The scope of the mesh key, which admits a node to membership (never a cluster or topic name).
MESH_SCOPE = "@mesh"

_HEADER = "# irismesh keyring v1"
AUTHORITY_LINE = "@authority"
REQUIRE_GRANTS_LINE = "@require-grants"
_FORMAT_HINT = "# <scope> <base64 of 32 bytes>; the first key listed for a scope is its primary"
_SECRET_BYTES = 32
# Old and new during a rotation; a third key means an old one was never retired.
_MAX_KEYS_PER_SCOPE = 2
_SCOPE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


def _key_id(secret: bytes) -> str:
    return hashlib.sha256(b"irismesh-key-id" + secret).hexdigest()[:8]


def _show(scope: str) -> str:
    """Quote a scope name for a one-line message, however long or strange it is."""
    return repr(scope) if len(scope) <= 40 else repr(scope[:40]) + "..."


def _check_scope(scope: str) -> None:
    if scope not in ("*", MESH_SCOPE) and not _SCOPE.fullmatch(scope):
        raise ConfigurationError(
            f"bad scope name {_show(scope)}: use '*', '{MESH_SCOPE}' or 1-200 of [A-Za-z0-9_.:-]"
        )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ScopeKey:
    """One secret for one scope; ``key_id`` is computed from the secret when omitted."""

    scope: str
    secret: bytes = field(repr=False)
    key_id: str = ""

    def __post_init__(self) -> None:
        _check_scope(self.scope)
        if len(self.secret) != _SECRET_BYTES:
            import shlex  # for the message alone

            hint = f"`mesh keygen --scope {shlex.quote(self.scope)}` makes one"
            raise ConfigurationError(
                f"key for {_show(self.scope)} is {len(self.secret)} bytes, not 32: {hint}"
            )
        # A bytearray passed in could be changed behind the frozen dataclass's back.
        object.__setattr__(self, "secret", bytes(self.secret))
        expected = _key_id(self.secret)
        if not self.key_id:
            object.__setattr__(self, "key_id", expected)
        elif self.key_id != expected:
            raise ConfigurationError(f"key id {self.key_id!r} is not its secret's: omit key_id")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ScopeKey):
            return NotImplemented
        return self.scope == other.scope and hmac.compare_digest(self.secret, other.secret)

    def __hash__(self) -> int:
        return hash((self.scope, self.key_id))


def _clash(placed: Sequence[ScopeKey], new: ScopeKey, name: Callable[[int], str]) -> str | None:
    """Why ``new`` cannot join ``placed`` (``name(i)`` says where ``placed[i]`` came from)."""
    same = [i for i, key in enumerate(placed) if key.scope == new.scope]
    for i in same:
        if hmac.compare_digest(placed[i].secret, new.secret):
            return f"key for {_show(new.scope)} repeats {name(i)}: delete one of them"
    if len(same) >= _MAX_KEYS_PER_SCOPE:
        after = ", ".join(name(i) for i in same)
        return f"third key for {_show(new.scope)} (after {after}): rotation allows two, retire one"
    return None


def _parse_key(scope: str, encoded: str) -> ScopeKey:
    _check_scope(scope)
    try:
        secret = base64.b64decode(encoded, validate=True)
    except ValueError:
        raise ConfigurationError(
            f"key for {_show(scope)} is not valid base64: copy it again"
        ) from None
    return ScopeKey(scope=scope, secret=secret)


def _check_private(name: str, mode: int, what: str = "keyring") -> None:
    # Windows has no mode bits worth reading; its ACLs are the operator's business.
    if os.name != "posix" or not mode & 0o077:
        return
    exposed = "readable by others" if mode & 0o044 else "open to others"
    import shlex  # for the message alone

    raise ConfigurationError(
        f"{what} {name} is {exposed} (mode {stat.S_IMODE(mode):04o}): "
        f"run chmod 600 {shlex.quote(name)}"
    )


def _read_private(name: str, *, what: str, maker: str, hint: str = "") -> str:
    """The text of file `name` (a `what`: keyring, identity), refusing one that is not a
    regular file or that group or others may access; `maker` makes a missing one, `hint`
    follows the complaint about a file that is not UTF-8. ConfigurationError if it cannot."""
    try:
        with open(name, "rb") as file:
            # fstat, not stat: the file checked is the file read.
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ConfigurationError(f"{what} {name} is not a regular file")
            _check_private(name, info.st_mode, what)
            data = file.read()
    except FileNotFoundError:
        raise ConfigurationError(f"{what} {name} not found: {maker} makes one") from None
    except OSError as exc:
        raise ConfigurationError(f"cannot read {what} {name}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigurationError(f"{what} {name} is not UTF-8 text{hint}") from None


def _write_private(
    name: str, data: bytes, *, what: str, overwrite: bool, mode: int = 0o600
) -> None:
    """Write `data` as a new file `name` (a `what`: keyring, identity), atomically; replace an
    existing one only if `overwrite`. The file is 0600 from its creation; `mode` is what it
    gets before it takes its name (0644 for a file that holds no secret). ConfigurationError
    if it cannot."""
    exists = f"{what} {name} already exists: pass overwrite=True to replace it"
    if not overwrite and os.path.lexists(name):
        raise ConfigurationError(exists)
    directory = os.path.dirname(os.path.abspath(name))
    import tempfile  # brings shutil and the compressors: imported only to write a file

    try:
        # mkstemp creates the file 0600 from the start: the secrets are never exposed.
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(name)}.")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            if mode != 0o600:
                os.chmod(tmp, mode)
            if overwrite:
                os.replace(tmp, name)
            else:
                _publish_new(tmp, name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except FileExistsError:
        raise ConfigurationError(exists) from None
    except OSError as exc:
        raise ConfigurationError(f"cannot write {what} {name}: {exc.strerror or exc}") from None
    _fsync_dir(directory)


def _publish_new(tmp: str, name: str) -> None:
    """Move ``tmp`` to ``name`` unless ``name`` exists (FileExistsError)."""
    try:
        # Unlike rename, link fails if a file appeared at `name` since the caller checked.
        os.link(tmp, name)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (FAT, some FUSE): a racy check is the best left
        if os.path.lexists(name):
            raise FileExistsError(name) from None
        os.rename(tmp, name)
        return
    os.unlink(tmp)


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable; best effort, since the file is complete either way.
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Keyring:
    """Scope names mapped to one or two secrets each, ``*`` being the default; immutable."""

    __slots__ = ("_by_scope", "_path", "authorities", "require_grants")

    def __init__(
        self,
        keys: Iterable[ScopeKey] = (),
        *,
        authorities: Iterable[bytes] = (),
        require_grants: bool = False,
    ) -> None:
        self._path: str | None = None
        # The authorities whose grants this node trusts (Ed25519 public keys), and whether it
        # requires grants (`irismesh.security.grants`).
        self.authorities: tuple[bytes, ...] = tuple(dict.fromkeys(authorities))
        for authority in self.authorities:
            if type(authority) is not bytes or len(authority) != 32:
                raise ConfigurationError("an authority is a 32-byte Ed25519 public key")
        self.require_grants = bool(require_grants)
        placed: list[ScopeKey] = []
        for key in keys:
            problem = _clash(placed, key, lambda i: f"key {placed[i].key_id}")
            if problem:
                raise ConfigurationError(problem)
            placed.append(key)
        by_scope: dict[str, list[ScopeKey]] = {}
        for key in placed:
            by_scope.setdefault(key.scope, []).append(key)
        self._by_scope = {scope: tuple(keys) for scope, keys in by_scope.items()}

    @classmethod
    def generate(
        cls, scopes: Iterable[str] = ("*",), *, randbytes: Callable[[int], bytes] = os.urandom
    ) -> Keyring:
        """A fresh keyring with one random key per scope."""
        names = [scopes] if isinstance(scopes, str) else list(scopes)
        if not names:
            raise ConfigurationError("no scopes to generate keys for: pass ['*'] for a default")
        for i, scope in enumerate(names):
            if scope in names[:i]:
                raise ConfigurationError(f"scope {_show(scope)} is listed twice: list it once")
        return cls(ScopeKey(scope=scope, secret=randbytes(_SECRET_BYTES)) for scope in names)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyring:
        """Read a keyring file, refusing one that group or others may access."""
        name = os.fspath(path)
        text = _read_private(name, what="keyring", maker="`mesh keygen`", hint=": is it a keyring?")
        keyring = cls.from_text(text, source=name)
        keyring._path = name
        return keyring

    @property
    def path(self) -> str | None:
        """The file this keyring was loaded from (a node rereads it when it changes), if any."""
        return self._path

    @classmethod
    def from_text(cls, text: str, *, source: str = "<text>") -> Keyring:
        """Parse the keyring format; ``source`` names the text in error messages."""
        placed: list[ScopeKey] = []
        line_of: list[int] = []
        authorities: list[bytes] = []
        require_grants = False
        header_seen = False
        # Split on "\n" only, so line numbers match what an editor shows.
        lines = text.removeprefix("\ufeff").split("\n")
        for number, raw in enumerate(lines, start=1):
            line = raw.strip()
            if not header_seen:
                if line and line != _HEADER:
                    msg = f"first line must be {_HEADER!r}: is this a keyring?"
                    raise ConfigurationError(f"{source}:{number}: {msg}")
                header_seen = bool(line)
                continue
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            if fields == [REQUIRE_GRANTS_LINE]:
                require_grants = True
                continue
            if fields[0] == AUTHORITY_LINE:
                try:
                    authority = base64.b64decode(
                        fields[1] if len(fields) == 2 else "", validate=True
                    )
                except ValueError:
                    authority = b""
                if len(authority) != 32:
                    msg = f"expected '{AUTHORITY_LINE} <base64 of a 32-byte public key>'"
                    raise ConfigurationError(f"{source}:{number}: {msg}")
                authorities.append(authority)
                continue
            if len(fields) != 2:
                msg = f"expected '<scope> <base64 key>', found {len(fields)} fields"
                raise ConfigurationError(f"{source}:{number}: {msg} (comments go on '#' lines)")
            try:
                key = _parse_key(fields[0], fields[1])
            except ConfigurationError as exc:
                raise ConfigurationError(f"{source}:{number}: {exc}") from None
            problem = _clash(placed, key, lambda i: f"line {line_of[i]}")
            if problem:
                raise ConfigurationError(f"{source}:{number}: {problem}")
            placed.append(key)
            line_of.append(number)
        if not placed:
            # Reported at the last line, where the keys were still missing.
            what = "no keys by the end of the file" if header_seen else f"no {_HEADER!r} header"
            raise ConfigurationError(
                f"{source}:{len(lines)}: {what}: `mesh keygen` makes a keyring"
            )
        return cls(placed, authorities=authorities, require_grants=require_grants)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Keyring | None:
        """The keyring in ``IRISMESH_KEYS`` (its text) or ``IRISMESH_KEYFILE`` (a path), if any.

        An empty variable counts as unset; setting both is an error.
        """
        env = os.environ if environ is None else environ
        text = env.get("IRISMESH_KEYS", "")
        path = env.get("IRISMESH_KEYFILE", "")
        if text and path:
            raise ConfigurationError("IRISMESH_KEYS and IRISMESH_KEYFILE are both set: unset one")
        if text:
            return cls.from_text(text, source="$IRISMESH_KEYS")
        if path:
            return cls.load(path)
        return None

    def to_text(self) -> str:
        """The file format, each scope's primary first; contains the secrets."""
        width = max(map(len, self._by_scope), default=1)
        lines = [_HEADER, _FORMAT_HINT]
        lines += [f"{key.scope:<{width}} {base64.b64encode(key.secret).decode()}" for key in self]
        lines += [f"{AUTHORITY_LINE} {base64.b64encode(a).decode()}" for a in self.authorities]
        if self.require_grants:
            lines.append(REQUIRE_GRANTS_LINE)
        return "\n".join(lines) + "\n"

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the keyring as a new 0600 file, atomically; replace one only if asked."""
        name = os.fspath(path)
        if not self._by_scope:
            raise ConfigurationError("refusing to save an empty keyring: add a key first")
        _write_private(name, self.to_text().encode(), what="keyring", overwrite=overwrite)

    def primary(self, scope: str) -> ScopeKey | None:
        """The key to send and prove with: the scope's own first key, else ``*``'s, else None."""
        keys = self.accepted(scope)
        return keys[0] if keys else None

    def accepted(self, scope: str) -> tuple[ScopeKey, ...]:
        """Every key valid for ``scope``: its own if it has any, else ``*``'s."""
        return self._by_scope.get(scope) or self._by_scope.get("*", ())

    def mesh_keys(self) -> tuple[ScopeKey, ...]:
        """The keys that admit a node to the mesh: ``@mesh``'s if it has any, else ``*``'s."""
        return self.accepted(MESH_SCOPE)

    def require(self, scope: str) -> ScopeKey:
        """Like :meth:`primary`, but raises :class:`NoKey` instead of returning None."""
        key = self.primary(scope)
        if key is None:
            raise NoKey(scope)
        return key

    def with_key(
        self,
        scope: str,
        secret: bytes | None = None,
        *,
        primary: bool = True,
        randbytes: Callable[[int], bytes] = os.urandom,
    ) -> Keyring:
        """A copy with one more key for ``scope`` (random unless given), first if ``primary``."""
        key = ScopeKey(scope=scope, secret=randbytes(_SECRET_BYTES) if secret is None else secret)
        own = self._by_scope.get(scope, ())
        problem = _clash(own, key, lambda i: f"key {own[i].key_id}")
        if problem:
            raise ConfigurationError(problem)
        by_scope = dict(self._by_scope)
        by_scope[scope] = (key, *own) if primary else (*own, key)
        return self._keeping_trust(key for keys in by_scope.values() for key in keys)

    def without_key(self, key_id: str, *, scope: str | None = None) -> Keyring:
        """A copy without the key ``key_id``; ``scope`` says which when scopes share a secret."""
        gone = [k for k in self if k.key_id == key_id and scope in (None, k.scope)]
        where = "" if scope is None else f" for {_show(scope)}"
        if not gone:
            known = ", ".join(f"{k.scope}:{k.key_id}" for k in self) or "none"
            raise ConfigurationError(f"no key {key_id!r}{where} in the keyring (it holds {known})")
        if len({k.scope for k in gone}) > 1:
            scopes = ", ".join(_show(k.scope) for k in gone)
            raise ConfigurationError(f"key {key_id} is in scopes {scopes}: pass scope= to choose")
        return self._keeping_trust(k for k in self if k not in gone)

    def _keeping_trust(self, keys: Iterable[ScopeKey]) -> Keyring:
        return Keyring(keys, authorities=self.authorities, require_grants=self.require_grants)

    def with_trust(
        self, authorities: Iterable[bytes] | None = None, *, require_grants: bool | None = None
    ) -> Keyring:
        """A copy trusting `authorities` (added to those trusted), requiring grants or not."""
        return Keyring(
            self,
            authorities=(*self.authorities, *(authorities or ())),
            require_grants=self.require_grants if require_grants is None else require_grants,
        )

    @property
    def scopes(self) -> tuple[str, ...]:
        """The scopes with keys of their own, ``*`` included, in file order."""
        return tuple(self._by_scope)

    def __len__(self) -> int:
        return sum(map(len, self._by_scope.values()))

    def __iter__(self) -> Iterator[ScopeKey]:
        for keys in self._by_scope.values():
            yield from keys

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Keyring):
            return NotImplemented
        # Order matters within a scope (the primary), not between scopes.
        return (
            self._by_scope == other._by_scope
            and set(self.authorities) == set(other.authorities)
            and self.require_grants == other.require_grants
        )

    def __hash__(self) -> int:
        return hash(frozenset((s, tuple(k.key_id for k in ks)) for s, ks in self._by_scope.items()))

    def __repr__(self) -> str:
        ids = {scope: tuple(k.key_id for k in keys) for scope, keys in self._by_scope.items()}
        return f"Keyring({ids!r})"
