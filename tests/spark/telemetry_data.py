"""Data shared by the Spark tests: hand-made edge-case records and the Dataset bundle.

A module of its own (not conftest) so test modules can import it by a name no other test
directory uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from irismesh.telemetry.schema import Record

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

NODE_A, NODE_B, NODE_C = "aa" * 16, "bb" * 16, "cc" * 16
CLIENT_1, CLIENT_2 = "c1" * 16, "c2" * 16
# 2023-11-14 23:55:00 UTC: ten minutes of traffic cross an hour and a date boundary.
START = 1_700_006_100.0


def edge_records() -> list[Record]:
    """Hand-made records for the edge cases, with figures a reader can check by hand.

    - "fair": A served 3 requests (one record of weight 3: sampled), B one; C only joined.
      Requests 3, 1, 0: Jain (4^2)/(3*(9+1)) = 0.5333, max/mean 3/(4/3) = 2.25.
    - "solo": one member, all requests: Jain 1, max/mean 1.
    - "quiet": members but no requests (membership only): rates and fairness NULL.
    - "void": requests to a cluster without members (no_responders, then one the caller's
      throttle turned away: overloaded): error rate 1, and no fairness row (no members).
    - a drop and an error record in "fair"; a late request 2 h before the rest.
    - membership records without a cluster, as real nodes write them: A's death counts for
      "fair" and "quiet" (A serves both), CLIENT_2's leave for no cluster (a pure client);
      a drop without a cluster.
    """
    t = START
    return [
        Record(t + 1, CLIENT_1, "request", "reqrep", "fair", NODE_A, 100, 10, "ok", 3),
        Record(t + 2, CLIENT_1, "request", "reqrep", "fair", NODE_B, 300, 10, "timeout", 1),
        Record(t + 3, CLIENT_2, "membership", "", "fair", NODE_C, name="join"),
        Record(t + 4, CLIENT_2, "drop", "", "fair", None, name="queue_full", weight=7),
        Record(t + 5, CLIENT_2, "error", "", "fair", NODE_B, name="bad_frame"),
        Record(t + 6, CLIENT_2, "request", "reqrep", "solo", NODE_C, 50, 5, "ok", 2),
        Record(t + 61, CLIENT_2, "request", "reqrep", "solo", NODE_C, 70, 5, "ok", 1),
        Record(t + 7, CLIENT_1, "membership", "", "quiet", NODE_A, name="join"),
        Record(t + 8, CLIENT_2, "membership", "", "quiet", NODE_B, name="join"),
        Record(t + 68, CLIENT_2, "membership", "", "quiet", NODE_B, name="dead"),
        Record(t + 9, CLIENT_1, "request", "reqrep", "void", None, 15, 8, "no_responders"),
        Record(t + 9.5, CLIENT_1, "request", "reqrep", "void", None, 1, 8, "overloaded"),
        Record(t - 7200, CLIENT_1, "request", "reqrep", "solo", NODE_C, 60, 5, "ok", 1),
        Record(t + 70, CLIENT_1, "membership", "", None, NODE_A, name="dead"),
        Record(t + 71, CLIENT_1, "membership", "", None, CLIENT_2, name="leave"),
        Record(t + 72, CLIENT_2, "drop", "", None, None, name="slow_consumer", weight=2),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class Dataset:
    """The same records three ways: a list, a pandas frame (reference), Spark (compacted)."""

    records: list[Record]
    frame: Any  # pandas.DataFrame
    df: DataFrame
    parquet: Path
    spool: Path
