"""`mesh keygen`: write a keyring file."""

from __future__ import annotations

import argparse
from pathlib import Path

import irismesh
from irismesh._cli.base import (
    USAGE_ERROR,
    CommandError,
    MeshArgumentParser,
    add_command,
    add_json_option,
    print_json,
)


def register(commands: argparse._SubParsersAction[MeshArgumentParser]) -> None:
    parser = add_command(
        commands,
        "keygen",
        summary="write a new keyring file (mode 0600)",
        description=(
            "Makes a fresh random 32-byte key for each --scope. The scope '*' is the default key\n"
            "for every cluster without one of its own; a scope named after a cluster guards that\n"
            "cluster alone. Every node of a mesh loads the same file (copy it privately)."
        ),
        examples=(
            "  mesh keygen mesh.keys                          # one default key: '*'\n"
            "  mesh keygen mesh.keys --scope '*' --scope db   # and a key of its own for 'db'\n"
            "  export IRISMESH_KEYFILE=$PWD/mesh.keys         # other commands then need no --keys"
        ),
        run=run_keygen,
    )
    parser.add_argument("path", type=Path, metavar="PATH", help="file to write")
    parser.add_argument(
        "--scope",
        action="append",
        metavar="S",
        help="a cluster (or '*') to make a key for; repeatable (default: '*')",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    add_json_option(parser)


def run_keygen(args: argparse.Namespace) -> int:
    path: Path = args.path
    if path.exists() and not args.force:
        raise CommandError(f"{path} already exists: pass --force to replace it", USAGE_ERROR)
    keys = irismesh.Keyring.generate(args.scope or ["*"])
    keys.save(path, overwrite=args.force)
    if args.json:
        scopes = [{"scope": key.scope, "key_id": key.key_id} for key in keys]
        print_json({"path": str(path), "keys": scopes})
    else:
        print(f"wrote {path} with keys for: {', '.join(keys.scopes)}")
    return 0
