"""What requiring grants adds to a link handshake: the check itself, and a new caller's first
reply end to end, with and without grants, alternated in one run.

    python bench/grants_cost.py [--rounds 30] [--checks 2000] [--json out.json]

1. The check: `NodeGrants.admit` of a peer's grant, the first time (an Ed25519 verification
   and a msgpack parse) and again (the verdict is remembered by token), in microseconds.
2. The handshake, end to end: a member of "db" runs; each round starts a fresh client node
   (a new identity, a new grant), seeds it with the member, and times from its start to its
   first reply (the node starting, a handshake each way through membership, one request).
   Rounds alternate with grants required and not; the medians and their difference are the
   handshake's added time, measured on a machine that may be busy (say what else ran).

Request/reply throughput with grants required is `bench/reqrep.py --only mesh,mesh-grants`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import irismesh
from irismesh._core.rights import Rights
from irismesh.security.grants import Authority, NodeGrants
from irismesh.security.identity import Identity


def check_cost(checks: int) -> dict[str, float]:
    authority = Authority.generate()
    me = Identity.generate()
    rights = Rights(call=("db", "cache"), subscribe=("feeds.#",), publish=("feeds.sport.#",))
    peers = [Identity.generate() for _ in range(checks)]
    tokens = [authority.grant(p.public, rights).token for p in peers]
    policy = NodeGrants(public=me.public, authorities=[authority.public], required=True)
    started = time.perf_counter()
    for peer, token in zip(peers, tokens, strict=True):
        policy.admit(peer.public, token)
    cold = (time.perf_counter() - started) / checks * 1e6
    started = time.perf_counter()
    for peer, token in zip(peers, tokens, strict=True):
        policy.admit(peer.public, token)
    warm = (time.perf_counter() - started) / checks * 1e6
    return {"admit_first_us": cold, "admit_again_us": warm, "token_bytes": len(tokens[0])}


async def first_reply(member: irismesh.Node, keys: irismesh.Keyring, grant: bool) -> float:
    identity = Identity.generate()
    given = None
    if grant:
        given = AUTHORITY.grant(identity.public, Rights(call=("db",)))
    started = time.perf_counter()
    async with irismesh.Node(
        keyring=keys, identity=identity, grant=given, seeds=[member.endpoint], discovery=False
    ) as client:
        await client.wait_for_members("db", timeout=10)
        await client.request("db", b"x", timeout=10)
        return (time.perf_counter() - started) * 1000


AUTHORITY = Authority.generate()


async def handshakes(rounds: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {"plain": [], "grants": []}
    plain = irismesh.Keyring.generate(["*"]).with_trust([AUTHORITY.public])
    required = plain.with_trust(require_grants=True)
    identity = Identity.generate()
    grant = AUTHORITY.grant(identity.public, Rights(serve=("db",)))
    # One member per mode: the same member could not both require grants and not.
    async with (
        irismesh.Node("db", keyring=plain, discovery=False) as plain_member,
        irismesh.Node(
            "db", keyring=required, identity=identity, grant=grant, discovery=False
        ) as granted_member,
    ):
        plain_member.on_request(lambda payload: payload)
        granted_member.on_request(lambda payload: payload)
        for _ in range(3):  # warm-up, not counted
            await first_reply(plain_member, plain, False)
            await first_reply(granted_member, required, True)
        for _ in range(rounds):
            found["plain"].append(await first_reply(plain_member, plain, False))
            found["grants"].append(await first_reply(granted_member, required, True))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--checks", type=int, default=2000)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    figures: dict[str, object] = dict(check_cost(args.checks))
    found = asyncio.run(handshakes(args.rounds))
    plain, grants = statistics.median(found["plain"]), statistics.median(found["grants"])
    figures.update(
        first_reply_ms_plain=plain,
        first_reply_ms_grants=grants,
        added_ms=grants - plain,
        rounds=args.rounds,
        load=os.getloadavg()[0],
    )
    print(
        f"grant check: {figures['admit_first_us']:.0f} us the first time, "
        f"{figures['admit_again_us']:.1f} us again (token {figures['token_bytes']} bytes)"
    )
    print(
        f"new caller to first reply, median of {args.rounds}: {plain:.2f} ms without grants, "
        f"{grants:.2f} ms with ({grants - plain:+.2f} ms); load average {figures['load']:.1f}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(figures, file, indent=2)


if __name__ == "__main__":
    main()
