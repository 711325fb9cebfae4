"""SWIM membership over an in-memory datagram network: joins, crashes, leaves, loss,
reordering, stalls, partitions, and what a node without the mesh key can do (nothing)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from swimnet import SwimNet, SwimNode

from irismesh._core.gossip import encode_message, seal_datagram
from irismesh._core.records import MemberDown, MembershipConfig, MemberState, MemberSuspect
from irismesh.security.meshkey import MeshDatagramSealer

ALIVE, SUSPECT, DEAD, LEFT = MemberState


def cluster(net: SwimNet, n: int) -> list[SwimNode]:
    """n nodes, each joining through the first; converged."""
    first = net.add("n0")
    nodes = [first] + [net.add(f"n{i}", join=[first]) for i in range(1, n)]
    net.run_until(lambda: converged(nodes), limit=30)
    return nodes


def converged(nodes: list[SwimNode]) -> bool:
    ids = {n.node_id for n in nodes}
    return all(n.live_ids() == ids - {n.node_id} for n in nodes)


def deaths(nodes: list[SwimNode], victim: SwimNode | None = None) -> list[MemberDown]:
    return [
        e
        for n in nodes
        for _, e in n.log
        if isinstance(e, MemberDown)
        and e.reason == "dead"
        and (victim is None or e.record.node_id == victim.node_id)
    ]


def test_nodes_joining_through_one_seed_all_learn_each_other() -> None:
    net = SwimNet(seed=1)
    nodes = cluster(net, 12)
    assert converged(nodes)
    assert deaths(nodes) == []
    # Each knows each other's name, though most only ever heard of each other by gossip.
    for node in nodes:
        names = {m.record.node_id: m.record.name for m in node.membership.members()}
        assert names == {n.node_id: n.name for n in nodes if n is not node}


def test_a_crashed_node_is_declared_dead_by_every_other_within_seconds() -> None:
    net = SwimNet(seed=2)
    nodes = cluster(net, 10)
    victim = nodes[4]
    net.kill(victim)
    others = [n for n in nodes if n is not victim]
    took = net.run_until(lambda: all(n.state_of(victim) is DEAD for n in others), limit=10)
    assert took < 3.0
    assert {e.record.node_id for e in deaths(others)} == {victim.node_id}  # nobody else


def test_a_leave_is_known_by_every_node_at_once() -> None:
    net = SwimNet(seed=3)
    nodes = cluster(net, 8)
    leaver = nodes[2]
    net.leave(leaver)
    others = [n for n in nodes if n is not leaver]
    took = net.run_until(lambda: all(n.state_of(leaver) is LEFT for n in others), 1, step=0.005)
    assert took <= 0.01  # one datagram's delay: sent to every member directly
    assert deaths(others) == []


def test_a_stalled_node_is_suspected_refutes_and_is_never_declared_dead() -> None:
    net = SwimNet(seed=4)
    nodes = cluster(net, 10)
    stalled = nodes[3]
    net.pause(stalled)
    net.advance(3 * net.config.probe_interval)
    net.resume(stalled)
    net.advance(5.0)
    suspected = [e for n in nodes for _, e in n.log if isinstance(e, MemberSuspect) and e.suspect]
    assert suspected, "a node silent for three periods should be suspected"
    assert deaths(nodes) == []
    assert stalled.membership.stats["refutations"] >= 1
    assert stalled.membership.incarnation >= 1
    assert converged(nodes)


def test_a_healed_partition_brings_both_sides_back() -> None:
    net = SwimNet(seed=5)
    nodes = cluster(net, 10)
    left, right = nodes[:5], nodes[5:]
    net.partition(left, right)
    net.run_until(
        lambda: (
            all(n.state_of(m) is DEAD for n in left for m in right)
            and all(n.state_of(m) is DEAD for n in right for m in left)
        ),
        limit=20,
    )
    net.advance(2 * net.config.gossip_to_dead)  # long enough that gossip to the dead has stopped
    net.heal()
    net.run_until(
        lambda: all(n.state_of(m) is ALIVE for n in nodes for m in nodes if m is not n), limit=30
    )
    assert converged(nodes)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), loss=st.floats(0.0, 0.05))
def test_under_loss_and_reordering_no_live_node_is_ever_declared_dead(
    seed: int, loss: float
) -> None:
    # Delays of up to 20 ms reorder datagrams freely (a probe period is 200 ms).
    net = SwimNet(seed=seed, loss=loss, delay=(0.0001, 0.02))
    nodes = cluster(net, 8)
    net.advance(10.0)
    assert deaths(nodes) == []
    assert converged(nodes)
    victim = nodes[-1]
    net.kill(victim)
    others = nodes[:-1]
    net.run_until(lambda: all(n.state_of(victim) is DEAD for n in others), limit=10)
    assert {e.record.node_id for e in deaths(others)} == {victim.node_id}


def test_a_join_whose_first_datagrams_are_lost_is_retried() -> None:
    net = SwimNet(seed=12)
    nodes = cluster(net, 4)
    net.loss = 1.0
    late = net.add("late", join=[nodes[0]])
    net.advance(1.0)
    net.loss = 0.0
    net.run_until(lambda: converged([*nodes, late]), limit=10)
    assert late.membership.stats["joins_retried"] >= 1


def test_a_crash_and_a_join_at_once_both_spread() -> None:
    net = SwimNet(seed=6)
    nodes = cluster(net, 9)
    net.kill(nodes[1])
    late = net.add("late", join=[nodes[0]])
    live = [n for n in nodes if n is not nodes[1]] + [late]
    net.run_until(
        lambda: converged(live) and all(n.state_of(nodes[1]) is DEAD for n in live), limit=15
    )


def test_lifeguard_stretches_a_slow_nodes_own_timeouts() -> None:
    net = SwimNet(seed=7)
    nodes = cluster(net, 6)
    slow = nodes[0]
    for other in nodes[1:]:
        net.partition([slow], [other])  # it hears nobody: it must be the one at fault
    net.advance(2.0)
    assert slow.membership.health > 0


# ---------------------------------------------------------------------- the mesh key


def forged(
    net: SwimNet, secret: bytes, sender: bytes, message: list[object], counter: int = 1
) -> bytes:
    sealer = MeshDatagramSealer([secret], sender)
    return seal_datagram(sealer, sender, counter, b"\x91" + encode_message(message))


def test_without_the_mesh_key_nobody_can_be_made_suspect_dead_or_departed() -> None:
    net = SwimNet(seed=8)
    nodes = cluster(net, 5)
    target, victim = nodes[0], nodes[1]
    wrong = random.Random(1).randbytes(32)
    stranger = random.Random(2).randbytes(16)
    attacks: list[list[object]] = [
        [7, victim.node_id, 99, stranger],  # DEAD, by a stranger
        [7, victim.node_id, 99, victim.node_id],  # "it left"
        [6, victim.node_id, 99, stranger],  # SUSPECT
        [5, stranger, 1, "tcp://evil:1", "evil:1", b"", "evil", b"", b""],  # ALIVE: join as a peer
    ]
    for counter, attack in enumerate(attacks, 1):
        # Under the wrong key, and under the wrong key while claiming the victim's own id.
        for sender in (stranger, victim.node_id):
            target.membership.receive(
                "evil:1", forged(net, wrong, sender, attack, counter), net.now
            )
    assert target.membership.stats["dropped_bad_seal"] == 2 * len(attacks)
    assert target.state_of(victim) is ALIVE
    assert target.membership.get(stranger) is None
    assert target.membership.events == []


def test_a_replayed_datagram_is_dropped_and_changes_nothing() -> None:
    net = SwimNet(seed=9)
    nodes = cluster(net, 4)
    a, b = nodes[0], nodes[1]
    captured: list[tuple[str, bytes]] = []
    real_deliver = net._deliver

    def tap(source: str, target: str, data: bytes) -> None:
        if target == b.address:
            captured.append((source, data))
        real_deliver(source, target, data)

    net._deliver = tap  # type: ignore[method-assign]
    net.advance(1.0)
    net._deliver = real_deliver  # type: ignore[method-assign]
    assert captured
    before = b.membership.stats["dropped_replay"]
    for source, data in captured:
        b.membership.receive(source, data, net.now)
    assert b.membership.stats["dropped_replay"] - before == len(captured)
    assert a.membership.get(b.node_id) is not None


def test_member_records_carry_tags_and_changes_spread() -> None:
    net = SwimNet(seed=10)
    nodes = cluster(net, 6)
    nodes[2].membership.update(net.now, tags=b"\x01" * 8)
    net.run_until(
        lambda: all(
            n.membership.get(nodes[2].node_id).record.tags == b"\x01" * 8  # type: ignore[union-attr]
            for n in nodes
            if n is not nodes[2]
        ),
        limit=5,
    )


@pytest.mark.parametrize("size", [3, 30])
def test_cost_per_node_per_period_is_flat(size: int) -> None:
    net = SwimNet(seed=11)
    cluster(net, size)
    net.advance(5.0)  # dissemination of the joins is over
    sent = net.sent
    periods = 20
    net.advance(periods * net.config.probe_interval)
    per_node = (net.sent - sent) / size / periods
    # A ping and an ack per node per period, and now and then a push-pull: about 2.
    assert 1.5 <= per_node <= 3.0, per_node


def test_config_rejects_nonsense() -> None:
    from irismesh.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        MembershipConfig(probe_timeout=0.3, probe_interval=0.2)
    with pytest.raises(ConfigurationError):
        MembershipConfig(max_datagram=100)


def test_a_node_whose_own_loop_stalled_does_not_accuse_the_peer_it_was_probing() -> None:
    # Acks take 20-80 ms, so a stall often catches a probe unanswered; resume() ticks before
    # it reads what queued: the late tick judges the probe before its ack is read.
    net = SwimNet(seed=13, delay=(0.01, 0.04))
    nodes = cluster(net, 6)
    net.advance(2.0)
    for node in nodes:
        node.log.clear()
    for _ in range(20):  # stall one node mid-probe again and again
        net.advance(0.05)
        net.pause(nodes[0])
        net.advance(0.7)
        net.resume(nodes[0])
    suspected = [e for _, e in nodes[0].log if isinstance(e, MemberSuspect) and e.suspect]
    assert suspected == []
    assert nodes[0].membership.stats["probes_late"] > 0
    assert deaths(nodes) == []


def test_a_healed_partition_of_twenty_is_whole_within_a_second() -> None:
    """A node held dead that is heard from is told so at once, and a revival tells every other
    member held dead: the first datagram across the healed partition brings both sides back in
    a few round trips, not one reconnect interval per node."""
    for seed in range(4):
        net = SwimNet(seed=seed)
        nodes = cluster(net, 20)
        left, right = nodes[:10], nodes[10:]
        net.partition(left, right)

        def split(left: list[SwimNode] = left, right: list[SwimNode] = right) -> bool:
            return all(n.state_of(m) is DEAD for n in left for m in right) and all(
                n.state_of(m) is DEAD for n in right for m in left
            )

        net.run_until(split, limit=30)
        net.advance(2 * net.config.gossip_to_dead)
        net.heal()
        healed = net.now
        net.run_until(lambda nodes=nodes: converged(nodes), limit=30)
        assert net.now - healed < 1.0, (seed, net.now - healed)
        assert sum(n.membership.stats["deaths_told"] for n in nodes) > 0


def test_members_held_dead_cost_little_to_keep_trying() -> None:
    net = SwimNet(seed=14)
    nodes = cluster(net, 30)
    for victim in nodes[-3:]:
        net.kill(victim)
    live = nodes[:-3]
    net.run_until(lambda: all(n.state_of(v) is DEAD for n in live for v in nodes[-3:]), limit=10)
    net.advance(5.0)  # the deaths have spread
    sent = net.sent
    net.advance(10.0)
    per_node_period = (net.sent - sent) / len(live) / (10.0 / net.config.probe_interval)
    # A probe, an ack, and now and then a one-datagram notice to a member held dead.
    assert per_node_period < 2.6, per_node_period
    assert all(n.membership.stats["reconnects"] > 0 for n in live)


def test_a_barred_node_leaves_every_table_for_good_until_unbarred() -> None:
    """A node barred everywhere (its key revoked) is a death it cannot refute: it is told,
    refutes, and its refutations are dropped and counted however high its incarnation; unbarred,
    its next record takes it back."""
    net = SwimNet(seed=9)
    nodes = cluster(net, 6)
    barred = nodes[3]
    others = [n for n in nodes if n is not barred]
    for each in others:
        each.membership.bar(barred.node_id, net.now)
        net._after(each)  # its datagrams out, as a driver would
    net.run_until(lambda: barred.membership.stats["refutations"] >= 1, limit=5)
    net.advance(10.0)
    for each in others:
        assert barred.node_id not in each.live_ids()
        assert each.membership.get(barred.node_id) is None
    assert sum(n.membership.stats["dropped_revoked_alive"] for n in others) >= 1
    assert {e.record.node_id for e in deaths(others)} == {barred.node_id}
    for each in others:
        each.membership.unbar(barred.node_id)
    barred.membership.update(net.now, tags=b"again")  # a newer record, as a relink brings
    net._after(barred)
    net.run_until(lambda: converged(nodes), limit=10)
