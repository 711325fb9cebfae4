"""The replicated data's part of the Node API: `node.data`.

`Node` inherits it. The replicas (`data.replicas.NodeData`) are made on first use, on the
node's loop, so a node that never touches shared data pays nothing for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from irismesh.data.replicas import NodeData


class DataApi:
    """Node's replicated data: `node.data.counter(key)`, `.set`, `.register`, `.flag`, `.map`,
    `.watch(pattern)`."""

    _data_replicas: NodeData | None = None

    @property
    def data(self) -> NodeData:
        """Counters, sets, registers, flags and maps shared with every node that holds the
        same keys, converging without a server (a running node, on its loop)."""
        replicas = self._data_replicas
        if replicas is None:
            from irismesh.data.replicas import NodeData

            replicas = self._data_replicas = NodeData(self)  # type: ignore[arg-type]
        return replicas

    def _keep_data(self, memory_store: str) -> None:
        """A memory member holds every key, on disk beside its memory's database."""
        from pathlib import Path

        self.data.keep(Path(memory_store).parent)

    async def _close_data(self) -> None:
        if self._data_replicas is not None:
            await self._data_replicas.close()

    def _data_figures(self) -> dict[str, int]:
        return {} if self._data_replicas is None else self._data_replicas.figures()
