"""`mesh keygen`: write a keyring file; `mesh keys status`: how far a key rotation has spread;
`mesh identity new`: write a node's identity (its key pair, from which its id derives)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

import irismesh
from irismesh import _env
from irismesh._cli import config
from irismesh._cli.base import (
    MeshArgumentParser,
    add_command,
    add_family,
    add_joining_options,
    add_json_option,
    add_written_file,
    file_to_write,
    load_keyring,
    make_node,
    print_json,
    require_discovery,
    settle,
    stdout_console,
)
from irismesh._cli.listing import nobody_answered
from irismesh.security.identity import Identity


def register(commands: argparse._SubParsersAction[MeshArgumentParser]) -> None:
    parser = add_command(
        commands,
        "keygen",
        summary="write a new keyring file (mode 0600)",
        description=(
            "Makes a fresh random 32-byte key for each --scope. The scope '*' is the default key\n"
            "for every cluster without one of its own; a scope named after a cluster guards that\n"
            "cluster alone. Every node of a mesh loads the same file (copy it privately).\n"
            "Without PATH it writes the default keyring, which every command and every node on\n"
            "this machine then uses when given no other (with --context NAME: that context's)."
        ),
        examples=(
            "  mesh keygen                                    # ~/.config/irismesh/mesh.keys\n"
            "  mesh keygen mesh.keys                          # one default key: '*'\n"
            "  mesh keygen mesh.keys --scope '*' --scope db   # and a key of its own for 'db'\n"
            "  export IRISMESH_KEYFILE=$PWD/mesh.keys         # other commands then use it"
        ),
        run=run_keygen,
    )
    parser.add_argument(
        "--scope",
        action="append",
        metavar="S",
        help="a cluster (or '*') to make a key for; repeatable (default: '*')",
    )
    add_written_file(parser, "the default keyring, $XDG_CONFIG_HOME/irismesh/mesh.keys")
    add_json_option(parser)
    actions = add_family(
        commands,
        "keys",
        summary="who holds which key: the progress of a key rotation",
        description=(
            "Running nodes reread their keyring file when it changes (and on SIGHUP), so a key\n"
            "is rotated by editing the files, in three steps (SECURITY.md): add the new key\n"
            "second, make it first, remove the old one. `mesh keys status` tells when a step\n"
            "has reached every node."
        ),
        examples="  mesh keys status\n  mesh keys status --keys rotating.keys --json",
    )
    status = add_command(
        actions,
        "status",
        summary="for each key of the keyring: how many live nodes hold it, use it first",
        description=(
            "For each key of this keyring (give it both keys while rotating): how many of the\n"
            "live nodes hold it, and how many use it first (their primary for the scope).\n"
            "A node says which keys it holds in its membership record, one tag per key that\n"
            "only a holder of that key can check: a key this keyring lacks is not counted.\n"
            "A step is done when every node shows it: step 1 (new key added) when the new key\n"
            "is held by all; step 2 when all use it first; step 3 when the old key is held by\n"
            "none."
        ),
        examples=(
            "  mesh keys status                      # with the keyring you rotate with\n"
            "  scope  key       primary here  held by  first at\n"
            "  *      3f1c2a9b  yes           4/4      4/4\n"
            "  *      9e07d4c1  no            4/4      0/4"
        ),
        run=run_status,
    )
    add_joining_options(status, wait=3.0, wait_help="most seconds to find the live nodes")
    add_json_option(status)
    identity_actions = add_family(
        commands,
        "identity",
        summary="a node's identity: the key pair its node id derives from",
        description=(
            "A node's id derives from its Ed25519 public key: nobody can link or gossip as the\n"
            "node without its private key. A node given no identity makes a fresh one (a new\n"
            "id each run); one given a file (`mesh node --identity FILE`, IRISMESH_IDENTITY)\n"
            "keeps its id. Each node needs a file of its own: never copy one."
        ),
        examples="  mesh identity new\n  mesh identity new db1.identity",
    )
    new = add_command(
        identity_actions,
        "new",
        summary="write a new identity file (mode 0600) and print its node id",
        description=(
            "Makes a fresh Ed25519 key pair and writes it to PATH, private to its owner.\n"
            "Without PATH it writes the default identity, beside the default keyring; a node\n"
            "uses it when told: `mesh node --identity ~/.config/irismesh/node.identity`."
        ),
        examples=(
            "  mesh identity new                     # ~/.config/irismesh/node.identity\n"
            "  mesh identity new db1.identity --json"
        ),
        run=run_identity_new,
    )
    add_written_file(new, "$XDG_CONFIG_HOME/irismesh/node.identity")
    add_json_option(new)


def run_identity_new(args: argparse.Namespace) -> int:
    path = file_to_write(args, _env.default_identity_file)
    identity = Identity.generate()
    identity.save(path, overwrite=args.force)
    if args.json:
        print_json(
            {"path": str(path), "node_id": identity.node_id.hex(), "public": identity.public.hex()}
        )
    else:
        print(f"wrote {path}: node id {identity.node_id.hex()}")
    return 0


def run_keygen(args: argparse.Namespace) -> int:
    path = file_to_write(args, lambda: default_keyring(getattr(args, "context", None)))
    keys = irismesh.Keyring.generate(args.scope or ["*"])
    keys.save(path, overwrite=args.force)
    if args.json:
        scopes = [{"scope": key.scope, "key_id": key.key_id} for key in keys]
        print_json({"path": str(path), "keys": scopes})
    else:
        print(f"wrote {path} with keys for: {', '.join(keys.scopes)}")
    return 0


def default_keyring(context: str | None) -> Path:
    """The keyring `mesh keygen` writes without PATH: the context's, else the default one."""
    keyring = config.load().get(context).keyring if context is not None else None
    return _env.default_keyfile() if keyring is None else keyring


async def run_status(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    require_discovery(args)
    async with make_node(args, keys) as node:
        peers = await settle(node, args.wait)
        holders = node.key_holders()
    if not peers and args.seed:
        raise nobody_answered(args)
    total = len(peers)
    if args.json:
        rows = [
            {
                "scope": k.scope,
                "key_id": k.key_id,
                "primary": k.primary,
                "holders": k.holders,
                "first": k.first,
            }
            for k in holders
        ]
        print_json({"nodes": total, "keys": rows})
        return 0
    table = Table(box=None, pad_edge=False)
    for column in ("scope", "key", "primary here", "held by", "first at"):
        table.add_column(column)
    for k in holders:
        yes = "yes" if k.primary else "no"
        table.add_row(k.scope, k.key_id, yes, f"{k.holders}/{total}", f"{k.first}/{total}")
    stdout_console().print(table)
    return 0
