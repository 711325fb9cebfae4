"""Federations: gateways that join meshes across segments (see `gateway` for the design).

linkproto  the inter-mesh link protocol without I/O: handshake, sealing, sequence, replay
linkwire   what crosses a link: frames, the handshake's messages and keys, items
link       its sockets (pyzmq ROUTER/DEALER on asyncio)
crossing   messages crossing meshes: origin ids, the meshes seen, the duplicate barrier
gateway    `Gateway`: a node of its mesh plus links to peer gateways; its parts:
  state    what a gateway holds
  imports  the clusters its peers export, served in its mesh; their calls passed on
  exports  the calls far gateways pass on, asked in its mesh
  topics   messages crossing from mesh to mesh, republished
  fellows  the other gateways of its mesh
locallink  an in-process link, between gateways of one process
local      `LocalGateways`: gateways of several meshes in one process, joined by in-process links
redundancy redundant gateways: one forwarder of topics per direction, the others standing by
"""

from irismesh.federation.gateway import GATEWAY_CLUSTER, Gateway, far_answers
from irismesh.federation.linkproto import LinkConfig
from irismesh.federation.local import LocalGateways

__all__ = ["GATEWAY_CLUSTER", "Gateway", "LinkConfig", "LocalGateways", "far_answers"]
