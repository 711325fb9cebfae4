"""How nodes find candidate peers: static seeds, SURVEY-style multicast polling, and mDNS.

Discovery only yields candidate endpoints; a candidate becomes a peer only after the link
handshake, and liveness comes from the mesh's own heartbeats. The survey also carries each
node's cluster names, sealed for holders of the keys that open them (`sealed`).
"""
