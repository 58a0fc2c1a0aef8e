"""Writing job results: a single CSV file and a Parquet directory per output.

Spark writes a directory of part files; operators and the contract want one file named
``relay_latency.csv``. So each result is coalesced to one partition, written to a scratch
directory beside the destination and its part file renamed through the Hadoop FileSystem
API, which works the same on a local disk, HDFS or an object store.
"""

from __future__ import annotations

import uuid

from pyspark.sql import DataFrame

from analytics.hadoop import HadoopFS


def write_csv(df: DataFrame, output_dir: str, name: str) -> str:
    """Write ``df`` as ``<output_dir>/<name>.csv`` with a header row, even when empty."""
    fs = HadoopFS(df.sparkSession)
    destination = fs.child(output_dir, f"{name}.csv")
    scratch = fs.child(output_dir, f"_tmp_{name}_{uuid.uuid4().hex}")
    try:
        df.coalesce(1).write.mode("overwrite").option("header", True).csv(scratch)
        parts = [path for path in fs.list_files(scratch) if fs.name(path).startswith("part-")]
        if parts:
            fs.move(parts[0], destination)
        else:
            fs.write_bytes(destination, (",".join(df.columns) + "\n").encode())
    finally:
        fs.delete(scratch)
    return destination


def write_parquet(df: DataFrame, output_dir: str, name: str) -> str:
    """Write ``df`` as the Parquet directory ``<output_dir>/<name>.parquet`` (one file)."""
    destination = HadoopFS(df.sparkSession).child(output_dir, f"{name}.parquet")
    df.coalesce(1).write.mode("overwrite").parquet(destination)
    return destination


def write_outputs(outputs: dict[str, DataFrame], output_dir: str) -> dict[str, int]:
    """Write every named result as CSV and Parquet; return the row count of each.

    Results are small (a row per relay, platform or relay-hour) but each write would
    recompute them from the observations, so they are cached for the two writes and left
    cached for the report; the caller unpersists them.
    """
    if not outputs:
        return {}
    HadoopFS(next(iter(outputs.values())).sparkSession).mkdirs(output_dir)
    rows = {}
    for name, df in outputs.items():
        df.cache()
        rows[name] = df.count()
        write_csv(df, output_dir, name)
        write_parquet(df, output_dir, name)
    return rows
