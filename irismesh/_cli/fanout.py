"""`mesh broadcast` and `mesh survey`: one message to every live member of a cluster.

Both commands send to the members that this command's own node knows of when it sends. It is
a new node, so it first waits for a member (up to --wait), then until the members it sees
stop changing: otherwise a member it has not yet heard of would quietly be left out.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from rich.table import Table
from rich.text import Text

import irismesh
from irismesh._cli.base import (
    MEMBER_WAIT,
    SETTLED_FOR,
    CommandError,
    Commands,
    MeshArgumentParser,
    add_command,
    add_json_option,
    add_shared_options,
    client_keyring,
    cluster_name,
    make_node,
    print_json,
    read_payload,
    short_id,
    stderr_console,
    stdout_console,
    wait_for_cluster,
)
from irismesh.errors import MemberLost, MeshError, RemoteError

# An answer in the survey table: at most this many lines of at most this many characters.
ANSWER_LINES = 3
ANSWER_CHARS = 100


def register(commands: Commands) -> None:
    broadcast = add_command(
        commands,
        "broadcast",
        summary="deliver a message to every live member of a cluster",
        description=(
            "Joins the mesh as a client, waits up to --wait seconds for a member of CLUSTER and\n"
            "then until the members it sees stop changing, and sends PAYLOAD (or standard\n"
            "input, for '-') once to each of them. A member counts as reached once its broadcast\n"
            "handler has run (`mesh node` prints the payload), within --timeout seconds. Prints\n"
            "the members reached and those that were not; --json prints an object: cluster,\n"
            "delivered (member ids), count, and missed (members known but not reached). Exits\n"
            "1 if the cluster has no member or no member was reached, 0 if at least one was."
        ),
        examples=(
            "  mesh broadcast echo 'reload config'\n"
            "  date | mesh broadcast echo -\n"
            "  mesh broadcast echo hello --json | jq .count"
        ),
        run=run_broadcast,
    )
    _add_message_arguments(broadcast, "message", "for each member's handler to run")
    add_json_option(broadcast, "a JSON object: cluster, delivered, count, missed")

    survey = add_command(
        commands,
        "survey",
        summary="ask every live member of a cluster and tabulate the answers",
        description=(
            "Joins the mesh as a client, waits up to --wait seconds for a member of CLUSTER and\n"
            "then until the members it sees stop changing, and sends PAYLOAD (or standard\n"
            "input, for '-') to each of them. Waits until every member answered, or --timeout\n"
            "seconds. Prints a table: each member with its answer (UTF-8 text, cut to\n"
            f"{ANSWER_LINES} lines of {ANSWER_CHARS} characters), the error its handler raised, "
            "or 'missing'\n"
            "when it did not answer in time. `mesh node` answers a survey as it answers a\n"
            "request. --json prints an object: cluster, answers (member id -> text, in full),\n"
            "errors (member id -> message) and missing (member ids).\n"
            "Exit status: 0 every member answered; 1 the cluster has no member, or a member\n"
            "errored or is missing (the table or JSON is printed all the same, and a line on\n"
            "stderr says how many did not answer)."
        ),
        examples=(
            "  mesh survey echo status\n"
            "  mesh survey count - --timeout 0.5 < notes.txt\n"
            "  mesh survey echo version --json | jq '.missing'"
        ),
        run=run_survey,
    )
    _add_message_arguments(survey, "question", "for the members to answer")
    add_json_option(survey, "a JSON object: cluster, answers, errors, missing")


def _add_message_arguments(parser: MeshArgumentParser, what: str, waiting: str) -> None:
    parser.add_argument("cluster", type=cluster_name, metavar="CLUSTER")
    parser.add_argument("payload", metavar="PAYLOAD", help=f"the {what}; '-' reads stdin")
    add_shared_options(parser, timeout=f"most seconds to wait {waiting}", joining=MEMBER_WAIT)


# ----------------------------------------------------------------- running


async def run_broadcast(args: argparse.Namespace) -> int:
    keys, payload = _prepare(args)
    async with make_node(args, keys) as node:
        await gather_members(node, args, args.cluster)
        known = node.members(args.cluster)
        delivered = await node.broadcast(args.cluster, payload, timeout=args.timeout)
        endpoints = {p.node_id: p.endpoint for p in node.peers()}
    missed = sorted(set(known) - set(delivered))
    if not delivered:
        raise CommandError(
            f"no member of {args.cluster!r} took the broadcast within {args.timeout:g} s "
            f"({len(missed)} tried: {' '.join(map(short_id, missed))}; a member without a "
            "broadcast handler, or with a slow one, is not reached)"
        )
    if args.json:
        print_json(
            {
                "cluster": args.cluster,
                "delivered": delivered,
                "count": len(delivered),
                "missed": missed,
            }
        )
        return 0
    title = (
        f"broadcast to {args.cluster!r}: delivered to {len(delivered)} of "
        f"{len(delivered) + len(missed)} member(s)"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("node")
    table.add_column("endpoint", no_wrap=True)
    table.add_column("delivered")
    for member in delivered:
        table.add_row(short_id(member), endpoints.get(member, "-"), "[green]yes[/]")
    for member in missed:
        table.add_row(short_id(member), endpoints.get(member, "-"), "[red]no[/]")
    stdout_console().print(table)
    return 0


async def run_survey(args: argparse.Namespace) -> int:
    keys, payload = _prepare(args)
    async with make_node(args, keys) as node:
        await gather_members(node, args, args.cluster)
        result = await node.survey(args.cluster, payload, timeout=args.timeout)
        endpoints = {p.node_id: p.endpoint for p in node.peers()}
    if args.json:
        answers = {m: a.decode(errors="replace") for m, a in sorted(result.answers.items())}
        errors = {m: error_text(e) for m, e in sorted(result.errors.items())}
        missing = result.missing
        print_json(
            {"cluster": args.cluster, "answers": answers, "errors": errors, "missing": missing}
        )
    else:
        stdout_console().print(survey_table(args.cluster, result, endpoints))
    unanswered = len(result.errors) + len(result.missing)
    if unanswered:
        total = unanswered + len(result.answers)
        why = [f"{len(result.errors)} errored"] if result.errors else []
        if result.missing:
            why.append(f"{len(result.missing)} missing (no answer within {args.timeout:g} s)")
        raise CommandError(
            f"{unanswered} of {total} member(s) of {args.cluster!r} did not answer: "
            + ", ".join(why)
        )
    return 0


def _prepare(args: argparse.Namespace) -> tuple[irismesh.Keyring, bytes]:
    """The keyring and the payload, once all that can be checked before joining is checked."""
    return client_keyring(args, args.cluster), read_payload(args.payload)


async def gather_members(node: irismesh.Node, args: argparse.Namespace, cluster: str) -> list[str]:
    """The live members of `cluster` once the mesh seen from here stops changing.

    Waits up to --wait seconds for a first member (CommandError if none), then until the peers
    and the members, each heard from, have not changed for SETTLED_FOR seconds: peers share
    their peer lists, so a newcomer finds one member first and the others a moment later. At
    most --wait seconds more: the members known then are the ones sent to.
    """
    await wait_for_cluster(node, args, cluster)
    deadline = time.monotonic() + args.wait
    seen: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
    changed = time.monotonic()
    with stderr_console().status(f"finding the members of {cluster!r}") as status:
        while True:
            peers = node.peers()
            members = node.members(cluster)
            now = time.monotonic()
            view = (frozenset(p.node_id for p in peers), frozenset(members))
            if view != seen:
                seen, changed = view, now
                status.update(f"finding the members of {cluster!r}: {len(members)} so far")
            heard = all(p.rtt_ms > 0 for p in peers)
            if (heard and now - changed >= SETTLED_FOR) or now >= deadline:
                return members
            await asyncio.sleep(0.02)


# ----------------------------------------------------------------- output


def error_text(error: MeshError) -> str:
    """What went wrong at one member, without the cluster name the table already shows."""
    if isinstance(error, RemoteError):
        return f"{error.remote_type}: {error.remote_message}"
    if isinstance(error, MemberLost):
        return "left before answering"
    return str(error)


def answer_cell(answer: bytes) -> Text:
    """An answer as text for a table cell: printable, at most ANSWER_LINES of ANSWER_CHARS."""
    if not answer:
        return Text("(empty)", style="dim")
    lines = answer.decode(errors="replace").rstrip("\n").split("\n")
    shown = [_printable(line) for line in lines[:ANSWER_LINES]]
    cut = len(lines) > ANSWER_LINES or any(len(line) > ANSWER_CHARS for line in shown)
    text = Text("\n".join(_shorten(line) for line in shown))
    if cut:
        text.append(f" ({len(answer):,} bytes in all)", style="dim")
    return text


def _shorten(line: str) -> str:
    return line if len(line) <= ANSWER_CHARS else line[: ANSWER_CHARS - 1] + "…"


def _printable(line: str) -> str:
    """No terminal control sequences from a remote member reach the user's terminal."""
    line = line.replace("\t", "    ").removesuffix("\r")
    return "".join(c if c.isprintable() else "\ufffd" for c in line)


def survey_table(cluster: str, result: irismesh.SurveyResult, endpoints: dict[str, str]) -> Table:
    total = len(result.answers) + len(result.errors) + len(result.missing)
    title = f"survey of {cluster!r}: {len(result.answers)} of {total} member(s) answered"
    table = Table(title=title, title_justify="left")
    table.add_column("node")
    table.add_column("endpoint", no_wrap=True)
    table.add_column("status")
    table.add_column("answer")
    for member, answer in sorted(result.answers.items()):
        row = (short_id(member), endpoints.get(member, "-"), "[green]answered[/]")
        table.add_row(*row, answer_cell(answer))
    for member, error in sorted(result.errors.items()):
        row = (short_id(member), endpoints.get(member, "-"), "[red]error[/]")
        table.add_row(*row, Text(_printable(error_text(error)), style="red"))
    for member in result.missing:
        row = (short_id(member), endpoints.get(member, "-"), "[yellow]missing[/]")
        table.add_row(*row, Text("no answer in time", style="dim"))
    return table
