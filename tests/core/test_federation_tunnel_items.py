"""Tunnel items of the inter-mesh link: versioned, bounds-checked, refused with a reason."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from irismesh.errors import ProtocolError
from irismesh.federation.linkwire import (
    T_ACCEPT,
    T_CREDIT,
    T_DATA,
    T_FIN,
    T_MAX_CHUNK,
    T_OPEN,
    T_RESET,
    TUNNEL,
    TunnelItem,
    parse_tunnel_item,
)

GOOD = [
    TunnelItem(1, True, 1, T_OPEN, 1 << 20, b"db"),
    TunnelItem(1, False, 1, T_ACCEPT, 4096, b""),
    TunnelItem(1, True, 2, T_DATA, 1, b"x" * T_MAX_CHUNK),
    TunnelItem(1, False, 2, T_DATA, 0, b""),
    TunnelItem((1 << 63) - 1, True, 3, T_CREDIT, 1 << 30, b""),
    TunnelItem(9, False, 7, T_FIN, 0, b""),
    TunnelItem(9, True, 8, T_RESET, 0, b"the member is gone"),
    TunnelItem(9, False, 1, T_RESET, 0, b"no member"),  # a refusal answers OPEN
]


@pytest.mark.parametrize("item", GOOD)
def test_good_items_parse_back_through_msgpack(item: TunnelItem) -> None:
    wire = msgpack.unpackb(msgpack.packb(item.wire(), use_bin_type=True), raw=False)
    assert parse_tunnel_item(wire) == item


BAD = {
    "version": [TUNNEL, 2, 1, True, 1, T_OPEN, 1, b"db"],
    "version type": [TUNNEL, "1", 1, True, 1, T_OPEN, 1, b"db"],
    "short": [TUNNEL, 1, 1, True, 1, T_OPEN, 1],
    "long": [TUNNEL, 1, 1, True, 1, T_OPEN, 1, b"db", 0],
    "id 0": [TUNNEL, 1, 0, True, 1, T_OPEN, 1, b"db"],
    "id too big": [TUNNEL, 1, 1 << 63, True, 1, T_OPEN, 1, b"db"],
    "opener not bool": [TUNNEL, 1, 1, 1, 1, T_OPEN, 1, b"db"],
    "seq 0": [TUNNEL, 1, 1, True, 0, T_DATA, 0, b""],
    "op 0": [TUNNEL, 1, 1, True, 2, 0, 0, b""],
    "op 7": [TUNNEL, 1, 1, True, 2, 7, 0, b""],
    "open later": [TUNNEL, 1, 1, True, 2, T_OPEN, 1, b"db"],
    "open by acceptor": [TUNNEL, 1, 1, False, 1, T_OPEN, 1, b"db"],
    "opener's first not open": [TUNNEL, 1, 1, True, 1, T_DATA, 0, b""],
    "open without cluster": [TUNNEL, 1, 1, True, 1, T_OPEN, 1, b""],
    "open window 0": [TUNNEL, 1, 1, True, 1, T_OPEN, 0, b"db"],
    "grant too big": [TUNNEL, 1, 1, False, 2, T_CREDIT, (1 << 30) + 1, b""],
    "grant negative": [TUNNEL, 1, 1, False, 2, T_CREDIT, -5, b""],
    "chunk too big": [TUNNEL, 1, 1, True, 2, T_DATA, 0, b"x" * (T_MAX_CHUNK + 1)],
    "more flag 2": [TUNNEL, 1, 1, True, 2, T_DATA, 2, b"x"],
    "data not bytes": [TUNNEL, 1, 1, True, 2, T_DATA, 0, "x"],
    "fin with data": [TUNNEL, 1, 1, True, 2, T_FIN, 0, b"x"],
    "reason too long": [TUNNEL, 1, 1, True, 2, T_RESET, 0, b"x" * 1001],
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_items_are_refused_with_a_counter_name(name: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_tunnel_item(BAD[name])
    expected = "tunnel_version" if name.startswith("version") else "tunnel_malformed"
    assert caught.value.reason == expected


@given(
    st.lists(st.one_of(st.integers(), st.booleans(), st.binary(max_size=8), st.text()), max_size=9)
)
def test_any_list_parses_or_raises_protocol_error(fields: list[object]) -> None:
    try:
        item = parse_tunnel_item([TUNNEL, *fields])
    except ProtocolError:
        return
    assert parse_tunnel_item(item.wire()) == item
