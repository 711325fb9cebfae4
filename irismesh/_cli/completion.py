"""`mesh completion bash|zsh`: a shell completion script made from the parser itself (shtab).

The script is static (commands, flags, choices; files for FILE and DIR arguments), so
completing costs the shell nothing; only context names ask `mesh context ls --names`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import shtab

from irismesh._cli.base import Commands, add_command

SHELLS = ("bash", "zsh")

_PREAMBLE = {
    "bash": '_mesh_contexts() { compgen -W "$(mesh context ls --names 2>/dev/null)" -- "$1"; }\n',
    "zsh": '_mesh_contexts() { compadd -- ${(f)"$(mesh context ls --names 2>/dev/null)"}; }\n',
}
_CONTEXTS = {"bash": "_mesh_contexts", "zsh": "_mesh_contexts"}


def register(commands: Commands) -> None:
    parser = add_command(
        commands,
        "completion",
        summary="print a shell completion script for mesh",
        description=(
            "Completes commands, their flags and choices, file names where a FILE is wanted,\n"
            "and context names. Load it from your shell's startup file."
        ),
        examples=(
            '  eval "$(mesh completion bash)"                       # in ~/.bashrc\n'
            "  mesh completion zsh > ~/.zfunc/_mesh                 # with ~/.zfunc in $fpath\n"
            "  mesh completion bash | sudo tee /etc/bash_completion.d/mesh"
        ),
        run=run_completion,
    )
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")


def script(shell: str, build: Callable[[], argparse.ArgumentParser]) -> str:
    # The whole parser, built afresh by `build` (`irismesh.cli.parser`, which passes itself in
    # the arguments): completion marks are set on its actions, not on the parser `mesh` runs
    # with.
    root = build()
    _mark(root)
    return shtab.complete(root, shell=shell, preamble=_PREAMBLE[shell])


def _mark(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                _mark(sub)
        elif action.dest == "context" and action.option_strings:
            action.complete = _CONTEXTS  # type: ignore[attr-defined]
        elif action.metavar in ("FILE", "PATH"):
            action.complete = shtab.FILE  # type: ignore[attr-defined]
        elif action.metavar == "DIR":
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]


def run_completion(args: argparse.Namespace) -> int:
    print(script(args.shell, args.build_parser), end="")
    return 0
