"""Independent pandas computations of every Spark job, for the Spark tests to compare against.

Written from the job docstrings, not from jobs.py: plain pandas, exact percentiles
(`inverted_cdf`, the definition `percentile_approx` converges to and meets exactly on small
data), and explicit NaN wherever a ratio has a zero denominator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from irismesh.telemetry.schema import FIELD_NAMES, Record

CALLS = ["request", "publish", "broadcast", "tunnel", "survey"]


def frame(records: Iterable[Record]) -> pd.DataFrame:
    df = pd.DataFrame.from_records(list(records), columns=list(FIELD_NAMES))
    for column in ("latency_us", "size"):
        df[column] = df[column].astype("Int64")
    return df


def _bucket(ts: pd.Series, seconds: int) -> pd.Series:
    return pd.to_datetime(np.floor(ts.to_numpy() / seconds) * seconds, unit="s")


def _wsum(df: pd.DataFrame, mask: pd.Series) -> float:
    return float(df.loc[mask, "weight"].sum())


def overview(df: pd.DataFrame) -> pd.DataFrame:
    call = df["kind"].isin(CALLS)
    row = {
        "records": len(df),
        "events": df["weight"].sum(),
        "nodes": df["node"].nunique(),
        "first_ts": df["ts"].min(),
        "last_ts": df["ts"].max(),
        "calls": _wsum(df, call),
        "failed": _wsum(df, call & (df["outcome"] != "ok")),
    }
    return pd.DataFrame([row])


def throughput(df: pd.DataFrame, bucket: int = 60) -> pd.DataFrame:
    calls = df[df["kind"].isin(CALLS)].copy()
    calls["time"] = _bucket(calls["ts"], bucket)
    rows = []
    for (cluster, pattern, time), g in calls.groupby(["cluster", "pattern", "time"], dropna=False):
        events = g["weight"].sum()
        rows.append(
            {
                "cluster": cluster,
                "pattern": pattern,
                "time": time,
                "events": events,
                "ok": _wsum(g, g["outcome"] == "ok"),
                "bytes": float((g["size"].fillna(0).astype(float) * g["weight"]).sum()),
                "per_second": events / bucket,
            }
        )
    return pd.DataFrame(
        rows, columns=["cluster", "pattern", "time", "events", "ok", "bytes", "per_second"]
    )


def _exact(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q, method="inverted_cdf"))


def _timed(df: pd.DataFrame) -> pd.DataFrame:
    return df[
        df["kind"].isin([*CALLS, "serve", "deliver"])
        & (df["outcome"] == "ok")
        & df["latency_us"].notna()
    ]


def latency_time(df: pd.DataFrame, bucket: int = 60) -> pd.DataFrame:
    timed = _timed(df).copy()
    timed["time"] = _bucket(timed["ts"], bucket)
    rows = []
    for (cluster, kind, time), g in timed.groupby(["cluster", "kind", "time"], dropna=False):
        lat = g["latency_us"].astype(float).to_numpy()
        rows.append(
            {
                "cluster": cluster,
                "kind": kind,
                "time": time,
                "samples": len(g),
                "events": g["weight"].sum(),
                "p50_us": _exact(lat, 0.5),
                "p99_us": _exact(lat, 0.99),
            }
        )
    columns = ["cluster", "kind", "time", "samples", "events", "p50_us", "p99_us"]
    return pd.DataFrame(rows, columns=columns)


def drops(df: pd.DataFrame) -> pd.DataFrame:
    picked = df[df["kind"].isin(["drop", "error"])]
    rows = []
    for (kind, reason, cluster), g in picked.groupby(["kind", "name", "cluster"], dropna=False):
        rows.append(
            {
                "kind": kind,
                "reason": reason,
                "cluster": cluster,
                "events": g["weight"].sum(),
                "records": len(g),
                "nodes": g["node"].nunique(),
                "first_ts": g["ts"].min(),
                "last_ts": g["ts"].max(),
            }
        )
    columns = ["kind", "reason", "cluster", "events", "records", "nodes", "first_ts", "last_ts"]
    return pd.DataFrame(rows, columns=columns)


def latency(df: pd.DataFrame) -> pd.DataFrame:
    timed = _timed(df)
    rows = []
    for (cluster, pattern, kind), g in timed.groupby(["cluster", "pattern", "kind"], dropna=False):
        lat = g["latency_us"].astype(float).to_numpy()
        w = g["weight"].astype(float).to_numpy()
        rows.append(
            {
                "cluster": cluster,
                "pattern": pattern,
                "kind": kind,
                "samples": len(g),
                "events": w.sum(),
                "mean_us": float((lat * w).sum() / w.sum()),
                "p50_us": _exact(lat, 0.5),
                "p95_us": _exact(lat, 0.95),
                "p99_us": _exact(lat, 0.99),
                "max_us": lat.max(),
            }
        )
    columns = ["cluster", "pattern", "kind", "samples", "events", "mean_us"]
    return pd.DataFrame(rows, columns=[*columns, "p50_us", "p95_us", "p99_us", "max_us"])


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def errors(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for cluster, g in df[df["cluster"].notna()].groupby("cluster"):
        call = g["kind"].isin(CALLS)
        calls = _wsum(g, call)
        failed = _wsum(g, call & (g["outcome"] != "ok"))
        timeouts = _wsum(g, call & (g["outcome"] == "timeout"))
        rows.append(
            {
                "cluster": cluster,
                "calls": calls,
                "ok": _wsum(g, call & (g["outcome"] == "ok")),
                "failed": failed,
                "timeouts": timeouts,
                "remote_errors": _wsum(g, call & (g["outcome"] == "remote_error")),
                "no_responders": _wsum(g, call & (g["outcome"] == "no_responders")),
                "overloaded": _wsum(g, call & (g["outcome"] == "overloaded")),
                "drops": _wsum(g, g["kind"] == "drop"),
                "errors": _wsum(g, g["kind"] == "error"),
                "error_rate": _ratio(failed, calls),
                "timeout_rate": _ratio(timeouts, calls),
            }
        )
    return pd.DataFrame(rows)


def _members(df: pd.DataFrame) -> dict[str, set[str]]:
    """cluster -> members: requests' peers, serves' recorders, membership records' peers."""
    members: dict[str, set[str]] = {}
    for kind, column in (("request", "peer"), ("serve", "node"), ("membership", "peer")):
        rows = df[(df["kind"] == kind) & df["cluster"].notna() & df[column].notna()]
        for cluster, member in zip(rows["cluster"], rows[column], strict=True):
            members.setdefault(cluster, set()).add(member)
    return members


def _membership(df: pd.DataFrame) -> pd.DataFrame:
    """Membership records; one without a cluster once per cluster its peer serves (or None)."""
    changes = df[df["kind"] == "membership"]
    serves: dict[str, list[str]] = {}
    for cluster, names in _members(df).items():
        for name in names:
            serves.setdefault(name, []).append(cluster)
    rows = []
    for record in changes.to_dict(orient="records"):
        if record["cluster"] is not None:
            rows.append(record)
        else:
            for cluster in serves.get(record["peer"], [None]):
                rows.append({**record, "cluster": cluster})
    return pd.DataFrame(rows, columns=list(df.columns))


def member_load(df: pd.DataFrame) -> pd.DataFrame:
    members: dict[str, set[str]] = {}
    requests = df[(df["kind"] == "request") & df["cluster"].notna() & df["peer"].notna()]
    for cluster, peer in zip(requests["cluster"], requests["peer"], strict=True):
        members.setdefault(cluster, set()).add(peer)
    serves = df[(df["kind"] == "serve") & df["cluster"].notna()]
    for cluster, node in zip(serves["cluster"], serves["node"], strict=True):
        members.setdefault(cluster, set()).add(node)
    joins = df[(df["kind"] == "membership") & df["cluster"].notna() & df["peer"].notna()]
    for cluster, peer in zip(joins["cluster"], joins["peer"], strict=True):
        members.setdefault(cluster, set()).add(peer)
    load = requests.groupby(["cluster", "peer"])["weight"].sum().to_dict()
    rows = []
    for cluster, names in members.items():
        total = sum(load.get((cluster, m), 0) for m in names)
        for member in names:
            got = load.get((cluster, member), 0)
            rows.append(
                {
                    "cluster": cluster,
                    "member": member,
                    "requests": got,
                    "share": _ratio(got, total),
                }
            )
    return pd.DataFrame(rows, columns=["cluster", "member", "requests", "share"])


def fairness(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for cluster, g in member_load(df).groupby("cluster"):
        x = g["requests"].astype(float).to_numpy()
        n, s, s2 = len(x), x.sum(), (x * x).sum()
        rows.append(
            {
                "cluster": cluster,
                "members": n,
                "requests": s,
                "min_requests": x.min(),
                "max_requests": x.max(),
                "jain_index": _ratio(s * s, n * s2),
                "max_over_mean": _ratio(x.max() * n, s),
            }
        )
    columns = ["cluster", "members", "requests", "min_requests", "max_requests"]
    return pd.DataFrame(rows, columns=[*columns, "jain_index", "max_over_mean"])


def churn(df: pd.DataFrame, bucket: int = 60) -> pd.DataFrame:
    changes = _membership(df)
    changes["time"] = _bucket(changes["ts"], bucket)
    rows = []
    for (cluster, time, event), g in changes.groupby(["cluster", "time", "name"], dropna=False):
        rows.append(
            {
                "cluster": cluster,
                "time": time,
                "event": event,
                "observations": g["weight"].sum(),
                "peers": g["peer"].nunique(),
                "observers": g["node"].nunique(),
            }
        )
    return pd.DataFrame(
        rows, columns=["cluster", "time", "event", "observations", "peers", "observers"]
    )


def events(df: pd.DataFrame, bucket: int = 60) -> pd.DataFrame:
    changes = _membership(df)
    changes["time"] = _bucket(changes["ts"], bucket)
    rows = []
    keys = ["cluster", "peer", "name", "time"]
    for (cluster, peer, event, time), g in changes.groupby(keys, dropna=False):
        rows.append(
            {
                "cluster": cluster,
                "peer": peer,
                "event": event,
                "time": time,
                "first_ts": g["ts"].min(),
                "last_ts": g["ts"].max(),
                "observers": g["node"].nunique(),
            }
        )
    columns = ["cluster", "peer", "event", "time", "first_ts", "last_ts", "observers"]
    return pd.DataFrame(rows, columns=columns)


def top_talkers(df: pd.DataFrame, limit: int = 10) -> pd.DataFrame:
    calls = df[df["kind"].isin(CALLS)]
    rows = []
    for node, g in calls.groupby("node"):
        rows.append(
            {
                "node": node,
                "calls": g["weight"].sum(),
                "bytes": float((g["size"].fillna(0).astype(float) * g["weight"]).sum()),
                "failed": _wsum(g, g["outcome"] != "ok"),
                "clusters": g["cluster"].nunique(),
            }
        )
    out = pd.DataFrame(rows, columns=["node", "calls", "bytes", "failed", "clusters"])
    out = out.sort_values(["calls", "bytes", "node"], ascending=[False, False, True])
    return out.head(limit).reset_index(drop=True)


def totals(df: pd.DataFrame) -> pd.DataFrame:
    out = df.groupby(["kind", "outcome"]).agg(
        records=("weight", "size"),
        events=("weight", "sum"),
        first_ts=("ts", "min"),
        last_ts=("ts", "max"),
    )
    return out.reset_index()


def gauges(df: pd.DataFrame) -> pd.DataFrame:
    g = df[(df["kind"] == "gauge") & df["value"].notna()]
    rows = []
    for name, by_name in g.groupby("name"):
        latest = by_name.sort_values("ts").groupby("node")["value"].last()
        rows.append(
            {
                "name": name,
                "nodes": by_name["node"].nunique(),
                "readings": len(by_name),
                "mean": by_name["value"].mean(),
                "max": by_name["value"].max(),
                "latest_total": latest.sum(),
            }
        )
    return pd.DataFrame(rows, columns=["name", "nodes", "readings", "mean", "max", "latest_total"])


REFERENCES = {
    "overview": overview,
    "totals": totals,
    "throughput": throughput,
    "latency": latency,
    "latency_time": latency_time,
    "errors": errors,
    "drops": drops,
    "fairness": fairness,
    "member_load": member_load,
    "churn": churn,
    "events": events,
    "top_talkers": top_talkers,
    "gauges": gauges,
}


def normalised(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Comparable form: None for every missing value, floats for numbers, sorted by keys."""
    out = df.copy()
    for column in out.columns:
        series = out[column]
        if pd.api.types.is_datetime64_any_dtype(series):
            out[column] = series.astype("datetime64[us]")
        elif pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series):
            out[column] = series.astype(float)
        else:
            out[column] = series.astype(object).where(series.notna(), None)
    if keys:
        out = out.sort_values(list(keys), na_position="first", kind="stable")
    return out.reset_index(drop=True)


def assert_same(actual: pd.DataFrame, expected: pd.DataFrame, keys: Sequence[str]) -> None:
    """The Spark result equals the reference: same rows and columns, floats to 1e-9."""
    assert list(actual.columns) == list(expected.columns)
    a, b = normalised(actual, keys), normalised(expected, keys)
    pd.testing.assert_frame_equal(a, b, check_dtype=False, rtol=1e-9, atol=1e-9)


def rows_of(df: pd.DataFrame) -> list[dict[str, Any]]:
    return list(df.to_dict(orient="records"))
