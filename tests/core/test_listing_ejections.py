"""`mesh peers` shows who keeps a peer out of rotation across the mesh: "ejected by N callers
(C, ...)" in its state column beside this node's own "ejected from C", and `ejected_by` in
its JSON (cluster -> the callers' ids; {} for a peer nobody ejects)."""

from __future__ import annotations

from rich.console import Console

import irismesh
from irismesh._cli.listing import ejected_by_text, peer_json, peers_table


def peer(node_id: str, ejected: tuple[str, ...] = ()) -> irismesh.PeerInfo:
    return irismesh.PeerInfo(
        node_id=node_id,
        endpoint=f"tcp://127.0.0.1:{7000 + len(node_id)}",
        rtt_ms=0.2,
        latency_ms=0.3,
        outstanding=0,
        ejected=ejected,
    )


def text(table: object) -> str:
    console = Console(width=220, record=True)
    console.print(table)
    return console.export_text()


def test_the_table_and_the_json_say_how_many_callers_eject_a_peer_and_from_what() -> None:
    bad, worse, fine = peer("aa" * 16), peer("bb" * 16, ejected=("db",)), peer("cc" * 16)
    ejected_by = {
        bad.node_id: {"db": ("01" * 16,)},
        worse.node_id: {"cache": ("02" * 16,), "db": ("01" * 16, "02" * 16, "03" * 16)},
    }
    out = text(peers_table([bad, worse, fine], {}, ejected_by))
    rows = {
        p.node_id[:12]: line
        for p in (bad, worse, fine)
        for line in out.splitlines()
        if p.node_id[:12] in line
    }
    assert "alive ejected by 1 caller (db)" in rows[bad.node_id[:12]]
    # Three distinct callers in all, of two clusters; this node's own ejection comes first.
    assert "alive ejected from db ejected by 3 callers (cache, db)" in rows[worse.node_id[:12]]
    assert "ejected" not in rows[fine.node_id[:12]]
    assert peer_json(bad, ["db"], ejected_by)["ejected_by"] == {"db": ["01" * 16]}
    assert peer_json(worse, ["db"], ejected_by)["ejected_by"] == {
        "cache": ["02" * 16],
        "db": ["01" * 16, "02" * 16, "03" * 16],
    }
    assert peer_json(fine, ["db"], ejected_by)["ejected_by"] == {}
    assert peer_json(fine, ["db"])["ejected_by"] == {}  # `mesh top`'s call, as before


def test_nobody_ejecting_says_nothing() -> None:
    assert ejected_by_text({}) == ""
    assert ejected_by_text({"db": ()}) == ""
