"""The blocking API: `irismesh.sync.Node` mirrors `irismesh.Node` for code without asyncio.

    with irismesh.sync.Node(cluster="db", keyring=keys) as node:
        @node.on_request
        def handle(payload: bytes) -> bytes: ...
        node.serve_forever()

The asyncio node runs on a loop thread of its own (python-zeroconf's model). Handlers are plain
functions run in a thread pool, so a handler that blocks delays only its own request, never
the node's heartbeats.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, Generic, Self, TypeVar

from irismesh import node as _async
from irismesh._core.config import CoreConfig
from irismesh._loop import new_event_loop
from irismesh.discovery.config import MdnsConfig, SurveyConfig
from irismesh.errors import Closed, ConfigurationError, EndOfStream, RequestTimeout
from irismesh.patterns import pubsub as _pubsub
from irismesh.patterns import tunnel as _tunnel
from irismesh.patterns.pubsub import Policy
from irismesh.patterns.reqrep import time_left
from irismesh.patterns.split import SplitView
from irismesh.security.keyring import Keyring
from irismesh.security.node_keys import KeyHolders

T = TypeVar("T")
SyncHandler = Callable[[bytes], bytes]
F = TypeVar("F", bound=SyncHandler)


class Node:
    """A mesh node driven from ordinary threads; the same arguments as `irismesh.Node`."""

    def __init__(
        self,
        cluster: str | None = None,
        *,
        keyring: Keyring | None = None,
        clusters: Iterable[str] = (),
        bind: str | None = None,
        seeds: Iterable[str] = (),
        survey: bool | SurveyConfig | None = None,
        mdns: bool | MdnsConfig = False,
        discovery: bool | None = None,
        interface: str | None = None,
        config: CoreConfig | None = None,
        default_timeout: float = 5.0,
        handler_threads: int = 8,
        name: str | None = None,
        metrics: str | None = None,
        version: str | None = None,
        tracing: bool | None = None,
    ) -> None:
        self._node = _async.Node(
            cluster,
            keyring=keyring,
            clusters=clusters,
            bind=bind,
            seeds=seeds,
            survey=survey,
            mdns=mdns,
            discovery=discovery,
            interface=interface,
            config=config,
            default_timeout=default_timeout,
            handler_threads=handler_threads,
            name=name,
            metrics=metrics,
            version=version,
            tracing=tracing,
        )
        self._default_timeout = default_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(
            handler_threads, thread_name_prefix="irismesh-handler"
        )
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="irismesh", daemon=True)
        self._started = False
        self._closed = threading.Event()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise Closed("node is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> Node:
        if self._closed.is_set():
            raise Closed("node is closed")
        if not self._started:
            self._started = True
            self._thread.start()
            try:
                self._call(self._node.start())
            except BaseException:
                self.close()
                raise
        return self

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread.is_alive():
            try:
                self._call(self._node.close(), timeout=10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        return self._node.endpoint

    @property
    def metrics_address(self) -> str:
        """Where the node serves Prometheus metrics ("" nowhere)."""
        return self._node.metrics_address

    @property
    def node_id(self) -> bytes:
        return self._node.node_id

    @property
    def name(self) -> str:
        return self._node.name

    @property
    def version(self) -> str:
        return self._node.version

    @property
    def stats(self) -> Mapping[str, int]:
        return self._node.stats

    def on_request(self, handler: F) -> F:
        """Decorator: `handler(payload) -> bytes`, run in the node's handler thread pool (a
        blocking handler: at most `handler_threads` run at once, within admission)."""
        if asyncio.iscoroutinefunction(handler):
            raise ConfigurationError("irismesh.sync.Node takes plain functions as handlers")
        self._node.on_request(handler, blocking=True)
        return handler

    def on_broadcast(self, handler: Callable[[bytes], object]) -> Callable[[bytes], object]:
        """Decorator: `handler(payload)` gets every broadcast, run in the handler thread pool."""
        pool = self._pool

        async def run_in_pool(payload: bytes) -> None:
            await asyncio.get_running_loop().run_in_executor(pool, handler, payload)

        self._node.on_broadcast(run_in_pool)
        return handler

    def on_survey(self, handler: F) -> F:
        """Decorator: `handler(payload) -> bytes` answers surveys, in the handler thread pool."""
        pool = self._pool

        async def run_in_pool(payload: bytes) -> bytes:
            return await asyncio.get_running_loop().run_in_executor(pool, handler, payload)

        self._node.on_survey(run_in_pool)
        return handler

    def on_tunnel(self, handler: Callable[[Tunnel], object]) -> Callable[[Tunnel], object]:
        """Decorator: `handler(tunnel)` serves each tunnel, in the handler thread pool."""
        pool = self._pool

        async def run_in_pool(tunnel: _tunnel.Tunnel) -> None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(pool, handler, Tunnel(self, tunnel))

        self._node.on_tunnel(run_in_pool)
        return handler

    def request(
        self,
        cluster: str,
        payload: bytes,
        *,
        timeout: float | None = None,
        hedge: float | bool | None = None,
        priority: int = 0,
    ) -> bytes:
        left = time_left()  # called from a handler: within its caller's deadline
        if left is not None:
            if left <= 0:
                raise RequestTimeout(cluster, 0.0, 0)
            timeout = min(self._default_timeout if timeout is None else timeout, left)
        return self._call(
            self._node.request(cluster, payload, timeout=timeout, hedge=hedge, priority=priority)
        )

    def broadcast(self, cluster: str, payload: bytes, *, timeout: float | None = None) -> list[str]:
        return self._call(self._node.broadcast(cluster, payload, timeout=timeout))

    def survey(
        self, cluster: str, payload: bytes, *, timeout: float | None = None
    ) -> _async.SurveyResult:
        return self._call(self._node.survey(cluster, payload, timeout=timeout))

    def wait_for_members(self, cluster: str, count: int = 1, *, timeout: float = 10.0) -> int:
        return self._call(self._node.wait_for_members(cluster, count, timeout=timeout))

    def members(self, cluster: str) -> list[str]:
        return self._call(_wrap(self._node.members, cluster))

    def peers(self) -> list[_async.PeerInfo]:
        return self._call(_wrap(self._node.peers))

    def clusters(self) -> dict[str, tuple[_async.PeerInfo, ...]]:
        """As `irismesh.Node.clusters`: the clusters the keyring opens, with their members."""
        return self._call(_wrap(self._node.clusters))

    def ejected_by(self, clusters: Iterable[str]) -> dict[str, dict[str, tuple[str, ...]]]:
        """As `irismesh.Node.ejected_by`: which callers keep which peers out of rotation."""
        return self._call(_wrap(self._node.ejected_by, list(clusters)))

    def set_split(self, cluster: str, weights: Mapping[str, int], *, timeout: float = 5.0) -> int:
        """As `irismesh.Node.set_split`: the traffic split of `cluster`, for the whole mesh."""
        return self._call(self._node.set_split(cluster, weights, timeout=timeout))

    def clear_split(self, cluster: str, *, timeout: float = 5.0) -> int:
        return self._call(self._node.clear_split(cluster, timeout=timeout))

    def split(self, cluster: str) -> dict[str, int] | None:
        return self._call(_wrap(self._node.split, cluster))

    def split_status(self, cluster: str) -> SplitView:
        return self._call(_wrap(self._node.split_status, cluster))

    def set_clusters(self, clusters: Iterable[str]) -> None:
        """Serve `clusters` from now on instead (`irismesh.Node.set_clusters`)."""
        self._call(_wrap(self._node.set_clusters, list(clusters)))

    def use_keyring(self, keyring: Keyring) -> None:
        self._call(_wrap(self._node.use_keyring, keyring))

    def reload_keyring(self) -> bool:
        return self._call(_wrap(self._node.reload_keyring))

    def key_holders(self) -> list[KeyHolders]:
        return self._call(_wrap(self._node.key_holders))

    def publish(
        self, topic: str, payload: bytes, *, timeout: float | None = None, priority: int = 0
    ) -> int:
        return self._call(self._node.publish(topic, payload, timeout=timeout, priority=priority))

    def subscribe(
        self, pattern: str, *, policy: Policy = "block", maxsize: int = 1024
    ) -> Subscription:
        """A blocking subscription: `for msg in sub`, `sub.get(timeout)`, `with ... as sub`."""
        inner = self._call(_wrap(self._node.subscribe, pattern, policy=policy, maxsize=maxsize))
        return Subscription(self, inner)

    def wait_for_subscribers(self, topic: str, count: int = 1, *, timeout: float = 10.0) -> int:
        return self._call(self._node.wait_for_subscribers(topic, count, timeout=timeout))

    def tunnel(self, cluster: str, *, timeout: float | None = None) -> Tunnel:
        """A blocking tunnel to one member: `send`, `recv`, `send_eof`, `close`, `with`."""

        async def opening() -> _tunnel.Tunnel:
            return await self._node.tunnel(cluster, timeout=timeout)

        return Tunnel(self, self._call(opening()))

    def serve_forever(self) -> None:
        """Block until `close()` is called from another thread or a signal handler."""
        self._closed.wait()

    @property
    def data(self) -> Data:
        """`irismesh.Node.data`, blocking: `node.data.counter("quota.acme").add(1)`."""
        return Data(self)


class Data:
    """The node's replicated data, blocking: each handle's methods as in `irismesh.Node.data`."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def _handle(self, make: Callable[[str], Any], key: str) -> DataHandle:
        return DataHandle(self._node, self._node._call(_wrap(make, key)))

    def counter(self, key: str) -> DataHandle:
        return self._handle(lambda k: self._node._node.data.counter(k), key)

    def set(self, key: str) -> DataHandle:
        return self._handle(lambda k: self._node._node.data.set(k), key)

    def register(self, key: str) -> DataHandle:
        return self._handle(lambda k: self._node._node.data.register(k), key)

    def flag(self, key: str) -> DataHandle:
        return self._handle(lambda k: self._node._node.data.flag(k), key)

    def map(self, key: str) -> DataHandle:
        return self._handle(lambda k: self._node._node.data.map(k), key)

    def watch(self, pattern: str) -> DataWatch:
        """Changes of the keys matching `pattern`: `for change in watch`, `watch.get(timeout)`."""
        inner = self._node._call(_wrap(lambda: self._node._node.data.watch(pattern)))
        return DataWatch(self._node, inner)


class DataHandle:
    """A data key's handle, blocking: `add`, `remove`, `set`, `enable`, `get`... as the
    asyncio handle's, with the same arguments."""

    def __init__(self, node: Node, inner: Any) -> None:
        self._node = node
        self._inner = inner
        self.key: str = inner.key

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._inner, name)

        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._node._call(method(*args, **kwargs))

        return blocking


class _Feed(Generic[T]):
    """What DataWatch and Subscription share: items read with a blocking `get`, iteration
    that ends when the feed or its node closes, and `close` on leaving a `with` block."""

    _inner: Any

    def __init__(self, node: Node, inner: Any) -> None:
        self._node = node
        self._inner = inner
        self.pattern: str = inner.pattern

    def get(self, timeout: float | None = None) -> T:
        raise NotImplementedError

    def __iter__(self) -> Iterator[T]:
        while True:
            try:
                yield self.get()
            except Closed:
                return

    def close(self) -> None:
        if self._node._thread.is_alive():
            self._node._call(_wrap(self._inner.close))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DataWatch(_Feed[Any]):
    """`irismesh.data.DataWatch`, blocking; iteration ends when it or its node closes."""

    def get(self, timeout: float | None = None) -> Any:
        """The next change; Closed once closed and drained, TimeoutError after timeout."""

        async def next_change() -> Any:
            return await asyncio.wait_for(self._inner.get(), timeout)

        return self._node._call(next_change())


async def _wrap(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return fn(*args, **kwargs)


class Subscription(_Feed[_pubsub.Message]):
    """`irismesh.Subscription`, blocking; iteration ends when it or its node closes."""

    _inner: _pubsub.Subscription

    @property
    def missed(self) -> int:
        return self._inner.missed

    def get(self, timeout: float | None = None) -> _pubsub.Message:
        """The next message; Closed once closed and drained, TimeoutError after timeout."""
        return self._node._call(self._inner.get(timeout))


class Tunnel:
    """`irismesh.Tunnel`, blocking."""

    def __init__(self, node: Node, inner: _tunnel.Tunnel) -> None:
        self._node = node
        self._inner = inner
        self.cluster = inner.cluster
        self.peer = inner.peer

    def send(self, data: bytes) -> None:
        self._node._call(self._inner.send(data))

    def recv(self) -> bytes:
        return self._node._call(self._inner.recv())

    def send_eof(self) -> None:
        self._node._call(self._inner.send_eof())

    def close(self) -> None:
        if self._node._thread.is_alive():
            self._node._call(self._inner.close())

    def __iter__(self) -> Iterator[bytes]:
        while True:
            try:
                yield self.recv()
            except EndOfStream:
                return

    def __enter__(self) -> Tunnel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
