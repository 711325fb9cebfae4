"""The balancer's decay over cores wired in memory, at light load (one request at a time, so
every member is idle when the next is placed, the case where a high estimate starves): a
member starved after one slow first reply is probed again within DECAY - FIRST_SAMPLE_AGE
and, healthy by then, gets its share back; one starved after several slow replies waits
DECAY; one still slow gets one request per DECAY and no more."""

from __future__ import annotations

import heapq
import itertools

from memnet import MemNet, MemNode, mesh

from irismesh._core import balancer
from irismesh._core.events import RequestArrived, Token

STEP = 0.001  # the simulated clock's step: service times are whole steps
EVERY = 0.025  # light load: a request every 25 ms, each answered within 25 ms


class Service:
    """Members answering each request after their own service time (`times`, by name)."""

    def __init__(self, net: MemNet, times: dict[str, float]) -> None:
        self.net = net
        self.times = times
        self.due: list[tuple[float, int, MemNode, Token]] = []
        self._order = itertools.count()

    def handler(self, node: MemNode, event: RequestArrived) -> None:
        at = self.net.now + self.times[node.name]
        heapq.heappush(self.due, (at, next(self._order), node, event.token))

    def answer_due(self) -> None:
        while self.due and self.due[0][0] <= self.net.now + 1e-9:
            _at, _order, node, token = heapq.heappop(self.due)
            self.net.reply(node, token, b"ok")


def light_load(net: MemNet, service: Service, seconds: float) -> list[tuple[float, str]]:
    """Requests from "client" one every EVERY for `seconds`: (sent at, member) of each."""
    client = net.nodes["client"]
    by_id = {node.node_id: name for name, node in net.nodes.items()}
    sent: list[tuple[float, int]] = []
    start = net.now
    every, tick = round(EVERY / STEP), round(0.1 / STEP)
    for step in range(round(seconds / STEP)):
        if step % every == 0:
            sent.append((net.now, net.request(client, "db", b"x")))
        net.run(start + (step + 1) * STEP)
        service.answer_due()
        if step % tick == tick - 1:
            for node in net.nodes.values():
                net.tick(node)
    net.advance(0.1)  # the last replies
    served = []
    for at, req_id in sent:
        [reply] = client.replies[req_id]
        served.append((at, by_id[reply.peer]))
    return served


def start(times: dict[str, float], seed: int) -> tuple[MemNet, Service]:
    net = MemNet(seed=seed)
    service = Service(net, times)
    mesh(net, {name: ["db"] for name in times}, handler=service.handler)
    return net, service


def test_a_member_slow_at_its_first_reply_only_is_back_within_two_seconds() -> None:
    net, service = start({"a": 0.001, "b": 0.001, "c": 0.050}, seed=1)  # c's first reply: slow
    slow = light_load(net, service, 1.0)
    assert sum(name == "c" for _at, name in slow) == 1  # 50 times slower: starved at once
    [first_c] = [at for at, name in slow if name == "c"]
    service.times["c"] = 0.001  # as fast as the others from now on
    served = light_load(net, service, balancer.DECAY)
    probe = min(at for at, name in served if name == "c")
    # One sample is weak evidence: it decays within DECAY - FIRST_SAMPLE_AGE, not DECAY.
    window = balancer.DECAY - balancer.FIRST_SAMPLE_AGE
    assert first_c + 0.9 * window < probe <= first_c + window + 0.1
    after = [name for at, name in served if at > probe]
    assert after.count("c") / len(after) > 0.25  # its share back: a third


def test_a_member_starved_after_a_slow_start_is_probed_within_decay_and_gets_its_share() -> None:
    net, service = start({"a": 0.001, "b": 0.001, "c": 0.050}, seed=1)  # c starts cold
    slow = light_load(net, service, 4.0)  # past its first probe: two slow replies
    assert 2 <= sum(name == "c" for _at, name in slow) <= 3  # 50 times slower: starved
    last_c = max(at for at, name in slow if name == "c")
    service.times["c"] = 0.001  # warmed up: as fast as the others from now on
    recovered = net.now
    served = light_load(net, service, 2 * balancer.DECAY)
    probe = min(at for at, name in served if name == "c")
    # Starved until its estimate, 50 times the others', had nearly decayed, then probed.
    assert recovered < 0.9 * balancer.DECAY + last_c < probe <= last_c + balancer.DECAY + 0.1
    after = [name for at, name in served if at > probe]
    assert after.count("c") / len(after) > 0.25  # its share back: a third


def test_a_member_still_slow_is_probed_once_per_decay_and_no_more() -> None:
    net, service = start({"a": 0.001, "b": 0.001, "c": 0.020}, seed=2)
    seconds = 6 * balancer.DECAY
    served = light_load(net, service, seconds)
    to_c = [at for at, name in served if name == "c"]
    assert len(served) > 2000
    assert 5 <= len(to_c) <= 9  # about one per DECAY: the first, then six probes at most
    gaps = [b - a for a, b in itertools.pairwise(to_c[1:])]
    assert all(gap >= 0.9 * balancer.DECAY for gap in gaps), gaps
