"""Batching: what one flush sends on a link in one scope is sealed and sent as one frame."""

from __future__ import annotations

from memnet import MemNet, MemNode, echo, mesh

from irismesh._core.frames import STATUS_OK, Kind, decode_header, encode_batch, encode_request


def batched(net: MemNet) -> tuple[MemNode, MemNode]:
    nodes = mesh(net, {"member": ["db"]}, handler=echo)
    client, member = nodes["client"], nodes["member"]
    client.core.batching = member.core.batching = True
    return client, member


def flush(net: MemNet, node: MemNode) -> None:
    node.core.seal_staged()
    net.collect(node)
    net.run(net.now)


def test_staged_requests_travel_as_one_batch_and_each_gets_its_reply() -> None:
    net = MemNet(seed=1)
    client, member = batched(net)
    ids = [client.core.request("db", b"%d" % i, 2.0, net.now) for i in range(10)]
    assert client.core.out_frames == []  # staged, not sent yet
    client.core.seal_staged()
    [(_link, frame)] = client.core.out_frames
    assert decode_header(frame, client.core.config.max_frame)[0] == Kind.BATCH
    net.collect(client)
    net.run(net.now)
    assert [e.payload for e in member.arrived] == [b"%d" % i for i in range(10)]
    flush(net, member)  # the member's ten replies: one BATCH back
    assert member.core.stats["batches_sent"] == 1
    for i, req_id in enumerate(ids):
        [reply] = client.replies[req_id]
        assert (reply.status, reply.payload) == (STATUS_OK, b"re:%d" % i)
    assert client.core.pending_count == 0


def test_a_single_staged_frame_is_sent_as_itself() -> None:
    net = MemNet(seed=2)
    client, _member = batched(net)
    client.core.request("db", b"alone", 2.0, net.now)
    client.core.seal_staged()
    [(_link, frame)] = client.core.out_frames
    assert decode_header(frame, client.core.config.max_frame)[0] == Kind.REQUEST
    assert client.core.stats["batches_sent"] == 0


def test_a_batch_with_a_foreign_entry_is_dropped_and_counted() -> None:
    net = MemNet(seed=3)
    client, member = batched(net)
    link = client.core.members("db")[0]
    slot = link.clusters["db"]
    body = encode_batch([(int(Kind.REQUEST), encode_request(1, 1000, [], b"x")), (99, b"?")])
    link.send_seq += 1
    from irismesh._core.frames import encode_header

    header = encode_header(Kind.BATCH, slot, link.send_seq)
    frame = header + link.send_sealers[slot].seal(header, link.send_seq, body)
    [(routing_id, _)] = [(r, c) for r, c in net.routes.items() if c.dialler is client]
    member.core.receive_in(routing_id, frame, net.now)
    assert member.core.stats["dropped_bad_envelope"] == 1


def test_large_batches_are_opened_in_place_and_each_entry_gets_its_reply() -> None:
    # Batches of kilobyte payloads pass the size above which a frame is opened through a view
    # of it (no copy of the body before the cipher reads it): the same replies, byte for byte.
    net = MemNet(seed=4)
    client, member = batched(net)
    payloads = [bytes([i]) * 1024 for i in range(12)]
    ids = [client.core.request("db", p, 2.0, net.now) for p in payloads]
    flush(net, client)
    assert [e.payload for e in member.arrived] == payloads
    assert all(type(e.payload) is bytes for e in member.arrived)
    flush(net, member)
    for payload, req_id in zip(payloads, ids, strict=True):
        [reply] = client.replies[req_id]
        assert (reply.status, reply.payload) == (STATUS_OK, b"re:" + payload)
        assert type(reply.payload) is bytes


def test_a_large_batch_changed_in_flight_is_dropped_as_badly_sealed() -> None:
    net = MemNet(seed=5)
    client, member = batched(net)
    for i in range(4):
        client.core.request("db", bytes([i]) * 1024, 2.0, net.now)
    client.core.seal_staged()
    [(_link, frame)] = client.core.out_frames
    client.core.out_frames.clear()
    assert len(frame) > 4096
    [(routing_id, _)] = [(r, c) for r, c in net.routes.items() if c.dialler is client]
    changed = frame[:-100] + bytes([frame[-100] ^ 1]) + frame[-99:]
    member.core.receive_in(routing_id, changed, net.now)
    assert member.core.stats["dropped_bad_seal"] == 1
    assert member.arrived == []
