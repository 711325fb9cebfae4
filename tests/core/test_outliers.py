"""Outlier ejection: a caller routes around a member that fails or lags far behind its
cluster, for a time that grows with repeated ejections, never taking out more than its share
of the cluster, and never for an Overloaded reply; over cores wired in memory, and the sweep's
judgments over links set up by hand."""

from __future__ import annotations

from collections import Counter

import pytest
from memnet import Handler, MemNet, MemNode, echo, mesh

from irismesh._core.config import CoreConfig
from irismesh._core.events import MemberEjected, MemberReadmitted, RequestArrived
from irismesh._core.frames import STATUS_OK, BodyCodec
from irismesh._core.links import LinkState, OutLink
from irismesh._core.outbox import Outbox
from irismesh._core.outliers import OutlierConfig, OutlierEjection
from irismesh.errors import ConfigurationError

FAST = OutlierConfig(base_ejection=1.0, max_ejection=4.0)


def fail(node: MemNode, event: RequestArrived) -> None:
    """A member whose handler raises on every request."""
    node.core.calls.reply_error(event.token, RuntimeError("broken"))


def served_by(net: MemNet, client: MemNode, requests: int) -> Counter[str]:
    """Send `requests` one at a time; the names of the members that answered, and "error"."""
    by_id = {node.node_id: name for name, node in net.nodes.items()}
    served: Counter[str] = Counter()
    for i in range(requests):
        req_id = net.request(client, "db", b"%d" % i)
        net.settle()
        [reply] = client.replies[req_id]
        served[by_id[reply.peer] if reply.status == STATUS_OK else "error"] += 1
    return served


def failing(names: set[str]) -> Handler:
    def handler(node: MemNode, event: RequestArrived) -> bytes | None:
        if node.name in names:
            fail(node, event)
            return None
        return echo(node, event)

    return handler


def test_the_defaults_are_sane() -> None:
    config = CoreConfig().outliers
    assert config.enabled
    assert 1 <= config.consecutive_errors <= 10  # out after a few failures, at any rate
    assert config.max_ejected_share == 0.5
    # A member that recovered is back within 30 s, whatever its past.
    assert 1.0 <= config.base_ejection <= config.max_ejection <= 30.0
    assert config.interval <= 1.0


@pytest.mark.parametrize(
    "bad",
    [
        {"consecutive_errors": 0},
        {"interval": 0.0},
        {"base_ejection": 10.0, "max_ejection": 5.0},
        {"max_ejected_share": 1.5},
        {"success_rate_gap": 0.0},
        {"latency_factor": 1.0},
    ],
)
def test_bad_settings_are_configuration_errors(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        OutlierConfig(**bad)  # type: ignore[arg-type]


def test_a_member_failing_every_request_is_ejected_at_once_and_readmitted_later() -> None:
    net = MemNet(seed=1, config=CoreConfig(outliers=FAST))
    nodes = mesh(net, {"a": ["db"], "b": ["db"], "c": ["db"]}, handler=failing({"c"}))
    client = nodes["client"]
    served = served_by(net, client, 200)
    assert served["error"] == FAST.consecutive_errors  # then it was out of rotation
    assert served["c"] == 0
    assert served["a"] + served["b"] == 200 - served["error"]
    stats = client.core.stats
    assert stats["members_ejected"] == stats["ejections_errors"] == 1
    assert client.core.calls.outliers.ejected == 1
    [ejected] = client.events(MemberEjected)
    assert (ejected.cluster, ejected.node_id) == ("db", nodes["c"].node_id)
    assert (ejected.reason, ejected.seconds, ejected.ejections) == ("errors", 1.0, 1)
    assert client.core.calls.outliers.ejected_from(nodes["c"].node_id) == ("db",)

    net.advance(1.5)  # the ejection is over: it is chosen again, and ejected again, for longer
    [readmitted] = client.events(MemberReadmitted)
    assert (readmitted.cluster, readmitted.node_id) == ("db", nodes["c"].node_id)
    assert stats["members_readmitted"] == 1
    served = served_by(net, client, 200)
    assert served["error"] == FAST.consecutive_errors
    assert [e.seconds for e in client.events(MemberEjected)] == [1.0, 2.0]

    nodes["c"].handler = echo  # recovered: back after its second, longer, ejection
    net.advance(2.5)
    assert stats["members_readmitted"] == 2
    assert client.core.calls.outliers.ejected == 0
    assert served_by(net, client, 300)["c"] > 50


def test_an_ejection_grows_with_each_one_up_to_the_cap_and_is_forgotten_in_time() -> None:
    net = MemNet(seed=2, config=CoreConfig(outliers=FAST))
    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=failing({"b"}))
    client = nodes["client"]
    for ejections in range(1, 7):
        served_by(net, client, 40)
        assert len(client.events(MemberEjected)) == ejections
        while len(client.events(MemberReadmitted)) < ejections:  # within 4 s: the longest
            assert net.now < 30.0
            net.advance(0.1)
    assert [e.seconds for e in client.events(MemberEjected)] == [1.0, 2.0, 3.0, 4.0, 4.0, 4.0]
    nodes["b"].handler = echo
    net.advance(10.0)  # in rotation long enough: its count decays to nothing
    assert not client.core.calls.outliers._records
    nodes["b"].handler = failing({"b"})
    served_by(net, client, 40)
    assert client.events(MemberEjected)[-1].seconds == 1.0


def test_with_every_member_failing_half_of_them_stay_in_rotation() -> None:
    net = MemNet(seed=3, config=CoreConfig(outliers=FAST))
    names = {"a", "b", "c", "d"}
    nodes = mesh(net, {name: ["db"] for name in names}, handler=failing(names))
    client = nodes["client"]
    served_by(net, client, 100)
    stats = client.core.stats
    assert client.core.calls.outliers.ejected == 2
    assert stats["ejection_cap_reached"] >= 1
    out = client.core.calls.outliers
    kept = {name for name in names if not out.is_ejected("db", nodes[name].node_id)}
    assert len(kept) == 2
    arrived = {name: len(nodes[name].arrived) for name in names}
    served_by(net, client, 100)
    grew = {name for name in names if len(nodes[name].arrived) > arrived[name]}
    assert grew == kept  # the two in rotation take every request


def test_overloaded_replies_never_eject() -> None:
    net = MemNet(seed=4, config=CoreConfig(outliers=FAST))

    def b_sheds(node: MemNode, event: RequestArrived) -> bytes | None:
        if node.name == "b":
            node.core.calls.turn_away(event.token, "queue")
            return None
        return echo(node, event)

    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=b_sheds)
    client = nodes["client"]
    for _ in range(5):
        assert served_by(net, client, 50)["error"] == 0
        net.advance(1.0)
    assert client.core.stats["requests_turned_away"] > 5
    assert client.core.stats["members_ejected"] == 0


def test_disabled_ejection_keeps_every_member() -> None:
    config = CoreConfig(outliers=OutlierConfig(enabled=False))
    net = MemNet(seed=5, config=config)
    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=failing({"b"}))
    served = served_by(net, nodes["client"], 100)
    net.advance(2.0)
    assert served["error"] > 20
    assert nodes["client"].core.stats["members_ejected"] == 0


# ---------------------------------------------------------------------- the sweep, by hand


class Sweep:
    """An OutlierEjection over links made by hand: the test sets their interval's counts."""

    def __init__(self, members: int, config: OutlierConfig = FAST) -> None:
        self.stats: Counter[str] = Counter()
        self.outbox = Outbox(codec=BodyCodec(1 << 20), stats=self.stats, inbound={}, max_payload=1)
        self.links = []
        for i in range(members):
            link = OutLink(i, f"tcp://m{i}:1", b"", 0.0)
            link.state, link.peer_id, link.clusters["db"] = LinkState.UP, b"m%d" % i, 1
            self.links.append(link)
        self.peers = {link.peer_id: link for link in self.links}
        self.ejection = OutlierEjection(
            config=config,
            stats=self.stats,
            outbox=self.outbox,
            peers=self.peers,
            members=lambda cluster: self.links,
        )
        self.ejection.tick(0.0)  # the first interval starts

    def interval(self, replies: int, errors: int = 0, timeouts: int = 0) -> list[OutLink]:
        for link in self.links:
            link.replies, link.errors, link.timeouts = replies, errors, timeouts
        return self.links

    def judge(self, now: float = 1.0) -> set[int]:
        """The sweep at `now`: the indexes of the members out of rotation."""
        self.ejection.tick(now)
        out = self.ejection
        return {i for i, link in enumerate(self.links) if out.is_ejected("db", link.peer_id)}


def test_a_success_rate_far_below_the_others_ejects() -> None:
    sweep = Sweep(4)
    links = sweep.interval(replies=100)
    links[2].errors = 40  # never five in a row, yet 60% against 100%
    assert sweep.judge() == {2}
    assert sweep.stats["ejections_success_rate"] == 1


def test_failures_alike_across_the_cluster_eject_nobody() -> None:
    sweep = Sweep(4)
    sweep.interval(replies=100, errors=40)
    assert sweep.judge() == set()


def test_timeouts_count_against_one_member_not_against_a_whole_cluster() -> None:
    sweep = Sweep(3)
    links = sweep.interval(replies=50)
    links[0].timeouts = 50  # it stopped answering while its peers answered
    assert sweep.judge() == {0}
    sweep = Sweep(3)
    sweep.interval(replies=50, timeouts=50)  # the caller's own overload: every member alike
    assert sweep.judge() == set()


def test_timeouts_of_a_member_shedding_load_are_the_overloads() -> None:
    sweep = Sweep(3)
    links = sweep.interval(replies=50)
    links[0].timeouts, links[0].refusals = 50, 10
    assert sweep.judge() == set()


def test_timeouts_while_another_member_sheds_load_are_the_overloads_too() -> None:
    """Two members as loaded: one turns requests away, the other lets its queue time out
    before it would shed. Neither is an outlier; errors still count."""
    sweep = Sweep(2)
    links = sweep.interval(replies=50)
    links[0].refusals = 10
    links[1].timeouts = 50
    assert sweep.judge() == set()
    sweep = Sweep(3)
    links = sweep.interval(replies=100)
    links[0].refusals = 10
    links[2].errors = 40
    assert sweep.judge() == {2}


def test_timeouts_at_every_member_are_the_callers_overload_however_uneven() -> None:
    """A caller too busy to take its replies in time sees timeouts at every member, and
    unevenly: nobody is ejected for them. One member that alone lets requests time out is."""
    sweep = Sweep(3)
    links = sweep.interval(replies=50)
    for link, timeouts in zip(links, (40, 3, 1), strict=True):
        link.timeouts = timeouts
    assert sweep.judge() == set()
    links = sweep.interval(replies=50)
    links[0].timeouts = 40
    assert sweep.judge(2.0) == {0}


def test_an_overload_outlasts_the_interval_it_was_shed_in() -> None:
    """A member shed load in one interval: the next interval's timeouts are still the
    overload's; the interval after that judges them again."""
    sweep = Sweep(2)
    links = sweep.interval(replies=50)
    links[0].refusals = 10
    assert sweep.judge(1.0) == set()
    links = sweep.interval(replies=50)
    links[1].timeouts = 50
    assert sweep.judge(2.0) == set()
    links = sweep.interval(replies=50)
    links[1].timeouts = 50
    assert sweep.judge(3.0) == {1}


def test_too_few_requests_are_not_judged() -> None:
    sweep = Sweep(3)
    links = sweep.interval(replies=FAST.min_requests - 1)
    links[1].errors = FAST.min_requests - 1
    assert sweep.judge() == set()


def test_latency_far_above_the_others_ejects_unless_the_member_shed_load() -> None:
    sweep = Sweep(3)
    links = sweep.interval(replies=50)
    for link in links:
        link.latency = 0.002
    links[1].latency = 0.5
    links[1].refusals = 3  # it turned requests away: its estimate carries the penalty
    assert sweep.judge(1.0) == set()
    sweep.interval(replies=50)
    links[1].latency = 0.5  # slow, and shedding nothing
    assert sweep.judge(2.0) == {1}
    assert sweep.stats["ejections_latency"] == 1


def test_a_slower_member_within_the_floor_stays() -> None:
    sweep = Sweep(3)
    links = sweep.interval(replies=50)
    for link in links:
        link.latency = 0.002
    links[0].latency = 0.05  # 25 times slower, but by less than latency_floor
    assert sweep.judge() == set()


def test_the_rotation_never_empties() -> None:
    sweep = Sweep(2)
    members = sweep.links
    assert sweep.ejection.rotation("db", members) is members
    links = sweep.interval(replies=100)
    links[0].errors = 100
    assert sweep.judge() == {0}
    assert sweep.ejection.rotation("db", members) == [members[1]]
    assert sweep.ejection.rotation("db", members) is sweep.ejection.rotation("db", members)
    assert sweep.ejection.rotation("db", [members[0]]) == [members[0]]  # the others' links down
    assert sweep.ejection.in_rotation("db", list(members)) == [members[1]]  # hedges: not kept
    assert sweep.ejection.in_rotation("other", members) is members


def test_error_replies_in_a_row_and_a_good_one_between() -> None:
    sweep = Sweep(3)
    link = sweep.links[0]
    for _ in range(FAST.consecutive_errors - 1):
        sweep.ejection.failed(link, "db", 0.5)
    link.errors_in_row = 0  # a good reply (Calls.on_reply clears it)
    sweep.ejection.failed(link, "db", 0.5)
    assert sweep.ejection.ejected == 0
    for _ in range(FAST.consecutive_errors - 1):
        sweep.ejection.failed(link, "db", 0.5)
    assert sweep.ejection.ejected == 1


def test_a_readmitted_member_starts_from_a_typical_estimate() -> None:
    sweep = Sweep(4)
    links = sweep.links
    for link, latency in zip(links, (0.009, 0.001, 0.002, 0.004), strict=True):
        link.latency = latency
    for _ in range(FAST.consecutive_errors):
        sweep.ejection.failed(links[0], "db", 0.5)
    assert sweep.ejection.is_ejected("db", links[0].peer_id)
    sweep.ejection.tick(0.5 + FAST.base_ejection)
    assert not sweep.ejection.is_ejected("db", links[0].peer_id)
    assert links[0].latency == 0.002  # its stale estimate would keep it starved
