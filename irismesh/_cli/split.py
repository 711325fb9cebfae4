"""`mesh split`: show, set or clear the traffic split of a cluster, for the whole mesh."""

from __future__ import annotations

import argparse
import datetime

from irismesh._cli.base import (
    MEMBER_WAIT,
    CommandError,
    Commands,
    UsageError,
    add_command,
    add_shared_options,
    client_keyring,
    cluster_client,
    cluster_name,
    print_json,
    settle,
)
from irismesh._core.split import MAX_WEIGHT, check_weights, validate_version
from irismesh.errors import ConfigurationError
from irismesh.patterns.split import SplitView


def register(commands: Commands) -> None:
    parser = add_command(
        commands,
        "split",
        summary="show, set or clear the traffic split of a cluster between its versions",
        description=(
            "Joins the mesh as a client and waits up to --wait seconds for a live member of\n"
            "CLUSTER. With VERSION=WEIGHT pairs it sets the cluster's split for every caller\n"
            "in the mesh: each request goes to a version drawn by these whole-number weights\n"
            "(relative: v1=95 v2=5 sends 5 of each 100 requests to v2), then to a member of\n"
            "it by the usual choice. Members serve as a version with `mesh node --version V`;\n"
            "members without one form the version '' (write it `=5`, or `''=5`). A version\n"
            "with no live member has its share spread over the others; members of versions\n"
            "the split does not name get requests only when no named version has a live\n"
            "member. The cluster's members carry the split on: the command waits up to\n"
            "--timeout seconds until every live member does, and callers apply it within a\n"
            "second. --clear clears it (the usual choice among all members again). With\n"
            "neither, it prints the split and the live members of each version. Exits 1 when\n"
            "the cluster has no member or no member took the split."
        ),
        examples=(
            "  mesh split db v1=95 v2=5\n"
            "  mesh split db\n"
            "  mesh split db v1=100 v2=0     # drain v2\n"
            "  mesh split db =90 canary=10   # members without a version, and canary\n"
            "  mesh split db --clear\n"
            "  mesh split db --json | jq .split"
        ),
        run=run_split,
    )
    parser.add_argument("cluster", type=cluster_name, metavar="CLUSTER")
    parser.add_argument(
        "weights",
        nargs="*",
        type=version_weight,
        metavar="VERSION=WEIGHT",
        help="the share of each version (whole numbers, relative)",
    )
    parser.add_argument("--clear", action="store_true", help="clear the cluster's split")
    add_shared_options(
        parser,
        timeout="most seconds to wait for every member to carry it",
        joining=MEMBER_WAIT,
        json="the split as a JSON object",
    )


def version_weight(text: str) -> tuple[str, int]:
    """VERSION=WEIGHT: '' (or a bare `=W`) names the members without a version."""
    version, equals, weight = text.rpartition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"expected VERSION=WEIGHT, got {text!r}")
    if version in ('""', "''"):
        version = ""
    try:
        validate_version(version)
        value = int(weight)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"the weight of {version!r} must be a whole number, got {weight!r}"
        ) from None
    if not 0 <= value <= MAX_WEIGHT:
        raise argparse.ArgumentTypeError(f"weights are 0 to {MAX_WEIGHT}, got {value}")
    return version, value


async def run_split(args: argparse.Namespace) -> int:
    if args.clear and args.weights:
        raise UsageError("--clear takes no VERSION=WEIGHT pairs")
    weights = dict(args.weights)
    if len(weights) != len(args.weights):
        raise UsageError("a version is named twice")
    if weights:
        check_weights(weights)  # a split that cannot be: say so now, not after joining
    keys = client_keyring(args, args.cluster)
    async with cluster_client(args, keys, args.cluster) as node:
        await settle(node, args.wait)  # every member known: its version, the split it carries
        carrying: int | None = None
        if args.clear:
            carrying = await node.clear_split(args.cluster, timeout=args.timeout)
        elif weights:
            carrying = await node.set_split(args.cluster, weights, timeout=args.timeout)
        if carrying == 0:
            raise CommandError(
                f"no member of {args.cluster!r} took the split within {args.timeout:g} s"
            )
        status = node.split_status(args.cluster)
        if args.json:
            print_json(_as_json(status, carrying))
        else:
            print(_describe(status))
            if carrying is not None:
                members = sum(status.members.values()) + status.other_members
                print(f"carried by {carrying} of {members} live members")
    return 0


def _pairs(weights: dict[str, int]) -> str:
    return " ".join(f"{version or repr('')}={weight}" for version, weight in weights.items())


def _when(stamp: int) -> str:
    moment = datetime.datetime.fromtimestamp(stamp / 1000, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _describe(status: SplitView) -> str:
    if status.weights is None:
        cleared = f" (cleared {_when(status.stamp)})" if status.stamp else ""
        head = f"no split on {status.cluster!r}{cleared}: any live member takes a request"
    else:
        head = f"split of {status.cluster!r}: {_pairs(status.weights)} (set {_when(status.stamp)})"
    counts = [f"{version or repr('')}: {n}" for version, n in status.members.items()]
    if status.other_members or not counts:
        counts.append(f"{'other versions' if counts else 'all'}: {status.other_members}")
    return f"{head}\nlive members by version: {', '.join(counts)}"


def _as_json(status: SplitView, carrying: int | None) -> dict[str, object]:
    found: dict[str, object] = {
        "cluster": status.cluster,
        "split": status.weights,
        "stamp": status.stamp,
        "members": status.members,
        "other_members": status.other_members,
    }
    if carrying is not None:
        found["carried_by"] = carrying
    return found
