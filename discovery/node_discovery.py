"""A node's discovery: the survey and mDNS it was asked for, started, restarted and heard.

`Node` inherits it. Discovery finds candidates (`_on_candidate`), which membership then dials;
it quiets down once the node has joined (`_live_peers`) and never answers or dials a node the
mesh already holds alive (`_alive_at`). A node asked for no particular discovery runs the
survey by default and goes on without it when it cannot start (`_start_discovery`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from irismesh._core.records import MemberState
from irismesh._nodestate import NodeState
from irismesh.discovery.config import mdns_config, survey_config
from irismesh.errors import ConfigurationError
from irismesh.security.keyring import Keyring

if TYPE_CHECKING:
    from irismesh.discovery.mdns import MdnsDiscovery
    from irismesh.discovery.survey import SurveyDiscovery

_log = logging.getLogger("irismesh.node")


class DiscoveryApi(NodeState):
    """Node's methods that run its discovery."""

    async def _start_all_discovery(self, endpoint: str, *, required: bool) -> None:
        """Start the discovery configured; `required`: failing to start closes the node. Each
        mechanism's module loads here, with the first node that uses it."""
        if self._mdns_config is not None:
            from irismesh.discovery.mdns import MdnsDiscovery

            await self._start_discovery(
                MdnsDiscovery(
                    node_id=self.node_id,
                    endpoint=endpoint,
                    config=self._mdns_config,
                    on_candidate=self._on_candidate,
                ),
                required=required,
            )
        if self._survey_config is not None:
            from irismesh.discovery.survey import SurveyDiscovery

            await self._start_discovery(
                SurveyDiscovery(
                    node_id=self.node_id,
                    endpoint=endpoint,
                    config=self._survey_config,
                    on_candidate=self._on_candidate,
                    keyring=self.keyring,
                    clusters=self.served_clusters,
                    live_peers=self._live_peers,
                    alive=self._alive_at,
                ),
                required=required and self._survey_required,
            )

    def _live_peers(self) -> int:
        """How many other nodes membership holds alive: discovery quiets down once joined."""
        return 0 if self._core is None else len(self._core.membership)

    def _alive_at(self, node_id: bytes, endpoint: str) -> bool:
        """Whether membership holds `node_id` alive at `endpoint` (discovery neither answers
        nor dials a node the mesh already has)."""
        member = None if self._core is None else self._core.membership.get(node_id)
        return (
            member is not None
            and member.state <= MemberState.SUSPECT
            and member.record.endpoint == endpoint
        )

    def _rediscover(self, keyring: Keyring) -> None:
        """Discovery seals cluster names under their keys: the running survey takes the new
        keyring. And it tags what it sends with the '*' key: after a rotation of that key,
        start it again with the new one (a node that starts with only the new key must find
        us)."""
        for running in surveys(self._discovery):  # cluster names: sealed, opened with new keys
            running.use_keyring(keyring)
        survey, mdns, where = self._discovery_asked
        configs = (survey_config(survey, keyring, where), mdns_config(mdns, keyring, where))
        if configs == (self._survey_config, self._mdns_config):
            return
        self._survey_config, self._mdns_config = configs
        if self._loop is None or self._closing:
            return
        previous = self._rediscovering

        async def restart() -> None:
            if previous is not None:
                await previous
            running, self._discovery = self._discovery, []
            for discovery in running:
                await discovery.close()
            if not self._closing:
                await self._start_all_discovery(self.endpoint, required=False)

        self._rediscovering = self._loop.create_task(restart())

    async def _start_discovery(
        self, discovery: MdnsDiscovery | SurveyDiscovery, *, required: bool = True
    ) -> None:
        self._discovery.append(discovery)
        try:
            await discovery.start()
        except ConfigurationError as exc:
            if required:
                await self.close()
                raise
            # Discovery by default only: a node with seeds works without it, so go on.
            self._discovery.remove(discovery)
            _log.warning("default discovery is off for this node: %s", exc)
        except BaseException:
            await self.close()
            raise

    def _on_candidate(self, node_id: bytes, endpoint: str) -> None:
        if self._core is None or self._driver is None or self._closing:
            return
        self._core.add_candidate(endpoint, time.monotonic())
        self._driver.process()


def surveys(running: Sequence[MdnsDiscovery | SurveyDiscovery]) -> list[SurveyDiscovery]:
    """The surveys among a node's running discovery (none running: nothing is loaded)."""
    if not running:
        return []
    from irismesh.discovery.survey import SurveyDiscovery

    return [discovery for discovery in running if isinstance(discovery, SurveyDiscovery)]
