"""`mesh`: the command-line tool (also `python -m irismesh`).

Every command that talks to the mesh runs a node of its own. Errors a user can cause are one
line on stderr, `mesh: ...`, with exit status 2 (arguments, files, keys) or 1 (the mesh said
no: no member, a timeout, a remote error); never a traceback. The commands live in
`irismesh._cli`, one module per family; this module builds the parser and draws the error
boundary.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import irismesh
from irismesh._cli import (
    bench,
    completion,
    context,
    data,
    fanout,
    gateway,
    grants,
    keys,
    listing,
    memory,
    pubsub,
    request,
    serve,
    split,
    telemetry,
    top,
    tunnel,
)
from irismesh._cli.base import (
    MESH_ERROR,
    USAGE_ERROR,
    CommandError,
    MeshArgumentParser,
    add_context_option,
    apply_settings,
)
from irismesh._exit import end_process
from irismesh._loop import run
from irismesh.errors import ConfigurationError, MeshError

# In `mesh --help` order; `telemetry collect` will join with publish/subscribe.
FAMILIES = (
    keys,
    grants,
    serve,
    gateway,
    request,
    fanout,
    split,
    pubsub,
    memory,
    data,
    tunnel,
    listing,
    top,
    bench,
    telemetry,
    context,
    completion,
)

EXAMPLES = """five-minute tour (four terminals: two members, a subscriber, and commands):
  mesh keygen                        # the default keyring, ~/.config/irismesh/mesh.keys
  mesh node --cluster echo --prefix A:
  mesh node --cluster echo --prefix B:
  mesh request echo hello
  mesh broadcast echo 'to everyone'
  mesh survey echo 'who is there?'
  mesh subscribe 'feeds.#'
  mesh publish feeds.world.42 'Hello'
  echo hello | mesh tunnel echo
  mesh peers
  mesh top

Nodes on one machine find each other (discovery on 127.0.0.1). Across machines: --seed
tcp://HOST:PORT and --interface ADDRESS, or a context (`mesh context add`, `--context NAME`).

Telemetry: mesh telemetry report --spool DIR --out DIR (needs PySpark and Java).

Every command that prints a report or messages takes --json (`mesh tunnel`'s stdout is the
stream itself). `mesh COMMAND --help` explains each one.
Exit status: 0 done, 1 the mesh said no, 2 bad arguments or files, 130 interrupted.
"""


def parser() -> MeshArgumentParser:
    root = MeshArgumentParser(
        prog="mesh",
        description="irismesh: a brokerless service mesh. Each command joins the mesh as a node.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    root.add_argument("--version", action="version", version=irismesh.__version__)
    add_context_option(root)
    root.set_defaults(build_parser=parser)  # `mesh completion` builds the whole parser again
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in FAMILIES:
        family.register(commands)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if hasattr(args, "seed") and hasattr(args, "no_discovery"):  # a command that joins
            apply_settings(args)
        status = args.run(args)
        if inspect.iscoroutine(status):
            status = run(status)
        assert isinstance(status, int)
        return status
    except CommandError as exc:
        _fail(str(exc))
        return exc.status
    except ConfigurationError as exc:  # NoKey included
        _fail(str(exc))
        return USAGE_ERROR
    except MeshError as exc:
        _fail(str(exc))
        return MESH_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`mesh request ... --count 100 | head -1`): stop quietly, and
        # keep Python from complaining again while it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return MESH_ERROR


def command() -> NoReturn:
    """The `mesh` command: `main`, then the process ends (`irismesh._exit.end_process`)."""
    end_process(main())


def _fail(message: str) -> None:
    # One line, whatever the message holds: scripts read stderr line by line.
    print(f"mesh: {' '.join(message.split())}", file=sys.stderr, flush=True)
