"""Hostile grant and revocation tokens: real tokens, their mutations, and a verdict.

`mutate` turns a token into a hostile one (bit flips, cuts, splices with another token,
random tails), every choice drawn from the `random.Random` it is given, so a seeded run
replays exactly. `verdict` decodes the result both ways (as a grant, as a revocation) and
says what happened: "refused" (GrantError both ways: the expected fate of any change) or
"intact" (it decoded, and only to the very token it came from). Anything else (another
exception, a token that decodes to something new) raises `Escaped`.

Used by tests/core/test_grants.py (a short seeded run) and bench/fuzz_grants.py (long runs).
"""

from __future__ import annotations

import random

from irismesh._core.rights import Rights
from irismesh.security.grants import Authority, Grant, GrantError, Revocation
from irismesh.security.identity import Identity


class Escaped(AssertionError):
    """A mutated token did something other than fail to decode or decode to its source."""


def sources(seed: int = 0) -> list[bytes]:
    """A grant with every kind of right and a revocation, by a fresh authority."""
    authority, node = Authority.generate(), Identity.generate()
    rights = Rights(
        serve=("db",),
        call=("db", "*"),
        publish=("feeds.#",),
        publish_deny=("feeds.admin.#",),
        subscribe=("feeds.*.x",),
        subscribe_deny=("#",),
        memory=True,
        gateway_export=("db",),
        gateway_import=("cache",),
    )
    issued = 1_800_000_000 + seed
    grant = authority.grant(node.public, rights, issued=issued)
    return [grant.token, authority.revoke(node.public, before=issued).token]


def mutate(tokens: list[bytes], rng: random.Random) -> bytes:
    pick = rng.randrange(len(tokens))
    token = bytearray(tokens[pick])
    how = rng.randrange(4)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            token[rng.randrange(len(token))] ^= 1 << rng.randrange(8)
    elif how == 1:
        del token[rng.randrange(len(token)) :]
    elif how == 2:
        other = tokens[(pick + 1) % len(tokens)]
        cut = rng.randrange(len(token))
        token = token[:cut] + other[cut:]
    else:
        token += rng.randbytes(rng.randint(1, 40))
    return bytes(token)


def verdict(data: bytes, tokens: list[bytes]) -> str:
    decoded = 0
    for decode in (Grant.decode, Revocation.decode):
        try:
            found = decode(data)
        except GrantError:
            continue
        except Exception as exc:  # anything but GrantError is a bug
            raise Escaped(f"{type(exc).__name__}: {exc} on {data.hex()}") from exc
        if found.token not in tokens:
            raise Escaped(f"decoded to a token never signed: {data.hex()}")
        decoded += 1
    return "intact" if decoded else "refused"
