"""One node of the tracing tests in a process of its own, with an OpenTelemetry SDK whose spans
are kept in memory and written, finished, to a JSON file.

Roles (`--role`): "c" serves cluster c (answers "c:" + payload); "d" subscribes to events.#
and leaves once it has had one message; "b" serves cluster b: its handler asks c and
publishes on events.done, then answers "b:" + c's reply; "a" asks b once (`--cluster`, b by
default) and leaves. Each prints one JSON line once it is ready ({"endpoint": ...}); "b" and
"c" write their spans and leave when their stdin closes. Keys come from IRISMESH_KEYFILE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import irismesh

LOCAL = "tcp://127.0.0.1:0"


def as_json(span: ReadableSpan, role: str) -> dict[str, Any]:
    context = span.get_span_context()
    assert context is not None
    return {
        "role": role,
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
    }


def ready(node: irismesh.Node) -> None:
    print(json.dumps({"endpoint": node.endpoint}), flush=True)


async def stdin_closed() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def run(args: argparse.Namespace) -> None:
    keys = irismesh.Keyring.from_env()
    assert keys is not None, "no IRISMESH_KEYFILE"
    common: dict[str, Any] = {
        "keyring": keys,
        "bind": LOCAL,
        "discovery": False,
        "seeds": args.seed,
        "name": f"trace-{args.role}",
    }
    role = args.role
    if role == "c":
        async with irismesh.Node("c", **common) as node:
            node.on_request(lambda payload: b"c:" + payload)
            ready(node)
            await stdin_closed()
    elif role == "d":
        got = asyncio.Event()
        async with irismesh.Node(**common) as node:
            node.subscribe("events.#", callback=lambda message: got.set())
            ready(node)
            await asyncio.wait_for(got.wait(), 60)
            await asyncio.sleep(0)  # the delivery's span has ended with the callback
    elif role == "b":
        async with irismesh.Node("b", **common) as node:

            async def handle(payload: bytes) -> bytes:
                reply = await node.request("c", payload, timeout=10)
                await node.publish("events.done", payload, timeout=10)
                return b"b:" + reply

            node.on_request(handle)
            await node.wait_for_members("c", 1, timeout=30)
            await node.wait_for_subscribers("events.done", 1, timeout=30)
            ready(node)
            await stdin_closed()
    else:
        async with irismesh.Node(**common) as node:
            await node.wait_for_members(args.cluster, 1, timeout=30)
            ready(node)
            reply = await node.request(args.cluster, b"hello", timeout=20)
            assert reply == b"b:c:hello", reply


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["a", "b", "c", "d"], required=True)
    parser.add_argument("--spans", required=True, help="where the finished spans go (JSON)")
    parser.add_argument("--seed", action="append", default=[])
    parser.add_argument("--cluster", default="b", help="what a asks")
    args = parser.parse_args()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": f"trace-{args.role}"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # before the node: it traces by default then
    try:
        irismesh.run(run(args))
    finally:
        spans = [as_json(span, args.role) for span in exporter.get_finished_spans()]
        with open(args.spans, "w") as out:
            json.dump(spans, out)


if __name__ == "__main__":
    main()
