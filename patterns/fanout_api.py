"""Broadcasts and surveys: the part of the Node API that reaches every member of a cluster.

`Node` inherits it. Both wait until the node is linked to every member membership knows (within
half of the timeout), then send one copy per member (`Caller.fanout`); a member's broadcast
handler and survey handler run in runners of their own (a survey goes to the request handler
when the member registered none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from irismesh._core.frames import Kind
from irismesh._nodestate import NodeState
from irismesh.errors import ConfigurationError, MeshError
from irismesh.patterns.reqrep import RequestHandler

B = TypeVar("B", bound=Callable[[bytes], Any])
H = TypeVar("H", bound=RequestHandler)


@dataclass(frozen=True, slots=True, kw_only=True)
class SurveyResult:
    """What `Node.survey` gathered: answers by member (hex id), and who did not answer."""

    answers: dict[str, bytes]
    errors: dict[str, MeshError]  # members whose handler raised (RemoteError) or who left
    missing: list[str]  # members that did not answer within the timeout


class FanoutApi(NodeState):
    """Node's methods for broadcasts and surveys."""

    def on_broadcast(self, handler: B) -> B:
        """Decorator: `handler(payload)` (sync or async) gets every broadcast to this member.

        The caller learns that this member received a broadcast once the handler has returned.
        """
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster gets no broadcasts: pass cluster=")
        self._broadcasts.handler = handler
        return handler

    def on_survey(self, handler: H) -> H:
        """Decorator: `handler(payload) -> bytes` answers surveys (default: the request handler)."""
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster answers no surveys: pass cluster=")
        serving = self.recorder.serving if self.recorder is not None else None
        runner = self._serving_runner(serving)
        runner.handler = handler
        self._surveys = runner
        return handler

    async def broadcast(
        self, cluster: str, payload: bytes, *, timeout: float | None = None
    ) -> list[str]:
        """Deliver `payload` once to every live member of `cluster`.

        Returns the hex ids of the members whose broadcast handler ran within `timeout`
        (members that left or timed out are not listed). NoResponders if there is none.
        """
        timeout = await self._linked(cluster, timeout)
        answers, _errors, _missing = await self._caller.fanout(
            Kind.BROADCAST, cluster, payload, timeout
        )
        return sorted(answers)

    async def survey(
        self, cluster: str, payload: bytes, *, timeout: float | None = None
    ) -> SurveyResult:
        """Ask every live member of `cluster`; return as soon as all answered, or at `timeout`."""
        timeout = await self._linked(cluster, timeout)
        answers, errors, missing = await self._caller.fanout(Kind.SURVEY, cluster, payload, timeout)
        return SurveyResult(answers=answers, errors=errors, missing=sorted(missing))
