"""Creating (or reusing) the SparkSession the jobs run in."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
APP_NAME = "sigil-push analytics"
# A local driver is also the only executor: give it room to cache a day of observations.
LOCAL_DRIVER_MEMORY = "4g"
# Spark's default of 200 shuffle partitions is sized for clusters; on a laptop's few cores
# the per-task overhead of 200 tiny tasks dominates the small aggregations here.
LOCAL_SHUFFLE_PARTITIONS = "8"


def _under_spark_submit() -> bool:
    """True when spark-submit launched this Python process (it hands over its JVM gateway)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


@contextmanager
def analytics_session(master: str | None) -> Iterator[SparkSession]:
    """Yield a SparkSession for the jobs, stopping it afterwards only if we started it.

    An already active session (tests, notebooks, an embedding application) is reused as is,
    so ``master`` is ignored then. Without an explicit master, spark-submit's own choice wins;
    a plain ``python`` process falls back to ``local[*]``.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        active.conf.set("spark.sql.session.timeZone", "UTC")
        yield active
        return
    if master is None and not _under_spark_submit():
        master = DEFAULT_MASTER
    builder = (
        SparkSession.builder.appName(APP_NAME)
        .config("spark.sql.session.timeZone", "UTC")
        # Progress is reported per job on stderr; Spark's redrawn bar would garble it.
        .config("spark.ui.showConsoleProgress", "false")
        # Let adaptive execution coalesce the shuffles of cached intermediate results too.
        .config("spark.sql.optimizer.canChangeCachedPlanOutputPartitioning", "true")
    )
    if master is not None:
        builder = builder.master(master)
        if master.startswith("local"):
            # Executors are threads of this process: loopback is enough and needs no DNS.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            builder = builder.config("spark.driver.memory", LOCAL_DRIVER_MEMORY).config(
                "spark.sql.shuffle.partitions", LOCAL_SHUFFLE_PARTITIONS
            )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    try:
        yield spark
    finally:
        spark.stop()
