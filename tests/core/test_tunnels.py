"""Tunnels in the core: open, accept, credit, ordering, resets and deaths, over memory links."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memnet import MemNet, MemNode

from irismesh._core.config import CoreConfig
from irismesh._core.events import TunnelArrived, TunnelFrame
from irismesh._core.frames import TunnelOp
from irismesh.errors import NoResponders, TunnelError

OPEN, ACCEPT, DATA = int(TunnelOp.OPEN), int(TunnelOp.ACCEPT), int(TunnelOp.DATA)
CREDIT, FIN, RESET = int(TunnelOp.CREDIT), int(TunnelOp.FIN), int(TunnelOp.RESET)


def setup(seed: int = 0, **net_options: object) -> tuple[MemNet, MemNode, MemNode]:
    net = MemNet(seed=seed, **net_options)  # type: ignore[arg-type]
    member = net.add("member", clusters=["db"])
    caller = net.add("caller", seeds=[member])
    net.advance(0.5)
    return net, member, caller


def frames(node: MemNode, handle: int) -> list[TunnelFrame]:
    return [e for e in node.events(TunnelFrame) if e.handle == handle]


def flush(net: MemNet, *nodes: MemNode) -> None:
    for node in nodes:
        net.collect(node)
    net.settle()
    net.run(net.now + net.max_delay)


def open_accepted(
    net: MemNet, member: MemNode, caller: MemNode, window: int = 1000
) -> tuple[int, int]:
    handle = caller.core.open_tunnel("db", window)
    flush(net, caller)
    [arrived] = member.events(TunnelArrived)[-1:]
    assert (arrived.cluster, arrived.peer) == ("db", caller.node_id)
    member.core.tunnel_accept(arrived.handle, window)
    flush(net, member)
    assert [(f.op, f.arg) for f in frames(caller, handle)] == [(ACCEPT, window)]
    return handle, arrived.handle


def test_open_accept_data_credit_and_fin_flow_both_ways() -> None:
    net, member, caller = setup()
    mine, theirs = open_accepted(net, member, caller, window=100)
    assert caller.core.tunnel_credit(mine) == 100
    assert member.core.tunnel_credit(theirs) == 100
    caller.core.tunnel_send(mine, DATA, 1, b"hel")
    caller.core.tunnel_send(mine, DATA, 0, b"lo")
    with pytest.raises(TunnelError):
        caller.core.tunnel_send(mine, DATA, 0, b"x" * 96)  # beyond the credit left
    caller.core.tunnel_send(mine, FIN)
    flush(net, caller)
    got = [(f.op, f.arg, f.data) for f in frames(member, theirs)]
    assert got == [(DATA, 1, b"hel"), (DATA, 0, b"lo"), (FIN, 0, b"")]
    member.core.tunnel_send(theirs, CREDIT, 5)
    member.core.tunnel_send(theirs, DATA, 0, b"reply")
    flush(net, member)
    assert caller.core.tunnel_credit(mine) == 100
    assert [(f.op, f.data) for f in frames(caller, mine)][1:] == [(CREDIT, b""), (DATA, b"reply")]


def test_a_peer_that_ignores_the_window_gets_its_tunnel_reset() -> None:
    net, member, caller = setup(seed=1)
    mine, theirs = open_accepted(net, member, caller, window=10)
    end = caller.core.tunnels.ends[mine]
    end.send_credit = 1000  # a caller that lies to itself about its credit
    caller.core.tunnel_send(mine, DATA, 0, b"x" * 11)
    flush(net, caller)
    assert member.core.stats["dropped_tunnel_over_credit"] == 1
    assert frames(member, theirs)[-1].op == RESET
    assert frames(caller, mine)[-1].op == RESET  # told, and forgotten on both sides
    assert member.core.tunnel_count == caller.core.tunnel_count == 0


def test_the_member_s_death_resets_the_caller_s_tunnel_with_a_reason() -> None:
    net, member, caller = setup(seed=2)
    mine, _theirs = open_accepted(net, member, caller)
    net.kill(member)
    net.advance(2.0)  # heartbeats fall silent
    [reset] = [f for f in frames(caller, mine) if f.op == RESET]
    assert b"member" in reset.data
    assert b"is gone" in reset.data
    assert caller.core.tunnel_count == 0
    with pytest.raises(TunnelError):
        caller.core.tunnel_send(mine, DATA, 0, b"x")


def test_the_caller_s_departure_resets_the_member_s_end() -> None:
    net, member, caller = setup(seed=3)
    _mine, theirs = open_accepted(net, member, caller)
    caller.core.close()
    flush(net, caller)
    net.advance(0.5)
    assert [f.op for f in frames(member, theirs)][-1] == RESET
    assert member.core.tunnel_count == 0


def test_no_member_no_tunnel_and_the_member_limit_refuses() -> None:
    net, member, caller = setup(seed=4, config=CoreConfig(max_tunnels=1))
    with pytest.raises(NoResponders):
        caller.core.open_tunnel("nobody-serves-this", 100)
    open_accepted(net, member, caller)
    with pytest.raises(TunnelError):  # the caller's own limit
        caller.core.open_tunnel("db", 100)
    other = net.add("other", seeds=[member])
    net.advance(0.5)
    refused = other.core.open_tunnel("db", 100)
    flush(net, other)
    [reset] = frames(other, refused)
    assert (reset.op, reset.data) == (RESET, b"too many tunnels at the member")
    assert member.core.stats["tunnels_refused"] == 1


@settings(max_examples=40, deadline=None)
@given(
    messages=st.lists(st.binary(max_size=300), min_size=1, max_size=20),
    chunk=st.integers(1, 64),
    window=st.integers(1, 200),
    steps=st.lists(st.sampled_from(["send", "read", "run"]), min_size=50, max_size=400),
    seed=st.integers(0, 2**16),
)
def test_messages_arrive_whole_and_in_order_whatever_the_chunks_and_the_window(
    messages: list[bytes], chunk: int, window: int, steps: list[str], seed: int
) -> None:
    net, member, caller = setup(seed=seed, max_delay=0.005)
    mine, theirs = open_accepted(net, member, caller, window=window)
    pending = [bytearray(m) for m in messages]
    ends = [False] * len(messages)
    received: list[bytes] = []
    partial = bytearray()
    seen = 0
    unread = 0  # bytes arrived at the member, not yet granted back
    for step in [*steps, *["send", "read", "run"] * 2000]:
        if step == "send" and pending:
            credit = caller.core.tunnel_credit(mine)
            head = pending[0]
            size = min(chunk, len(head), credit)
            if size or not head:  # an empty message needs no credit
                more = 1 if size < len(head) else 0
                caller.core.tunnel_send(mine, DATA, more, bytes(head[:size]))
                del head[:size]
                if not more:
                    pending.pop(0)
                net.collect(caller)
        elif step == "read":
            arrived = frames(member, theirs)[seen:]
            seen += len(arrived)
            for frame in arrived:
                assert frame.op == DATA
                partial += frame.data
                unread += len(frame.data)
                if not frame.arg:
                    received.append(bytes(partial))
                    partial.clear()
            if unread:
                member.core.tunnel_send(theirs, CREDIT, unread)
                unread = 0
                net.collect(member)
        else:
            net.run(net.now + 0.002)
        # The caller never has more in flight than the member granted.
        assert caller.core.tunnel_credit(mine) >= 0
        if not pending and len(received) == len(messages):
            break
    assert received == messages
    assert member.core.stats["dropped_tunnel_over_credit"] == 0
    assert not ends[0] or True
