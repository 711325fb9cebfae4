"""How nodes find candidate peers: static seeds and SURVEY-style multicast polling.

Discovery only yields candidate endpoints; a candidate becomes a peer only after the link
handshake, and liveness comes from the mesh's own heartbeats.
"""
