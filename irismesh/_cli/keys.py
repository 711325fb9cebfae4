"""`mesh keygen`: write a keyring file."""

from __future__ import annotations

import argparse
from pathlib import Path

import irismesh
from irismesh import _env
from irismesh._cli import config
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
        "path",
        type=Path,
        nargs="?",
        metavar="PATH",
        help="file to write (default: the default keyring, $XDG_CONFIG_HOME/irismesh/mesh.keys)",
    )
    parser.add_argument(
        "--scope",
        action="append",
        metavar="S",
        help="a cluster (or '*') to make a key for; repeatable (default: '*')",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    add_json_option(parser)


def run_keygen(args: argparse.Namespace) -> int:
    path: Path | None = args.path
    if path is None:
        named = getattr(args, "context", None)
        keyring = config.load().get(named).keyring if named is not None else None
        path = _env.default_keyfile() if keyring is None else keyring
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
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
