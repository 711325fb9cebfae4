"""`mesh context add|ls|use|rm`: named places to join (a keyring, seeds, an interface)."""

from __future__ import annotations

import argparse
from pathlib import Path

from irismesh._cli import config
from irismesh._cli.base import (
    Commands,
    UsageError,
    add_command,
    add_family,
    add_repeatable,
    add_shared_options,
    print_json,
    seed_endpoint,
    stdout_console,
)
from irismesh.errors import ConfigurationError

NO_CONTEXTS = "no contexts yet: `mesh context add NAME --keys FILE --seed ENDPOINT` makes one"


def register(commands: Commands) -> None:
    actions = add_family(
        commands,
        "context",
        summary="name the meshes you join: a keyring, seeds, an interface each",
        description=(
            "A context is a named set of joining options kept in the config file\n"
            "($IRISMESH_CONFIG, else $XDG_CONFIG_HOME/irismesh/config.toml, i.e.\n"
            "~/.config/irismesh/config.toml). `mesh --context NAME COMMAND` takes its\n"
            "keyring, seeds and interface; `mesh context use NAME` makes it the current one,\n"
            "which every command takes unless told otherwise. Flags always win; a context\n"
            "named with --context wins over IRISMESH_KEYFILE and IRISMESH_INTERFACE, the\n"
            "current context does not. IRISMESH_SEEDS are added to any context's seeds."
        ),
        examples=(
            "  mesh context add prod --keys /etc/irismesh/prod.keys --seed tcp://10.0.0.5:7400\n"
            "  mesh context ls\n"
            "  mesh --context prod request db k\n"
            "  mesh context use prod                 # then: mesh request db k\n"
            "  mesh context use --none               # back to the defaults\n"
            "  mesh context rm prod"
        ),
    )
    add = add_command(
        actions,
        "add",
        summary="add a context (or replace one, with --force)",
        description=(
            "Stores an absolute path to the keyring (it need not exist yet: `mesh keygen\n"
            "PATH` writes it), the seeds and the interface."
        ),
        examples="  mesh context add prod --keys prod.keys --seed tcp://10.0.0.5:7400 --use",
        run=run_add,
    )
    add.add_argument("name", metavar="NAME", type=_name)
    add.add_argument("--keys", type=Path, metavar="FILE", help="the context's keyring file")
    add_repeatable(
        add,
        "--seed",
        type=seed_endpoint,
        metavar="ENDPOINT",
        help="tcp://HOST:PORT of a node to join through (repeatable)",
    )
    add.add_argument("--interface", metavar="ADDRESS", help="discover nodes on this interface")
    add.add_argument("--use", action="store_true", help="make it the current context too")
    add.add_argument("--force", action="store_true", help="replace a context of this name")
    listing = add_command(
        actions,
        "ls",
        summary="list the contexts; * marks the current one",
        description="Shows each context's keyring, seeds and interface.",
        examples="  mesh context ls\n  mesh context ls --json",
        run=run_ls,
    )
    listing.add_argument("--names", action="store_true", help="only the names, one a line")
    add_shared_options(listing, json="JSON for scripts")
    use = add_command(
        actions,
        "use",
        summary="make a context the current one",
        description="Every command then takes its settings, unless --context names another.",
        examples="  mesh context use prod\n  mesh context use --none",
        run=run_use,
    )
    use.add_argument("name", metavar="NAME", nargs="?", type=_name)
    use.add_argument("--none", action="store_true", help="no current context")
    remove = add_command(
        actions,
        "rm",
        summary="remove a context",
        description="Removes it from the config file (the keyring file stays).",
        examples="  mesh context rm prod",
        run=run_rm,
    )
    remove.add_argument("name", metavar="NAME", type=_name)


def _name(text: str) -> str:
    try:
        return config.check_name(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_add(args: argparse.Namespace) -> int:
    settings = config.load()
    if args.name in settings.contexts and not args.force:
        raise UsageError(
            f"context {args.name!r} already exists in {settings.path}: pass --force to replace it"
        )
    if args.interface is not None:
        config.check_interface(args.interface)
    keyring = None if args.keys is None else Path(args.keys).expanduser().absolute()
    seeds = tuple(dict.fromkeys(args.seed))
    context = config.Context(name=args.name, keyring=keyring, seeds=seeds, interface=args.interface)
    settings.contexts[args.name] = context
    if args.use:
        settings.current = args.name
    settings.save()
    current = " (current)" if settings.current == args.name else ""
    print(f"context {args.name!r}{current} saved in {settings.path}")
    return 0


def run_ls(args: argparse.Namespace) -> int:
    settings = config.load()
    contexts = sorted(settings.contexts.values(), key=lambda c: c.name)
    if args.names:
        for context in contexts:
            print(context.name)
    elif args.json:
        print_json(
            [
                {
                    "name": c.name,
                    "current": c.name == settings.current,
                    "keyring": None if c.keyring is None else str(c.keyring),
                    "seeds": list(c.seeds),
                    "interface": c.interface,
                }
                for c in contexts
            ]
        )
    elif not contexts:
        print(NO_CONTEXTS)
    else:
        from rich.table import Table

        table = Table(title=f"contexts ({len(contexts)}) in {settings.path}", title_justify="left")
        for column in ("", "name", "keyring", "seeds", "interface"):
            table.add_column(column)
        for c in contexts:
            table.add_row(
                "*" if c.name == settings.current else "",
                c.name,
                "-" if c.keyring is None else str(c.keyring),
                " ".join(c.seeds) or "-",
                c.interface or "-",
            )
        stdout_console().print(table)
    return 0


def run_use(args: argparse.Namespace) -> int:
    if (args.name is None) == (not args.none):
        raise UsageError("pass a context NAME, or --none for no current context")
    settings = config.load()
    if args.name is not None:
        settings.get(args.name)  # it must exist
    settings.current = args.name
    settings.save()
    if args.name is None:
        print("no current context: commands take flags, the environment and the defaults")
    else:
        print(f"current context: {args.name!r}")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    settings = config.load()
    settings.get(args.name)
    del settings.contexts[args.name]
    if settings.current == args.name:
        settings.current = None
    settings.save()
    print(f"context {args.name!r} removed from {settings.path}")
    return 0
