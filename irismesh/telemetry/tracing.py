"""Trace context across the mesh: W3C `traceparent` and `tracestate` in, OpenTelemetry spans out.

Theory of operation
-------------------
The core carries a call's or a message's trace context as opaque bytes, sealed with its
payload (`frames.TRACED`, `frames.PUBLISH_TRACED`): the text of the W3C `traceparent` header,
then a newline and `tracestate` when there is one. A message without context carries nothing
extra, and a peer that does not read context (its WELCOME says so) is sent none. This module
is the only one that reads or writes the context, and the only one that imports
OpenTelemetry (the `otel` extra: `opentelemetry-api`), when a node starts with tracing on.
A node with tracing off holds no `Tracing`: it pays one check per message (`is None`).

A node traces (`tracing_wanted`) when `Node(tracing=True)` or IRISMESH_TRACING=1 says so, or
when given a tracer provider of its own (`Node(tracing=provider)`); by default when the API is
installed and the application has set a global tracer provider (the SDK's) before the node is
made: with the API alone, spans would record nothing.

Spans, named and attributed as OpenTelemetry's semantic conventions for RPC and messaging
say (`rpc.system` and `messaging.system` are "irismesh"):

    caller      CLIENT    "{cluster}/{method}"  a request, broadcast, survey or tunnel open,
                                                from the call to its reply or failure
    member      SERVER    "{cluster}/{method}"  a handler's run, the child of the caller's
                                                span; the handler runs in its context, so a
                                                call it makes continues the trace
    publisher   PRODUCER  "publish {topic}"     the publish; its context goes with the message
    subscriber  CONSUMER  "process {topic}"     a message's delivery, the child of the
                                                producer's span; a subscription's callback
                                                runs in its context, and `Message.trace` is
                                                it (`context_of`)

`method` is the kind of call: request, job, broadcast, survey or tunnel. A gateway passes
context from one mesh to the other as it came, making no spans of its own, so the far
member's span is the child of the caller's.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from irismesh.errors import ConfigurationError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, TracerProvider

ENV = "IRISMESH_TRACING"
SYSTEM = "irismesh"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def installed() -> bool:
    """Whether the OpenTelemetry API is importable (the `otel` extra)."""
    return importlib.util.find_spec("opentelemetry") is not None and (
        importlib.util.find_spec("opentelemetry.trace") is not None
    )


def tracing_wanted(
    asked: bool | TracerProvider | None, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether a node traces: as `asked` (Node(tracing=...); a tracer provider is a yes),
    else as IRISMESH_TRACING says, else when the API is installed and a tracer provider has
    been set."""
    if asked is not None and not isinstance(asked, bool):
        return True
    env = os.environ if environ is None else environ
    if asked is None:
        text = env.get(ENV, "").strip().lower()
        if text in _TRUE:
            asked = True
        elif text in _FALSE:
            return False
        elif text:
            raise ConfigurationError(f"{ENV}={text!r}: expected 1 or 0 (true/false, on/off)")
    if asked is False:
        return False
    unset = "opentelemetry.trace" not in sys.modules and not env.get("OTEL_PYTHON_TRACER_PROVIDER")
    if not asked and unset:
        # A tracer provider is set through the API (imported by then) or named in the
        # environment: without either none was set, and the API stays unloaded.
        return False
    if not installed():
        if asked:
            raise ConfigurationError(
                "tracing needs the OpenTelemetry API: pip install 'irismesh[otel]'"
            )
        return False
    if asked:
        return True
    from opentelemetry import trace

    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def encode(traceparent: str, tracestate: str = "") -> bytes:
    """The context as the core carries it."""
    if tracestate:
        return f"{traceparent}\n{tracestate}".encode("ascii", "replace")
    return traceparent.encode("ascii", "replace")


def decode(trace: bytes) -> dict[str, str]:
    """The W3C headers in a carried context ({} when it is not text)."""
    try:
        text = trace.decode("ascii")
    except UnicodeDecodeError:
        return {}
    traceparent, _, tracestate = text.partition("\n")
    headers = {"traceparent": traceparent}
    if tracestate:
        headers["tracestate"] = tracestate
    return headers


def context_of(message: Any) -> Context | None:
    """The context a message (`Message`) or a request event (`RequestArrived`) carries, as an
    OpenTelemetry Context to start spans in (None without one, or without the API)."""
    trace = getattr(message, "trace", b"")
    if not trace or not installed():
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(decode(trace))


class Tracing:
    """One node's spans and the context it sends (see the module's docstring)."""

    def __init__(self, node_name: str, provider: TracerProvider | None = None) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            TraceState,
        )
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from irismesh import __version__

        self._trace = trace
        self._attach = context.attach
        self._detach = context.detach
        self._tracer = trace.get_tracer("irismesh", __version__, tracer_provider=provider)
        self._propagator = TraceContextTextMapPropagator()
        self._client, self._server = SpanKind.CLIENT, SpanKind.SERVER
        self._producer, self._consumer = SpanKind.PRODUCER, SpanKind.CONSUMER
        self._status, self._code = Status, StatusCode.ERROR
        self._remote = NonRecordingSpan
        self._span_context, self._flags, self._state = SpanContext, TraceFlags, TraceState
        self.node_name = node_name

    # ----------------------------------------------------------------- context

    def _context_bytes(self, span: Span) -> bytes:
        """What goes on the wire for `span`: its context, or (a span the API alone made,
        which records nothing) the current one's, so context still passes through."""
        sc = span.get_span_context()
        if not sc.is_valid:
            sc = self._trace.get_current_span().get_span_context()
            if not sc.is_valid:
                return b""
        parent = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"
        state = sc.trace_state.to_header() if sc.trace_state else ""
        return encode(parent, state)

    def extract(self, trace: bytes) -> Context:
        """The OpenTelemetry Context a carried context stands for.

        A version-00 traceparent in its canonical form (what nodes send) is read here, at a
        fraction of the propagator's cost (a regular expression); anything else goes to the
        propagator, which knows every rule of the format."""
        head, _, state = trace.partition(b"\n")
        if len(head) == 55 and head.startswith(b"00-") and head[35] == head[52] == 0x2D:
            digits = head[3:35] + head[36:52] + head[53:55]
            if digits.isalnum() and digits == digits.lower():  # lowercase hex, or int says no
                try:
                    trace_id, span_id = int(digits[:32], 16), int(digits[32:48], 16)
                    flags = int(digits[48:], 16)
                except ValueError:
                    trace_id = span_id = 0
                if trace_id and span_id:
                    tracestate = None
                    if state:
                        tracestate = self._state.from_header([state.decode("ascii", "replace")])
                    remote = self._span_context(
                        trace_id,
                        span_id,
                        is_remote=True,
                        trace_flags=self._flags(flags),
                        trace_state=tracestate,
                    )
                    return self._trace.set_span_in_context(self._remote(remote))
        return self._propagator.extract(decode(trace))

    def current(self) -> bytes:
        """The current span's context, to pass on as it is (b"": none)."""
        sc = self._trace.get_current_span().get_span_context()
        if not sc.is_valid:
            return b""
        parent = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"
        return encode(parent, sc.trace_state.to_header() if sc.trace_state else "")

    # ----------------------------------------------------------------- calls

    def call(self, cluster: str, method: str, parent: bytes = b"") -> tuple[Span, bytes]:
        """A CLIENT span for a call into `cluster`, and the context to send with it: the child
        of the current span, or where there is none, of the `parent` context (a call passed
        on as it came)."""
        context = None
        if parent and not self._trace.get_current_span().get_span_context().is_valid:
            context = self.extract(parent)
        span = self._rpc_span(cluster, method, context, self._client)
        return span, self._context_bytes(span)

    def serve(self, cluster: str, method: str, trace: bytes) -> tuple[Span, object]:
        """A SERVER span for a call that came with context `trace`, made the current context
        (for the handler's run): the span, and the token `leave` takes to detach it."""
        parent = self.extract(trace)
        span = self._rpc_span(cluster, method, parent, self._server)
        return span, self._attach(self._trace.set_span_in_context(span, parent))

    def _rpc_span(self, cluster: str, method: str, context: Any, kind: Any) -> Span:
        """A span of an RPC (OpenTelemetry's semantic conventions) on `cluster`'s `method`."""
        return self._tracer.start_span(
            f"{cluster}/{method}",
            context=context,
            kind=kind,
            attributes={"rpc.system": SYSTEM, "rpc.service": cluster, "rpc.method": method},
        )

    def leave(self, token: object) -> None:
        """Detach what `serve` (or `process`) attached."""
        self._detach(token)  # type: ignore[arg-type]

    def end(self, span: Span, error: BaseException | str | None = None) -> None:
        """End a span; with `error` (an exception, or the name of a remote error's type), its
        status is ERROR and `error.type` names it."""
        if error is not None:
            name = error if isinstance(error, str) else type(error).__name__
            span.set_attribute("error.type", name)
            span.set_status(self._status(self._code, str(error)[:200]))
        span.end()

    # ----------------------------------------------------------------- messages

    def publish(self, topic: str) -> tuple[Span, bytes]:
        """A PRODUCER span for a publish on `topic`, and the context to send with it."""
        span = self._messaging_span("publish", topic, None, self._producer)
        return span, self._context_bytes(span)

    def process(self, topic: str, trace: bytes, publisher: str) -> tuple[Span, object, bytes]:
        """A CONSUMER span for a message delivered with context `trace`, made the current
        context: the span, the token `leave` takes, and the span's context (for the message)."""
        parent = self.extract(trace)
        span = self._messaging_span(
            "process",
            topic,
            parent,
            self._consumer,
            {"messaging.client.id": self.node_name, "irismesh.publisher": publisher},
        )
        token = self._attach(self._trace.set_span_in_context(span, parent))
        return span, token, self._context_bytes(span) or trace

    def _messaging_span(
        self,
        operation: str,
        topic: str,
        context: Any,
        kind: Any,
        more: dict[str, str] | None = None,
    ) -> Span:
        """A span of a messaging `operation` (OpenTelemetry's semantic conventions) on `topic`,
        with the attributes `more` besides."""
        attributes = {
            "messaging.system": SYSTEM,
            "messaging.destination.name": topic,
            "messaging.operation.type": operation,
            "messaging.operation.name": operation,
        }
        return self._tracer.start_span(
            f"{operation} {topic}",
            context=context,
            kind=kind,
            attributes=attributes if more is None else attributes | more,
        )
