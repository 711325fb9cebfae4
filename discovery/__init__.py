"""How nodes find candidate peers: static seeds, SURVEY-style multicast polling, and mDNS.

Discovery only yields candidate endpoints; a candidate becomes a peer only after the link
handshake, and liveness comes from the mesh's own heartbeats. The survey also carries each
node's cluster names, sealed for holders of the keys that open them (`sealed`).

The settings (`config`) load with `irismesh`; each mechanism when a node first starts it.
"""

from typing import Any

from irismesh import _lazy


def __getattr__(name: str) -> Any:  # a submodule, as when the package had imported it
    return _lazy.attribute(__name__, name, {})
