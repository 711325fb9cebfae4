"""Tracing over real sockets on 127.0.0.1, nodes in one process, each tracing into an
OpenTelemetry SDK provider of the test's own (`Node(tracing=provider)`): spans, their
parents, handlers running in their caller's context, and nodes that do not trace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path

import pytest
from helpers import run_with_deadline, wait_until

import irismesh
from irismesh._core.events import RequestArrived
from irismesh.telemetry.tracing import context_of, tracing_wanted

pytest.importorskip("opentelemetry.sdk.trace", reason="the tracing tests need opentelemetry-sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind


def run(coro: Awaitable[None], timeout: float = 30) -> None:
    run_with_deadline(coro, timeout)


class Recorded:
    """A tracer provider whose finished spans are kept in memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    @property
    def spans(self) -> tuple[ReadableSpan, ...]:
        return self.exporter.get_finished_spans()

    def named(self, kind: SpanKind, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.kind == kind and s.name == name]


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    spans = Recorded()
    try:
        yield spans
    finally:
        spans.provider.shutdown()


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    context = span.get_span_context()
    assert context is not None
    return context.span_id


def trace_id(span: ReadableSpan) -> int:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id


def test_an_awaiting_handler_and_a_blocking_one_continue_their_callers_trace(
    keys: irismesh.Keyring, recorded: Recorded
) -> None:
    tracer = recorded.provider.get_tracer("test")

    async def main() -> None:
        traced = {"tracing": recorded.provider, "telemetry": False}
        leaf = await irismesh.Node("leaf", keyring=keys, **traced).start()
        mid = await irismesh.Node("mid", keyring=keys, seeds=[leaf.endpoint], **traced).start()
        slow = await irismesh.Node("slow", keyring=keys, seeds=[leaf.endpoint], **traced).start()
        client = irismesh.Node(keyring=keys, seeds=[mid.endpoint], **traced)
        await client.start()
        try:
            leaf.on_request(lambda payload: b"leaf:" + payload)

            @mid.on_request
            async def relay(payload: bytes) -> bytes:
                await asyncio.sleep(0.01)  # suspended: resumed in a Task of its own
                return b"mid:" + await mid.request("leaf", payload, timeout=5)

            def blocking(payload: bytes) -> bytes:  # in the node's thread pool
                with tracer.start_as_current_span("inside the thread"):
                    time.sleep(0.001)
                return b"slow:" + payload

            slow.on_request(blocking, blocking=True)
            for cluster in ("mid", "slow", "leaf"):
                await client.wait_for_members(cluster, 1, timeout=10)
            await mid.wait_for_members("leaf", 1, timeout=10)
            with tracer.start_as_current_span("root"):
                assert await client.request("mid", b"x", timeout=5) == b"mid:leaf:x"
                assert await client.request("slow", b"y", timeout=5) == b"slow:y"
        finally:
            await asyncio.gather(*(n.close() for n in (client, mid, slow, leaf)))

    run(main())
    [root] = [s for s in recorded.spans if s.name == "root"]
    [to_mid] = recorded.named(SpanKind.CLIENT, "mid/request")
    [mid_run] = recorded.named(SpanKind.SERVER, "mid/request")
    [to_leaf] = recorded.named(SpanKind.CLIENT, "leaf/request")
    [leaf_run] = recorded.named(SpanKind.SERVER, "leaf/request")
    [slow_run] = recorded.named(SpanKind.SERVER, "slow/request")
    [in_thread] = [s for s in recorded.spans if s.name == "inside the thread"]
    assert parent_of(to_mid) == span_id(root)
    assert parent_of(mid_run) == span_id(to_mid)
    assert parent_of(to_leaf) == span_id(mid_run)
    assert parent_of(leaf_run) == span_id(to_leaf)
    assert parent_of(in_thread) == span_id(slow_run)
    assert len({trace_id(s) for s in recorded.spans}) == 1


def test_a_failing_call_ends_its_spans_with_the_error(
    keys: irismesh.Keyring, recorded: Recorded
) -> None:
    async def main() -> None:
        member = await irismesh.Node("db", keyring=keys, tracing=recorded.provider).start()
        client = irismesh.Node(keyring=keys, seeds=[member.endpoint], tracing=recorded.provider)
        await client.start()
        try:

            @member.on_request
            def fail(payload: bytes) -> bytes:
                raise ValueError("no such key")

            await client.wait_for_members("db", 1, timeout=10)
            with pytest.raises(irismesh.RemoteError):
                await client.request("db", b"k", timeout=5)
            with pytest.raises(irismesh.NoResponders):
                await client.request("nobody", b"k", timeout=5)
        finally:
            await asyncio.gather(client.close(), member.close())

    run(main())
    [call] = recorded.named(SpanKind.CLIENT, "db/request")
    [served] = recorded.named(SpanKind.SERVER, "db/request")
    [refused] = recorded.named(SpanKind.CLIENT, "nobody/request")
    assert (call.attributes or {})["error.type"] == "ValueError"
    assert (served.attributes or {})["error.type"] == "ValueError"
    assert (refused.attributes or {})["error.type"] == "NoResponders"
    assert all(not s.status.is_ok for s in (call, served, refused))


def test_broadcasts_surveys_tunnels_and_messages_make_their_spans(
    keys: irismesh.Keyring, recorded: Recorded
) -> None:
    async def main() -> None:
        traced = {"tracing": recorded.provider}
        member = await irismesh.Node("db", keyring=keys, **traced).start()
        client = irismesh.Node(keyring=keys, seeds=[member.endpoint], **traced)
        await client.start()
        got: list[irismesh.Message] = []
        try:
            member.on_broadcast(lambda payload: None)
            member.on_survey(lambda payload: b"fine")

            @member.on_tunnel
            async def echo(tunnel: irismesh.Tunnel) -> None:
                await tunnel.send(await tunnel.recv())

            member.subscribe("news.#", callback=got.append)
            await client.wait_for_members("db", 1, timeout=10)
            await client.wait_for_subscribers("news.today", 1, timeout=10)
            assert len(await client.broadcast("db", b"all", timeout=5)) == 1
            assert len((await client.survey("db", b"?", timeout=5)).answers) == 1
            async with client.tunnel("db", timeout=5) as tunnel:
                await tunnel.send(b"ping")
                assert await tunnel.recv() == b"ping"
            await client.publish("news.today", b"story")
            await wait_until(lambda: got, 5, "the message")
            await wait_until(
                lambda: recorded.named(SpanKind.SERVER, "db/tunnel"), 5, "the tunnel's end"
            )
        finally:
            await asyncio.gather(client.close(), member.close())
        [message] = got
        assert context_of(message) is not None
        [process] = recorded.named(SpanKind.CONSUMER, "process news.today")
        # The message carries its delivery's context: work on it continues that span.
        assert message.trace.startswith(b"00-%032x-%016x" % (trace_id(process), span_id(process)))

    run(main())
    for method in ("broadcast", "survey", "tunnel"):
        [call] = recorded.named(SpanKind.CLIENT, f"db/{method}")
        [served] = recorded.named(SpanKind.SERVER, f"db/{method}")
        assert parent_of(served) == span_id(call)
        assert (served.attributes or {})["rpc.method"] == method
    [publish] = recorded.named(SpanKind.PRODUCER, "publish news.today")
    [process] = recorded.named(SpanKind.CONSUMER, "process news.today")
    assert parent_of(process) == span_id(publish)
    assert (process.attributes or {})["messaging.system"] == "irismesh"


def test_a_node_that_does_not_trace_serves_traced_calls_and_sends_no_context(
    keys: irismesh.Keyring, recorded: Recorded
) -> None:
    seen: list[bytes] = []

    async def main() -> None:
        member = await irismesh.Node("db", keyring=keys, tracing=False).start()
        client = irismesh.Node(keyring=keys, seeds=[member.endpoint], tracing=recorded.provider)
        plain = irismesh.Node(keyring=keys, seeds=[member.endpoint], tracing=False)
        await client.start()
        await plain.start()
        try:

            def forward(request: RequestArrived) -> None:
                seen.append(request.trace)
                member.answer(request, b"ok")

            member.forward_requests(forward, lambda event: False)
            for caller in (client, plain):
                await caller.wait_for_members("db", 1, timeout=10)
                assert await caller.request("db", b"x", timeout=5) == b"ok"
        finally:
            await asyncio.gather(client.close(), plain.close(), member.close())

    run(main())
    [call] = recorded.spans  # the traced caller's: the member makes none
    assert call.name == "db/request"
    flags = call.get_span_context().trace_flags  # type: ignore[union-attr]
    context = b"00-%032x-%016x-%02x" % (trace_id(call), span_id(call), flags)
    assert seen == [context, b""]


def test_tracing_is_on_by_default_only_with_a_provider_set_or_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("IRISMESH_TRACING", raising=False)
    assert tracing_wanted(False) is False
    assert tracing_wanted(True) is True
    assert tracing_wanted(None, {"IRISMESH_TRACING": "0"}) is False
    assert tracing_wanted(None, {"IRISMESH_TRACING": "1"}) is True
    assert tracing_wanted(TracerProvider()) is True
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        assert tracing_wanted(None, {}) is False  # the API alone records nothing
    with pytest.raises(irismesh.ConfigurationError):
        tracing_wanted(None, {"IRISMESH_TRACING": "maybe"})


def test_without_the_api_a_node_does_not_trace_and_asking_says_what_to_install(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    from irismesh.telemetry import tracing

    monkeypatch.setattr(tracing, "installed", lambda: False)
    monkeypatch.delenv("IRISMESH_TRACING", raising=False)
    assert tracing_wanted(None, {}) is False
    assert irismesh.Node(keyring=keys).tracing is None
    with pytest.raises(irismesh.ConfigurationError, match=r"irismesh\[otel\]"):
        irismesh.Node(keyring=keys, tracing=True)


@pytest.mark.parametrize(
    "carried",
    [
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00\ncongo=t61rcWkgMzE,rojo=00f0",
        b"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # not lowercase
        b"00-00000000000000000000000000000000-b7ad6b7169203331-01",  # no trace id
        b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # no span id
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
        b"00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future",  # a later version
        b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        b"garbage",
        b"\xff\xfe",
    ],
)
def test_a_carried_context_reads_as_the_w3c_propagator_reads_it(carried: bytes) -> None:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from irismesh.telemetry.tracing import Tracing, decode

    ours = trace.get_current_span(Tracing("t").extract(carried)).get_span_context()
    theirs = trace.get_current_span(
        TraceContextTextMapPropagator().extract(decode(carried))
    ).get_span_context()
    assert (ours.is_valid, ours.trace_id, ours.span_id, ours.trace_flags, ours.is_remote) == (
        theirs.is_valid,
        theirs.trace_id,
        theirs.span_id,
        theirs.trace_flags,
        theirs.is_remote,
    )
    assert dict(ours.trace_state or {}) == dict(theirs.trace_state or {})


def test_a_queued_job_runs_in_the_trace_it_was_queued_in(
    keys: irismesh.Keyring, recorded: Recorded, tmp_path: Path
) -> None:
    tracer = recorded.provider.get_tracer("test")
    ran: list[int] = []

    async def main() -> None:
        traced = {"tracing": recorded.provider}
        memory = await irismesh.Node(keyring=keys, memory=tmp_path / "m", **traced).start()
        producer = irismesh.Node(keyring=keys, seeds=[memory.endpoint], **traced)
        worker = irismesh.Node("work", keyring=keys, seeds=[memory.endpoint], **traced)

        @worker.on_request
        def handle(payload: bytes) -> bytes:
            ran.append(trace.get_current_span().get_span_context().trace_id)
            return b"ok"

        await producer.start()
        await worker.start()
        try:
            await producer.wait_for_members("_memory", 1, timeout=10)
            with tracer.start_as_current_span("produce"):
                await producer.enqueue("work", b"job")
            await wait_until(lambda: ran, 15, "the job to run")
        finally:
            await asyncio.gather(worker.close(), producer.close(), memory.close())

    run(main())
    [produce] = [s for s in recorded.spans if s.name == "produce"]
    [job_run] = recorded.named(SpanKind.SERVER, "work/job")
    [dispatch] = recorded.named(SpanKind.CLIENT, "work/job")
    assert ran == [trace_id(produce)]
    assert trace_id(job_run) == trace_id(produce)
    assert parent_of(dispatch) == span_id(produce)  # the memory's call continues the producer's
    assert parent_of(job_run) == span_id(dispatch)


def test_calls_and_tunnels_keep_their_trace_through_a_gateway_pair(
    recorded: Recorded,
) -> None:
    """Mesh a serves "db" and exports it; the caller is in mesh b. The gateways make no spans:
    each member span is the child of its caller's span across them."""
    from contextlib import AsyncExitStack

    from irismesh.federation import LinkConfig

    fast = LinkConfig(heartbeat=0.1, dead_after=0.6, retry=0.2, resend_after=0.4)
    local = "tcp://127.0.0.1:0"
    a_keys, b_keys, link = (irismesh.Keyring.generate() for _ in range(3))

    async def main() -> None:
        async with AsyncExitStack() as stack:
            member = irismesh.Node("db", keyring=a_keys, bind=local, tracing=recorded.provider)
            await stack.enter_async_context(member)
            member.on_request(lambda payload: b"ok")
            member.on_broadcast(lambda payload: None)
            member.on_survey(lambda payload: b"fine")

            @member.on_tunnel
            async def echo(tunnel: irismesh.Tunnel) -> None:
                async for message in tunnel:
                    await tunnel.send(message)
                await tunnel.send_eof()

            common = {"link_keyring": link, "link_config": fast, "bind": local}
            gw_a = irismesh.Gateway(
                "a", keyring=a_keys, listen=local, export=("db",), seeds=[member.endpoint], **common
            )
            await stack.enter_async_context(gw_a)
            gw_b = irismesh.Gateway("b", keyring=b_keys, peers=(gw_a.endpoint,), **common)
            await stack.enter_async_context(gw_b)
            client = irismesh.Node(
                keyring=b_keys, seeds=[gw_b.node.endpoint], bind=local, tracing=recorded.provider
            )
            await stack.enter_async_context(client)
            await client.wait_for_members("db", timeout=10)
            assert await client.request("db", b"x", timeout=5) == b"ok"
            await client.broadcast("db", b"all", timeout=5)
            await client.survey("db", b"?", timeout=5)
            async with client.tunnel("db", timeout=5) as tunnel:
                await tunnel.send(b"ping")
                assert await tunnel.recv() == b"ping"
                await tunnel.send_eof()
                with pytest.raises(irismesh.EndOfStream):
                    await tunnel.recv()
            await wait_until(
                lambda: recorded.named(SpanKind.SERVER, "db/tunnel"), 5, "the tunnel's end"
            )

    run(main())
    for method in ("request", "broadcast", "survey", "tunnel"):
        [call] = recorded.named(SpanKind.CLIENT, f"db/{method}")
        [served] = recorded.named(SpanKind.SERVER, f"db/{method}")
        assert trace_id(served) == trace_id(call), method
        assert parent_of(served) == span_id(call), method


def test_a_request_keeps_its_trace_through_gateways_of_one_process(recorded: Recorded) -> None:
    """Gateways joined in-process hand requests core to core (`Node.relay_requests`): the
    context goes with them as it came."""
    from contextlib import AsyncExitStack

    from irismesh.federation import LocalGateways

    local = "tcp://127.0.0.1:0"
    a_keys, b_keys = irismesh.Keyring.generate(), irismesh.Keyring.generate()

    async def main() -> None:
        async with AsyncExitStack() as stack:
            member = irismesh.Node("db", keyring=a_keys, bind=local, tracing=recorded.provider)
            await stack.enter_async_context(member)
            member.on_request(lambda payload: b"ok")
            gateways = [
                irismesh.Gateway(
                    name, keyring=keys, seeds=seeds, bind=local, local=True, export=export
                )
                for name, keys, seeds, export in (
                    ("a", a_keys, [member.endpoint], ["db"]),
                    ("b", b_keys, [], []),
                )
            ]
            joined = await stack.enter_async_context(LocalGateways(gateways))
            client = irismesh.Node(
                keyring=b_keys,
                seeds=[joined["b"].node.endpoint],
                bind=local,
                tracing=recorded.provider,
            )
            await stack.enter_async_context(client)
            await client.wait_for_members("db", timeout=10)
            for _ in range(3):  # the first may take the link's path, before the relay is set
                assert await client.request("db", b"x", timeout=5) == b"ok"
            assert joined["a"].node.stats.get("requests_relay_served", 0) >= 1  # core to core

    run(main())
    calls = recorded.named(SpanKind.CLIENT, "db/request")
    served = recorded.named(SpanKind.SERVER, "db/request")
    assert len(calls) == len(served) == 3
    assert sorted(parent_of(s) for s in served) == sorted(span_id(c) for c in calls)
