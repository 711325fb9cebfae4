"""`mesh authority new`: write an authority key; `mesh grant`: sign a node's grant;
`mesh revoke`: sign a revocation of a node's key and announce it to the mesh; `mesh grants`:
which live nodes hold which rights."""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import sys
import time
from pathlib import Path

from rich.table import Table

from irismesh import _env
from irismesh._cli.base import (
    USAGE_ERROR,
    CommandError,
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
    settle,
    short_id,
    stdout_console,
)
from irismesh._core.rights import REVOCATIONS, Rights
from irismesh.errors import MeshError
from irismesh.security.grants import Authority, parse_duration
from irismesh.security.identity import Identity

GATHER_WAIT = 3.0
AUTHORITY_DEFAULT = "$XDG_CONFIG_HOME/irismesh/authority.key"
SPREAD_WAIT = 1.0  # seconds `mesh revoke` stays: its gossip goes out several times meanwhile


def add_authority_option(parser: MeshArgumentParser) -> None:
    parser.add_argument(
        "--authority",
        type=Path,
        metavar="FILE",
        help=f"the authority key (default: {AUTHORITY_DEFAULT})",
    )


def register(commands: argparse._SubParsersAction[MeshArgumentParser]) -> None:
    actions = add_family(
        commands,
        "authority",
        summary="an authority: the key pair that signs grants and revocations",
        description=(
            "An authority signs grants (what a node may do) and revocations. Nodes trust the\n"
            "authorities their keyring names ('@authority <public key>' lines) and require\n"
            "grants when it says '@require-grants'. Keep the key file private: whoever holds\n"
            "it decides what every node may do."
        ),
        examples="  mesh authority new\n  mesh authority new ops.authority --json",
    )
    new = add_command(
        actions,
        "new",
        summary="write a new authority key file (mode 0600) and print its public key",
        description=(
            "Makes a fresh Ed25519 key pair and writes it to PATH, private to its owner, then\n"
            "prints the keyring line that trusts it."
        ),
        examples=(
            "  mesh authority new                 # ~/.config/irismesh/authority.key\n"
            "  mesh authority new ops.authority"
        ),
        run=run_authority_new,
    )
    add_written_file(new, AUTHORITY_DEFAULT)
    add_json_option(new)

    grant = add_command(
        commands,
        "grant",
        summary="sign a grant of rights to a node's public key",
        description=(
            "Prints (or writes with --out) a grant the authority signs: the node whose public\n"
            "key is PUBKEY (`mesh identity new --json` prints it) may serve and call the\n"
            "clusters named, publish and subscribe under the topic patterns named (deny wins),\n"
            "hold the memory, and as a gateway export and import what is named. The node\n"
            "presents it at every handshake (`mesh node --grant FILE`, IRISMESH_GRANT)."
        ),
        examples=(
            "  mesh grant --serve db --call cache --subscribe 'feeds.#' --expires 30d PUBKEY\n"
            "  mesh grant --call '*' --publish 'feeds.#' --deny-publish 'feeds.admin.#' \\\n"
            "      --out client.grant PUBKEY"
        ),
        run=run_grant,
    )
    grant.add_argument("public", metavar="PUBKEY", help="the node's public key (hex or base64)")
    for flag, help_text in (
        ("--serve", "a cluster the node may serve ('*': every one)"),
        ("--call", "a cluster the node may call ('*': every one)"),
        ("--publish", "a topic pattern the node may publish under"),
        ("--deny-publish", "a topic pattern the node may not publish under (wins)"),
        ("--subscribe", "a topic pattern the node may subscribe to"),
        ("--deny-subscribe", "a topic pattern the node may not subscribe to (wins)"),
        ("--export", "what the node may export as a gateway (a cluster or topic pattern)"),
        ("--import", "what the node may import as a gateway (a cluster or topic pattern)"),
    ):
        grant.add_argument(flag, action="append", default=[], metavar="NAME", help=help_text)
    grant.add_argument("--memory", action="store_true", help="the node may hold the memory")
    grant.add_argument(
        "--expires", default="30d", metavar="DURATION", help="valid for (90s, 12h, 30d; 30d)"
    )
    add_authority_option(grant)
    grant.add_argument("--out", type=Path, metavar="FILE", help="write a grant file here")
    add_json_option(grant)

    revoke = add_command(
        commands,
        "revoke",
        summary="revoke a node's key: its grants issued until now stop working",
        description=(
            "Has the authority sign a revocation of PUBKEY, dated now: every grant of that key\n"
            "issued before stops working. The command joins the mesh and announces it; nodes\n"
            "spread it by membership gossip, and each closes the node's links and refuses it\n"
            "(every node within two seconds). The mesh's memory, if it has one, keeps it for\n"
            "nodes that start later. The node can work again only with a newer grant."
        ),
        examples="  mesh revoke PUBKEY\n  mesh revoke --authority ops.authority PUBKEY --json",
        run=run_revoke,
    )
    revoke.add_argument("public", metavar="PUBKEY", help="the node's public key (hex or base64)")
    add_authority_option(revoke)
    add_joining_options(revoke, wait=GATHER_WAIT, wait_help="most seconds to find the mesh")
    add_json_option(revoke)

    grants = add_command(
        commands,
        "grants",
        summary="list which live nodes hold which rights",
        description=(
            "Joins the mesh as a client, links to every live node membership knows (at most\n"
            "--wait seconds) and prints what each presented at its handshake, as this node\n"
            "verified it: serve and call (clusters), publish and subscribe (topic patterns,\n"
            "'!' before a denied one), memory, and when the grant expires. 'none' is a node\n"
            "without a grant that holds; '-' means this keyring does not require grants."
        ),
        examples="  mesh grants\n  mesh grants --json",
        run=run_grants,
    )
    add_joining_options(grants, wait=GATHER_WAIT, wait_help="most seconds to gather nodes")
    add_json_option(grants, "a JSON list of nodes and their rights")


def public_key(text: str) -> bytes:
    """A 32-byte public key from hex or base64; CommandError otherwise."""
    text = text.strip()
    try:
        key = bytes.fromhex(text) if len(text) == 64 else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        key = b""
    if len(key) != 32:
        raise CommandError(
            f"{text[:70]!r} is not a public key: 64 hex digits or 44 base64 characters",
            USAGE_ERROR,
        )
    return key


def load_authority(path: Path | None) -> Authority:
    return Authority.load(_env.default_authority_file() if path is None else path)


def run_authority_new(args: argparse.Namespace) -> int:
    path = file_to_write(args, _env.default_authority_file)
    authority = Authority.generate()
    authority.save(path, overwrite=args.force)
    public = base64.b64encode(authority.public).decode()
    if args.json:
        print_json({"path": str(path), "public": public})
    else:
        print(f"wrote {path}: trust it with this keyring line\n@authority {public}")
    return 0


def run_grant(args: argparse.Namespace) -> int:
    node = public_key(args.public)
    authority = load_authority(args.authority)
    rights = Rights(
        serve=tuple(args.serve),
        call=tuple(args.call),
        publish=tuple(args.publish),
        publish_deny=tuple(args.deny_publish),
        subscribe=tuple(args.subscribe),
        subscribe_deny=tuple(args.deny_subscribe),
        memory=args.memory,
        gateway_export=tuple(args.export),
        gateway_import=tuple(getattr(args, "import")),
    )
    grant = authority.grant(node, rights, expires_in=parse_duration(args.expires))
    token = base64.b64encode(grant.token).decode()
    if args.out is not None:
        grant.save(args.out)
    if args.json:
        shown: dict[str, object] = {
            "token": token,
            "node": node.hex(),
            "issued": grant.issued,
            "expires": grant.expires,
            "rights": rights.summary(),
        }
        if args.out is not None:
            shown["path"] = str(args.out)
        print_json(shown)
    elif args.out is not None:
        print(f"wrote {args.out}: {len(grant.token)}-byte grant for {node.hex()}", file=sys.stderr)
    else:
        print(token)
    return 0


async def run_revoke(args: argparse.Namespace) -> int:
    node_key = public_key(args.public)
    authority = load_authority(args.authority)
    keys = load_keyring(args.keys)
    if authority.public not in keys.authorities:
        raise CommandError(
            "the keyring does not trust this authority: nodes would ignore its revocation "
            f"(add '@authority {base64.b64encode(authority.public).decode()}' to it)",
            USAGE_ERROR,
        )
    revocation = authority.revoke(node_key)
    # This node's own short grant, so that it may use the memory where grants are required.
    identity = Identity.generate()
    args.identity = identity
    args.grant = authority.grant(
        identity.public, Rights(publish=(REVOCATIONS + ".#",)), expires_in=300
    )
    kept = False
    async with make_node(args, keys) as node:
        await settle(node, args.wait)
        node.revoke(revocation)
        try:
            await node.keep_revocation(revocation)
            kept = True
        except MeshError as exc:
            print(f"mesh: the memory does not keep it ({exc}): gossip alone", file=sys.stderr)
        await asyncio.sleep(SPREAD_WAIT)
    token = base64.b64encode(revocation.token).decode()
    if args.json:
        shown = {"node": node_key.hex(), "before": revocation.before, "kept": kept}
        print_json({**shown, "token": token})
    else:
        print(f"revoked {node_key.hex()}: grants issued before {revocation.before} are void")
    return 0


def _rights_text(rights: dict[str, object] | None) -> str:
    if rights is None:
        return "-"
    if not rights:
        return "none"
    parts = []
    for key, label in (("serve", "serve"), ("call", "call")):
        names = rights.get(key)
        if isinstance(names, list):
            parts.append(f"{label} {','.join(names)}")
    for key, label in (("publish", "pub"), ("subscribe", "sub")):
        allowed = rights.get(key, [])
        denied = rights.get(key + "_deny", [])
        if isinstance(allowed, list) and isinstance(denied, list) and (allowed or denied):
            parts.append(f"{label} {','.join([*allowed, *('!' + d for d in denied)])}")
    if rights.get("memory"):
        parts.append("memory")
    return "; ".join(parts)


async def run_grants(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    async with make_node(args, keys) as node:
        await settle(node, args.wait)
        found = await node.gather_grants(args.wait)
        names = {p.node_id: p.name for p in node.peers()}
    for entry in found:
        entry["name"] = names.get(entry["node_id"], "")
    if args.json:
        print_json(found)
        return 0
    table = grants_table(len(found))
    for entry in sorted(found, key=lambda e: (e["name"], e["node_id"])):
        expires = entry["expires"]
        table.add_row(
            short_id(entry["node_id"]),
            entry["name"] or "-",
            short_id(entry["public"]),
            _rights_text(entry["rights"]),
            "-" if expires is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(expires)),
        )
    stdout_console().print(table)
    return 0


def grants_table(count: int) -> Table:
    table = Table(title=f"grants ({count} nodes)", title_justify="left")
    for column in ("node", "name", "identity", "rights", "expires (UTC)"):
        table.add_column(column, no_wrap=column != "rights")
    return table
