"""The pure core: frames, links, membership, pending requests, balancing.

Nothing here imports asyncio or zmq, reads a clock or draws randomness of its own: time and
random bytes are passed in. A test enforces it.
"""
