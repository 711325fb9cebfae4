"""Where a node's metrics are served: an HTTP endpoint on the node's own event loop.

Theory of operation
-------------------
`MetricsEndpoint` is a small HTTP/1.1 server (GET /metrics, kept-alive connections, at most
`_MAX_CONNECTIONS` scrapers, a request head of at most 8 KiB) on the event loop of the nodes it
serves. A scrape runs their `NodeCollector`s (`telemetry.prometheus`) there, not on
prometheus_client's server thread: the nodes' counters are only ever touched from their loop,
so reading them there sees one consistent state and needs no lock or copy, where a thread
would race every dict it iterates. The loop spends the walk's time (well under a millisecond
for a node with a handful of clusters) once per scrape, and counts it
(`irismesh_metrics_scrape_seconds_total`, its CPU time), so what serving costs is measured
where it is paid.

Several nodes of one process may ask for the same address (a gateway and its per-cluster
nodes, or `IRISMESH_METRICS` set for a process that runs many): they share one endpoint
(`open_endpoint`, `serve`), each under its own `node` label, and the endpoint closes when its
last node does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from irismesh._env import metrics_address
from irismesh.errors import ConfigurationError
from irismesh.telemetry.prometheus import NodeCollector, StatsSource

if TYPE_CHECKING:
    from irismesh.node import Node

_MAX_REQUEST_HEAD = 8192  # bytes of an HTTP request line and headers
_MAX_CONNECTIONS = 16  # scrapers at once; more are closed at once
_IDLE_TIMEOUT = 120.0  # a kept-alive scraper that says nothing this long is closed


class MetricsEndpoint:
    """One HTTP endpoint on the event loop serving every registered node's metrics at
    /metrics (and /), for as long as one is registered."""

    def __init__(self, host: str, port: int, loop: asyncio.AbstractEventLoop) -> None:
        self.host = host
        self.port = port
        self.loop = loop
        self.collectors: list[NodeCollector] = []
        self.scrapes = 0
        self.busy_seconds = 0.0  # loop CPU time spent answering scrapes, up to the previous one
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self.port, limit=_MAX_REQUEST_HEAD
            )
        except OSError as exc:
            raise ConfigurationError(f"cannot serve metrics on {self.address}: {exc}") from None
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def withdraw(self, node: Node) -> None:
        """`node` closes: its metrics go; the endpoint closes with its last node."""
        self.collectors = [c for c in self.collectors if c.node is not node]
        if not self.collectors:
            if _endpoints.get((self.host, self.port)) is self:
                del _endpoints[(self.host, self.port)]
            await self.close()

    def collect(self) -> Iterator[Metric]:
        """What `generate_latest` reads: every node's families."""
        for collector in self.collectors:
            yield from collector.collect()
        yield from self._own()

    def exposition(self) -> bytes:
        self.scrapes += 1
        return generate_latest(self)

    def _own(self) -> Iterator[Metric]:
        """What serving costs the loop: scrapes, and the time their answers took to make."""
        scrapes = CounterMetricFamily("irismesh_metrics_scrapes", "Scrapes of this endpoint")
        scrapes.add_metric([], self.scrapes)
        busy = CounterMetricFamily(
            "irismesh_metrics_scrape_seconds",
            "CPU time of the event loop spent answering scrapes (reading the counters, writing "
            "the text)",
        )
        busy.add_metric([], self.busy_seconds)
        return iter((scrapes, busy))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._connections) >= _MAX_CONNECTIONS or task is None:
            writer.close()
            return
        self._connections.add(task)
        try:
            while True:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IDLE_TIMEOUT)
                began = time.thread_time()  # CPU time: what a scrape takes from the loop
                line, _, headers = head.decode("latin-1").partition("\r\n")
                method, _, rest = line.partition(" ")
                path = rest.partition(" ")[0].partition("?")[0]
                close = "connection: close" in headers.lower()
                if method not in ("GET", "HEAD"):
                    status, body, kind = "405 Method Not Allowed", b"GET only\n", "text/plain"
                elif path not in ("/metrics", "/"):
                    status, body, kind = "404 Not Found", b"see /metrics\n", "text/plain"
                else:
                    status, body, kind = "200 OK", self.exposition(), CONTENT_TYPE_LATEST
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                    f"Content-Length: {len(body)}\r\n"
                    f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n".encode()
                )
                if method != "HEAD":
                    writer.write(body)
                self.busy_seconds += time.thread_time() - began
                await writer.drain()
                if close:
                    break
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # the scraper went, idled out or sent more head than a scrape needs
        finally:
            self._connections.discard(task)
            writer.close()


_endpoints: dict[tuple[str, int], MetricsEndpoint] = {}


async def open_endpoint(address: str) -> MetricsEndpoint:
    """The endpoint serving at `address` (HOST:PORT) in this process, opened if none is; port 0
    opens one on a free port. Open without a node, it closes with the last node served."""
    host, port = metrics_address(address)
    loop = asyncio.get_running_loop()
    endpoint = _endpoints.get((host, port)) if port else None
    if endpoint is None:
        endpoint = MetricsEndpoint(host, port, loop)
        await endpoint.start()
        _endpoints[(host, endpoint.port)] = endpoint
    elif endpoint.loop is not loop:
        raise ConfigurationError(
            f"metrics on {address} are served by a node on another event loop: give this node "
            "an address of its own"
        )
    return endpoint


async def serve(
    node: Node, address: str, extra: Iterable[tuple[str, StatsSource]] = ()
) -> MetricsEndpoint:
    """Serve `node`'s metrics at `address` (HOST:PORT), sharing an endpoint another node of
    this process serves there; `MetricsEndpoint.withdraw` ends it."""
    endpoint = await open_endpoint(address)
    # Nodes of one process share a default name (host and process id): a second one with the
    # same name is told apart by its id, or its samples would clash with the first's.
    label = node.name
    if any(c.label == label for c in endpoint.collectors):
        label = f"{node.name}/{node.node_id.hex()[:8]}"
    endpoint.collectors.append(NodeCollector(node, extra, label=label))
    return endpoint


def add_source(node: Node, prefix: str, source: StatsSource) -> None:
    """Export `source`'s counters beside `node`'s, as irismesh_<prefix>_<name>."""
    for endpoint in _endpoints.values():
        for collector in endpoint.collectors:
            if collector.node is node:
                collector.extra.append((prefix, source))


__all__ = ["MetricsEndpoint", "add_source", "open_endpoint", "serve"]
