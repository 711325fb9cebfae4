"""A revocation crossing hosts: nodes in network namespaces of their own, under load.

Every node holds an identity and an authority's grant; the keyring requires grants. Two
clients (c and n5) load the members n1..n4; the authority revokes c's key and one member
applies it. Membership gossip carries it to every node: each applies it within two seconds,
drops c from its membership, each member closes c's links and refuses it, and the other
client's requests meanwhile never fail.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from netlab import Lab

import irismesh
from irismesh._core.rights import Rights
from irismesh.security.grants import Authority
from irismesh.security.identity import Identity

pytestmark = pytest.mark.netns

MEMBERS = ("n1", "n2", "n3", "n4")
CLIENTS = ("c", "n5")
EVERYONE = (*CLIENTS, *MEMBERS)
LOAD = {"workers": 8, "pause": 0.005, "timeout": 5.0}
Report = Callable[[str], None]


def grant_files(tmp_path: Path, authority: Authority) -> dict[str, list[str]]:
    """An identity and a grant for each host's node: members serve "work", clients call it."""
    extra: dict[str, list[str]] = {}
    for name in EVERYONE:
        identity = Identity.generate()
        identity.save(tmp_path / f"{name}.identity")
        rights = Rights(call=("work",)) if name in CLIENTS else Rights(serve=("work",))
        authority.grant(identity.public, rights).save(tmp_path / f"{name}.grant")
        extra[name] = [
            "--identity",
            str(tmp_path / f"{name}.identity"),
            "--grant",
            str(tmp_path / f"{name}.grant"),
        ]
    return extra


@pytest.mark.timeout(60)
def test_a_revocation_reaches_every_host_within_two_seconds(
    lab: Lab, keyfile: Path, tmp_path: Path, report: Report
) -> None:
    authority = Authority.generate()
    keys = irismesh.Keyring.load(keyfile).with_trust([authority.public], require_grants=True)
    keys.save(keyfile, overwrite=True)
    extra = grant_files(tmp_path, authority)
    lab.start(EVERYONE, clients=CLIENTS, delay=0.005, extra=extra)
    lab.wait_all({n: ([m for m in MEMBERS if m != n], []) for n in EVERYONE}, timeout=15)
    revoked_key = Identity.load(tmp_path / "c.identity").public
    client, other = lab.nodes["c"], lab.nodes["n5"]
    client.call("load_start", **LOAD)
    other.call("load_start", **LOAD)
    deadline = time.monotonic() + 10
    while client.call("load_progress")["replied"] < 200:
        assert time.monotonic() < deadline, "the client's load never got going"
        time.sleep(0.02)

    token = base64.b64encode(authority.revoke(revoked_key).token).decode()
    answer = lab.nodes["n1"].call("revoke", token=token)
    assert answer["applied"]
    revoked_at = float(answer["at"])
    applied: dict[str, float] = {}
    deadline = time.monotonic() + 5
    while len(applied) < len(EVERYONE) - 1 and time.monotonic() < deadline:
        for name in EVERYONE:
            if name == "c" or name in applied:
                continue
            stats = lab.nodes[name].call("stats")["stats"]
            if stats.get("revocations_applied", 0) >= 1:
                applied[name] = time.monotonic() - revoked_at
        time.sleep(0.01)
    report(
        "revocation of c applied after: "
        + ", ".join(f"{n} {applied[n] * 1000:.0f} ms" for n in sorted(applied))
    )
    assert set(applied) == {"n1", "n2", "n3", "n4", "n5"}, applied
    assert max(applied.values()) < 2.0, applied
    # Every other host dropped c from its membership, as a death c cannot refute.
    for name in EVERYONE:
        if name != "c":
            stats = lab.nodes[name].call("stats")["stats"]
            assert stats.get("members_revoked", 0) == 1, name

    refused_before = client.call("load_progress")["failed"]
    deadline = time.monotonic() + 5
    while client.call("load_progress")["failed"] < refused_before + 50:
        assert time.monotonic() < deadline, "the revoked client's requests still go through"
        time.sleep(0.02)
    # The members c was linked to closed its links (or refused its handshakes). A member c
    # had no link to may have nothing to close: c, told of its revocation, dials nobody.
    closed = {}
    for name in MEMBERS:
        stats = lab.nodes[name].call("stats")["stats"]
        closed[name] = stats.get("links_closed_grant", 0) + stats.get("dropped_revoked", 0)
    assert sum(closed.values()) >= 1, closed
    revoked = client.call("load_stop", timeout=10)
    result = other.call("load_stop", timeout=10)
    report(
        f"other client n5: {result['sent']} requests, {result['failed']} failed; revoked "
        f"client c: {revoked['replied']} replied before, {revoked['failed']} refused after"
    )
    assert result["failed"] == 0, result["failures"]
    assert result["replied"] == result["sent"], result
