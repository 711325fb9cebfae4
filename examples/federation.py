"""Two meshes with different keys, joined by a pair of gateways.

    python examples/federation.py

Mesh "east" runs cluster "db" and cluster "payroll", and publishes prices on `prices.*`; mesh
"west" has its own keyring and cannot join east. A gateway in each mesh links the two, under a
link key of their own: east's gateway exports "db" and `prices.#` (not "payroll"). A client of
west then asks "db" (its members in west are the gateways), streams blocks to a member of
"db" and back through a tunnel, reads east's prices, and finds no "payroll" at all. Everything
runs in this process, on 127.0.0.1. Exits non-zero if anything did not come as promised.
"""

from __future__ import annotations

import hashlib
import os
import sys

import irismesh

os.environ.setdefault("IRISMESH_DISCOVERY", "0")  # each node says whom it joins: two meshes
LOCAL = "tcp://127.0.0.1:0"


async def main() -> int:
    east_keys, west_keys = irismesh.Keyring.generate(), irismesh.Keyring.generate()
    link_keys = irismesh.Keyring.generate()  # `mesh keygen link.keys`, on both gateways only

    async with irismesh.Node("db", keyring=east_keys, bind=LOCAL, name="east-db") as db:
        db.on_request(lambda payload: b"east has " + payload)

        @db.on_tunnel
        async def upper(tunnel: irismesh.Tunnel) -> None:  # each block back in capitals
            async for block in tunnel:
                await tunnel.send(block.upper())
            await tunnel.send_eof()

        east = [db.endpoint]
        async with (
            irismesh.Node("payroll", keyring=east_keys, seeds=east, bind=LOCAL) as payroll,
            irismesh.Node(keyring=east_keys, seeds=east, bind=LOCAL) as publisher,
            irismesh.Gateway(
                "east",
                keyring=east_keys,
                link_keyring=link_keys,
                listen="tcp://127.0.0.1:0",
                export=["db"],
                topics=["prices.#"],
                seeds=east,
                bind=LOCAL,
            ) as east_gateway,
        ):
            payroll.on_request(lambda payload: b"salaries")
            async with irismesh.Gateway(
                "west",
                keyring=west_keys,
                link_keyring=link_keys,
                peers=[east_gateway.endpoint],
                bind=LOCAL,
            ) as west_gateway:
                west = [west_gateway.node.endpoint]
                async with irismesh.Node(keyring=west_keys, seeds=west, bind=LOCAL) as client:
                    await client.wait_for_members("db", timeout=10)
                    reply = await client.request("db", b"k1", timeout=2)
                    print(f"west asked east's db: {reply.decode()!r}")

                    # A tunnel through both gateways, ordered and flow-controlled end to end.
                    blocks = [b"block %d " % i * 1000 for i in range(200)]
                    sent, got = hashlib.sha256(), hashlib.sha256()
                    async with client.tunnel("db", timeout=5) as tunnel:
                        for block in blocks:
                            await tunnel.send(block)
                            sent.update(block.upper())
                        await tunnel.send_eof()
                        size = 0
                        async for block in tunnel:
                            got.update(block)
                            size += len(block)
                    tunneled = sent.digest() == got.digest()
                    print(
                        f"west streamed {size:,} bytes through a tunnel to east's db and back: "
                        + ("in order, intact" if tunneled else "CHANGED")
                    )

                    prices = client.subscribe("prices.#")
                    await west_gateway.node.wait_for_subscribers("prices.eur", timeout=10)
                    await publisher.wait_for_subscribers("prices.eur", timeout=10)
                    for price in (b"1.08", b"1.09", b"1.07"):
                        await publisher.publish("prices.eur", price)
                    seen = [(await prices.get()).payload for _ in range(3)]
                    print(f"west read east's prices in order: {b' '.join(seen).decode()}")

                    try:
                        await client.request("payroll", b"?", timeout=1)
                        print("west reached payroll: it should not have")
                        return 1
                    except irismesh.NoResponders:
                        print("payroll is not exported: west cannot reach it (NoResponders)")
                    stats = west_gateway.stats
                    print(
                        f"west gateway: {stats['requests_forwarded']} request forwarded, "
                        f"{stats['messages_republished']} messages republished, "
                        f"{stats['link_buffered']} buffered"
                    )
                    ok = reply == b"east has k1" and seen == [b"1.08", b"1.09", b"1.07"]
                    ok = ok and tunneled
                    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(irismesh.run(main()))
