"""Reading the observation log (CONTRACT section 6) with an explicit schema.

The log is a folder of newline-delimited JSON files named ``observations-YYYYMMDDTHH.jsonl``
(optionally ``.gz``) after the UTC hour of their records; the workers of a multi-worker
instance name theirs ``observations-<worker>-YYYYMMDDTHH.jsonl``, in one shared folder or in a
folder each under a common parent, and every file found below ``--input`` is read. The file names are the time
partitioning: a ``--since``/``--until`` run lists the folder and opens only the hours it
needs, then also filters rows by ``ts``. Lines that are not valid records are counted, never
fatal: the log is written by a long-running service that may be killed mid-line.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import reduce

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from analytics.duration import DEFAULT_GRACE_MS
from analytics.hadoop import HadoopFS
from analytics.preflight import InputError, check_window, to_epoch_ms

HOUR_MS = 3_600_000
CORRUPT_COLUMN = "_corrupt_record"

SCHEMA = StructType(
    [
        StructField("type", StringType()),
        StructField("ts", LongType()),
        StructField("relay", StringType()),
        StructField("event_id", StringType()),
        StructField("kind", LongType()),
        StructField("created_at", LongType()),
        StructField("state", StringType()),
        StructField("platform", StringType()),
        StructField("status", StringType()),
        # Double, not long: a writer that reports fractional milliseconds must not turn
        # otherwise good push records into corrupt lines.
        StructField("latency_ms", DoubleType()),
        # expect: the recipient's inbox relays that were connected when the DM was handled.
        StructField("relays", ArrayType(StringType())),
        # canary: whether the probe was accepted, the relay's OK message, and when it came
        # back through the bridge's own subscription (ms after publishing; null if never).
        StructField("published", BooleanType()),
        StructField("ok_message", StringType()),
        StructField("received_ms", DoubleType()),
        # suppressed: why a verified event woke no device (the recipient's own choices or
        # limits), and its notification class (absent before issue 32: a DM)
        StructField("reason", StringType()),
        StructField("class", StringType()),
        StructField(CORRUPT_COLUMN, StringType()),
    ]
)

# Fields without which a record of a known type cannot be used; such lines count as corrupt.
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "seen": ("ts", "relay", "event_id"),
    "relay": ("ts", "relay", "state"),
    "push": ("ts", "event_id", "platform", "status"),
    "expect": ("ts", "event_id", "relays"),
    "canary": ("ts", "relay", "event_id", "published"),
    "suppressed": ("ts", "event_id", "reason"),
}

_FILE_NAME = re.compile(r"^observations-(?:[A-Za-z0-9._-]+-)?(\d{8}T\d{2})\.jsonl(?:\.gz)?$")
_LOG_SUFFIXES = (".jsonl", ".jsonl.gz")


def file_hour_ms(name: str) -> int | None:
    """Start of the UTC hour a log file holds, from its name; None if the name has no hour."""
    match = _FILE_NAME.match(name)
    if match is None:
        return None
    hour = datetime.strptime(match.group(1), "%Y%m%dT%H").replace(tzinfo=UTC)
    return to_epoch_ms(hour)


def select_files(
    fs: HadoopFS, input_path: str, since_ms: int | None, until_ms: int | None
) -> list[str]:
    """The log files below ``input_path`` (sub-folders too: one per worker) that may hold
    records in ``[since, until)``, in path order.

    Files whose name carries no hour are kept (they cannot be pruned, the row filter still
    applies); anything that is not ``.jsonl``/``.jsonl.gz`` (temporary files, checksums) is not
    part of the log.
    """
    if not fs.exists(input_path):
        raise InputError(f"--input: {input_path} does not exist")
    if fs.is_file(input_path):
        return [input_path]
    selected = []
    for path in sorted(fs.list_tree(input_path)):
        name = fs.name(path)
        if name.startswith((".", "_")) or not name.endswith(_LOG_SUFFIXES):
            continue
        hour = file_hour_ms(name)
        if hour is not None:
            if since_ms is not None and hour + HOUR_MS <= since_ms:
                continue
            if until_ms is not None and hour >= until_ms:
                continue
        selected.append(path)
    return selected


def _validity() -> Column:
    """True for a usable record, False for a corrupt one, null for a type we do not know.

    Unknown types are skipped rather than counted as corrupt so that newer record types do not
    make an older analytics build report a broken log.
    """
    unreadable = F.col("type").isNull() | F.col(CORRUPT_COLUMN).isNotNull()
    validity = F.when(unreadable, F.lit(False))
    for record_type, fields in REQUIRED_FIELDS.items():
        present = reduce(operator.and_, [F.col(name).isNotNull() for name in fields])
        validity = validity.when(F.col("type") == record_type, present)
    return validity


@dataclass
class Observations:
    """The parsed records of one analytics window, and what reading them cost.

    ``start_ms``/``end_ms`` bound the window: ``--since``/``--until`` when given, else the
    first record and just after the last one. They are None only when there is no data.
    ``grace_ms`` is ``--grace``: how long after an event's first arrival a relay may deliver
    it and still count as having delivered it.
    """

    spark: SparkSession
    records: DataFrame
    files_read: int
    records_read: int
    corrupt_lines: int
    records_in_window: int
    start_ms: int | None
    end_ms: int | None
    grace_ms: int = DEFAULT_GRACE_MS
    _cached: list[DataFrame] = field(default_factory=list, repr=False)
    _deliveries: DataFrame | None = field(default=None, repr=False)
    _relay_states: DataFrame | None = field(default=None, repr=False)

    def of_type(self, record_type: str, *columns: str | Column) -> DataFrame:
        return self.records.where(F.col("type") == record_type).select(*columns)

    @property
    def seen(self) -> DataFrame:
        return self.of_type("seen", "relay", "event_id", "ts", "kind", "created_at")

    @property
    def relay_states(self) -> DataFrame:
        """The relay state records: few, but read several times, so cached on first use."""
        if self._relay_states is None:
            self._relay_states = self.cache(self.of_type("relay", "relay", "ts", "state"))
        return self._relay_states

    @property
    def pushes(self) -> DataFrame:
        return self.of_type("push", "event_id", "platform", "status", "ts", "latency_ms")

    @property
    def suppressions(self) -> DataFrame:
        """``event_id, reason, class``: events that woke no device by their recipients'
        choice or limits; a record without a class (written before issue 32) is a DM's."""
        return self.of_type(
            "suppressed", "event_id", "reason",
            F.coalesce(F.col("class"), F.lit("dm")).alias("class"),
        )

    @property
    def expects(self) -> DataFrame:
        """``event_id, relay``: each relay some ``expect`` record lists as an inbox of the DM.

        A DM handled twice (a restart, a second worker) may have several records; a relay
        counts once per event. Blank entries are dropped.
        """
        relays = self.of_type("expect", "event_id", F.explode("relays").alias("relay"))
        return relays.where(F.col("relay").isNotNull() & (F.col("relay") != "")).distinct()

    @property
    def canaries(self) -> DataFrame:
        return self.of_type(
            "canary", "relay", "event_id", "ts", "published", "ok_message", "received_ms"
        )

    def deliveries(self) -> DataFrame:
        """One row per (relay, event) the relay delivered, with the event's first arrival.

        Columns: relay, event_id, ts (this relay's first delivery), kind, created_at,
        first_ts (earliest ``ts`` of the event over all relays) and first (true on exactly
        one row per event: the earliest delivery, ties broken by relay). Shared by the
        latency and dropped-events jobs, so it is computed once and cached.
        """
        if self._deliveries is None:
            # Canary probes are the bridge's own test messages, measured by the canary job:
            # were a bridge to log their `seen` records, they must not count as DMs that
            # every other relay missed.
            probes = self.canaries.select("event_id").distinct()
            dms = self.seen.join(probes, "event_id", "left_anti")
            # Repartitioning by event first lets the dedup and the window share one shuffle.
            per_relay = (
                dms.repartition("event_id")
                .groupBy("event_id", "relay")
                .agg(
                    F.min("ts").alias("ts"),
                    F.min_by("kind", "ts").alias("kind"),
                    F.min_by("created_at", "ts").alias("created_at"),
                )
            )
            by_arrival = Window.partitionBy("event_id").orderBy("ts", "relay")
            self._deliveries = self.cache(
                per_relay.withColumn("first_ts", F.first("ts").over(by_arrival)).withColumn(
                    "first", F.row_number().over(by_arrival) == 1
                )
            )
        return self._deliveries

    def cache(self, df: DataFrame) -> DataFrame:
        """Persist an intermediate result that several steps reuse, until ``release``."""
        persisted = df.persist(StorageLevel.MEMORY_AND_DISK)
        self._cached.append(persisted)
        return persisted

    def release(self) -> None:
        """Drop the cached data; the session may outlive this run (tests, notebooks)."""
        for frame in self._cached:
            frame.unpersist()
        self._cached.clear()
        self._deliveries = self._relay_states = None


def _read(spark: SparkSession, files: list[str]) -> DataFrame:
    if not files:
        return spark.createDataFrame([], SCHEMA)
    return (
        spark.read.schema(SCHEMA)
        .option("mode", "PERMISSIVE")
        .option("columnNameOfCorruptRecord", CORRUPT_COLUMN)
        .json(files)
    )


def load_observations(
    spark: SparkSession,
    input_path: str,
    since: datetime | None = None,
    until: datetime | None = None,
    grace_ms: int = DEFAULT_GRACE_MS,
) -> Observations:
    """Read the log under ``input_path`` for ``[since, until)`` and count what was read.

    The parsed lines are cached (one JSON parse serves every job); the counting pass that
    fills the cache also yields the corrupt-line count and the bounds of the window.
    """
    since_ms = None if since is None else to_epoch_ms(since)
    until_ms = None if until is None else to_epoch_ms(until)
    check_window(since_ms, until_ms)
    files = select_files(HadoopFS(spark), input_path, since_ms, until_ms)
    in_window = F.lit(True)
    if since_ms is not None:
        in_window = in_window & (F.col("ts") >= since_ms)
    if until_ms is not None:
        in_window = in_window & (F.col("ts") < until_ms)
    parsed = _read(spark, files).select(
        *[c for c in SCHEMA.fieldNames() if c != CORRUPT_COLUMN],
        _validity().alias("valid"),
    )
    marked = parsed.withColumn("usable", F.coalesce(F.col("valid") & in_window, F.lit(False)))
    marked = marked.persist(StorageLevel.MEMORY_AND_DISK)
    stats = marked.agg(
        F.count(F.lit(1)).alias("records"),
        F.count(F.when(~F.col("valid"), 1)).alias("corrupt"),
        F.count(F.when(F.col("usable"), 1)).alias("usable"),
        F.min(F.when(F.col("usable"), F.col("ts"))).alias("min_ts"),
        F.max(F.when(F.col("usable"), F.col("ts"))).alias("max_ts"),
    ).first()
    assert stats is not None
    records = marked.where("usable").drop("valid", "usable")
    start_ms = since_ms if since_ms is not None else stats["min_ts"]
    end_ms = (
        until_ms
        if until_ms is not None
        else (None if stats["max_ts"] is None else stats["max_ts"] + 1)
    )
    if stats["usable"] == 0 and (since_ms is None or until_ms is None):
        start_ms = end_ms = None
    return Observations(
        spark=spark,
        records=records,
        files_read=len(files),
        records_read=int(stats["records"]),
        corrupt_lines=int(stats["corrupt"]),
        records_in_window=int(stats["usable"]),
        start_ms=start_ms,
        end_ms=end_ms,
        grace_ms=grace_ms,
        _cached=[marked],
    )
