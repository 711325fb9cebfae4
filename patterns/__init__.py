"""Messaging patterns over the core: request/reply (and later pub/sub, broadcast, tunnels)."""
