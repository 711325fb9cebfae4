"""The one place a SparkSession is made, tuned for a small machine and pinned to loopback.

Spark resolves the machine's name to its outside address unless told otherwise, and this
project's network rules forbid traffic there, so the driver, its block manager and every web
UI bind 127.0.0.1 (`SPARK_LOCAL_IP` for the UIs and the workers it starts, `spark.driver.*`
for the driver). A cluster across machines is opt-in, as for the mesh itself: set
SPARK_LOCAL_IP to the address the other machines reach this one by.

The UI is off. Two shuffle partitions suit telemetry-sized results on a couple of cores (the
default of 200 makes every small aggregation pay for 200 tasks). The JVM flags are chosen by
the caller: quick start (serial GC, C1 JIT only) for tests and small data, throughput for
millions of records. Timestamps are UTC, so minutes and hours mean the same everywhere.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["DEFAULT_MASTER", "JVM_OPTIONS", "THROUGHPUT_JVM_OPTIONS", "make_session"]

DEFAULT_MASTER = "local[*]"
# Quick start for small data (tests, a few thousand records): the serial GC and the C1 JIT
# only. On millions of records C1-only code is several times slower; use THROUGHPUT there.
JVM_OPTIONS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"
THROUGHPUT_JVM_OPTIONS = "-XX:+UseParallelGC"


def make_session(
    master: str = DEFAULT_MASTER,
    *,
    app_name: str = "irismesh-telemetry",
    shuffle_partitions: int = 2,
    driver_memory: str = "1g",
    jvm_options: str = JVM_OPTIONS,
    extra: dict[str, str] | None = None,
) -> SparkSession:
    """A SparkSession on `master` ("local[*]", "local[2]" or "spark://host:port").

    Environment variables are set before the JVM starts, since Spark reads them only then;
    an already running session in this process is returned as is (Spark allows one).
    """
    local_ip = os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers must run this interpreter, which has irismesh and pyarrow installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", local_ip)
        .config("spark.driver.bindAddress", local_ip)
        .config("spark.driver.memory", driver_memory)
        .config("spark.driver.extraJavaOptions", jvm_options)
        .config("spark.executor.extraJavaOptions", jvm_options)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.default.parallelism", str(shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        # Small data: adaptive execution's extra planning rounds cost more than they save.
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
    )
    for key, value in (extra or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session
