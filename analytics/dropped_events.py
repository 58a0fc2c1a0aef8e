"""Dropped events: which relays silently miss DMs, overall and hour by hour.

An event is *expected* from a relay when its first arrival over all relays falls inside an
interval in which that relay was connected: from a ``connected`` (or
``authenticated_as_user``) record until the next ``disconnected``/``error`` of that relay,
or the end of the window. Other states (``auth_required``, ...) do not change connectivity.
*Seen* counts the expected events the relay delivered itself, so ``seen <= expected`` and the
miss rate is a fraction; an event a relay delivered although it was first seen while that
relay was down (catch-up after a reconnect) is neither expected nor seen.

The connectivity at the start of the window is inferred, since ``--since`` may cut off the
``connected`` record: a relay is connected from the start if it delivered an event before
its first state change in the window (or has none), or if that first change is a
``disconnected`` (only an open connection can close). ``error`` says nothing either way.

A relay has *seen* an event only if it delivered it within ``--grace`` (default two minutes)
of the event's first arrival anywhere; a later delivery counts as a miss.

The overall columns treat every relay as a place every DM should reach, which on Nostr it is
not: a NIP-17 sender publishes only to the recipient's inbox relays. The *inbox* columns use
the bridge's ``expect`` records (which inbox relays of the recipient were connected when the
DM was handled): ``inbox_expected`` counts the expected events whose ``expect`` record lists
this relay, ``inbox_seen`` those of them it delivered within the grace. That rate is the one
to rank relays by.

Runs on its own with ``spark-submit analytics/dropped_events.py --input LOG --output DIR``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

if __package__ in (None, ""):
    # spark-submit runs this file as a script: make the `analytics` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.ml.feature import Bucketizer
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from analytics.jobs import Job, job_main
from analytics.observations import HOUR_MS, Observations

OUTPUT = "dropped_events"
HOURLY_OUTPUT = "dropped_events_hourly"
CONNECTED_STATES = ("connected", "authenticated_as_user")
DISCONNECTED_STATES = ("disconnected", "error")

_COUNTS = [
    StructField(f"{prefix}{name}", LongType() if name != "miss_rate" else DoubleType())
    for prefix in ("", "inbox_")
    for name in ("expected", "seen", "missed", "miss_rate")
]
COUNT_COLUMNS = [f.name for f in _COUNTS]
SCHEMA = StructType([StructField("relay", StringType()), *_COUNTS])
HOURLY_SCHEMA = StructType(
    [StructField("relay", StringType()), StructField("hour", StringType()), *_COUNTS]
)


def _floor_hour(ms: Column) -> Column:
    return ms - F.pmod(ms, F.lit(HOUR_MS))


def _relays(obs: Observations) -> DataFrame:
    """Every relay of the window: those that changed state and those that delivered."""
    return obs.relay_states.select("relay").union(obs.deliveries().select("relay")).distinct()


def _initially_connected(obs: Observations, changes: DataFrame) -> DataFrame:
    """Relays (all that appear in the window) and whether they were connected at its start."""
    first_delivery = obs.deliveries().groupBy("relay").agg(F.min("ts").alias("first_delivery"))
    first_change = changes.groupBy("relay").agg(
        F.min("ts").alias("first_change"), F.min_by("state", "ts").alias("first_state")
    )
    delivered_first = F.col("first_delivery").isNotNull() & (
        F.col("first_change").isNull() | (F.col("first_delivery") < F.col("first_change"))
    )
    closed_first = F.col("first_state") == "disconnected"
    connected = delivered_first | F.coalesce(closed_first, F.lit(False))
    return (
        _relays(obs)
        .join(first_delivery, "relay", "left")
        .join(first_change, "relay", "left")
        .select("relay", connected.alias("connected"))
    )


def connected_intervals(obs: Observations, start_ms: int, end_ms: int) -> DataFrame:
    """``relay, start, end``: the half-open intervals in which each relay was connected."""
    conn = F.when(F.col("state").isin(*CONNECTED_STATES), 1).when(
        F.col("state").isin(*DISCONNECTED_STATES), 0
    )
    changes = obs.relay_states.select("relay", "ts", "state", conn.alias("conn")).where(
        F.col("conn").isNotNull()
    )
    initial = (
        _initially_connected(obs, changes)
        .where("connected")
        .select("relay", F.lit(start_ms).alias("ts"), F.lit(1).alias("conn"), F.lit(0).alias("seq"))
    )
    ordered = Window.partitionBy("relay").orderBy("ts", "seq", "conn")
    transitions = (
        changes.select("relay", "ts", "conn", F.lit(1).alias("seq"))
        .unionByName(initial)
        .withColumn("previous", F.lag("conn").over(ordered))
        .where(F.col("previous").isNull() | (F.col("previous") != F.col("conn")))
        .withColumn("next_ts", F.lead("ts").over(ordered))
    )
    return (
        transitions.where(F.col("conn") == 1)
        .select(
            "relay", F.col("ts").alias("start"), F.coalesce("next_ts", F.lit(end_ms)).alias("end")
        )
        .where(F.col("end") > F.col("start"))
    )


def hour_pieces(intervals: DataFrame) -> DataFrame:
    """``relay, hour, start, end``: the connected intervals cut at hour boundaries."""
    hours = F.sequence(_floor_hour(F.col("start")), _floor_hour(F.col("end") - 1), F.lit(HOUR_MS))
    return intervals.select("relay", "start", "end", F.explode(hours).alias("hour")).select(
        "relay",
        "hour",
        F.greatest("start", "hour").alias("start"),
        F.least("end", F.col("hour") + HOUR_MS).alias("end"),
    )


def _expected_per_piece(obs: Observations, pieces: DataFrame) -> DataFrame:
    """``pieces`` plus ``expected``: events whose first arrival lies in the piece.

    Joining every event with every relay's intervals would build events x relays rows.
    Instead the piece boundaries (a few per relay-hour, collected to the driver) cut the time
    line into segments; one pass assigns each event its segment (a binary search, by
    Bucketizer), the per-segment counts are summed into ``before(t)`` = events first seen
    before t, and a piece expects ``before(end) - before(start)``.
    """
    spark = obs.spark
    bounds = sorted(
        {row[0] for row in pieces.select("start").union(pieces.select("end")).distinct().collect()}
    )
    if not bounds:
        return pieces.withColumn("expected", F.lit(0).cast(LongType()))
    first_seen = obs.deliveries().where("first").select(F.col("first_ts").cast(DoubleType()))
    bucketizer = Bucketizer(
        splits=[float("-inf"), *map(float, bounds), float("inf")],
        inputCol="first_ts",
        outputCol="segment",
    )
    counted = bucketizer.transform(first_seen).groupBy("segment").count().collect()
    per_segment: dict[float, int] = {row["segment"]: row["count"] for row in counted}
    # Segment k + 1 starts at bounds[k]; before(bounds[k]) sums segments 0..k.
    before = list(accumulate(per_segment.get(float(k), 0) for k in range(len(bounds))))
    table = spark.createDataFrame(list(zip(bounds, before)), "bound long, before long")
    at_start = table.select(F.col("bound").alias("start"), F.col("before").alias("before_start"))
    at_end = table.select(F.col("bound").alias("end"), F.col("before").alias("before_end"))
    return (
        pieces.join(F.broadcast(at_start), "start")
        .join(F.broadcast(at_end), "end")
        .withColumn("expected", F.col("before_end") - F.col("before_start"))
        .drop("before_start", "before_end")
    )


def _with_rates(counts: DataFrame) -> DataFrame:
    """Add ``missed`` and ``miss_rate`` (0 when nothing was expected), overall and inbox."""
    for prefix in ("", "inbox_"):
        expected, seen = F.col(f"{prefix}expected"), F.col(f"{prefix}seen")
        rate = F.when(expected > 0, (expected - seen) / expected).otherwise(F.lit(0.0))
        counts = counts.withColumn(f"{prefix}missed", expected - seen).withColumn(
            f"{prefix}miss_rate", rate
        )
    return counts


def _in_time(obs: Observations) -> Column:
    """The relay's own delivery (``ts``) came within the grace after the first arrival."""
    return F.col("ts") - F.col("first_ts") <= F.lit(obs.grace_ms)


def _in_piece() -> Column:
    return (F.col("first_ts") >= F.col("start")) & (F.col("first_ts") < F.col("end"))


def _inbox_counts(obs: Observations, pieces: DataFrame) -> DataFrame:
    """``relay, hour, inbox_expected, inbox_seen`` from the ``expect`` records.

    An (event, inbox relay) pair is expected when the event's first arrival anywhere lies in
    one of that relay's connected pieces; it is seen when the relay delivered it in time.
    """
    first = (
        obs.deliveries()
        .where("first")
        .select("event_id", "first_ts", _floor_hour(F.col("first_ts")).alias("hour"))
    )
    expected = (
        obs.expects.join(first, "event_id")
        .join(F.broadcast(pieces), ["relay", "hour"])
        .where(_in_piece())
        .select("event_id", "relay", "hour", "first_ts")
    )
    own = obs.deliveries().select("event_id", "relay", "ts")
    delivered = F.col("ts").isNotNull() & _in_time(obs)
    return (
        expected.join(own, ["event_id", "relay"], "left")
        .groupBy("relay", "hour")
        .agg(
            F.count(F.lit(1)).alias("inbox_expected"),
            F.count(F.when(delivered, 1)).alias("inbox_seen"),
        )
    )


def compute(obs: Observations) -> dict[str, DataFrame]:
    """Per relay and per relay-hour: expected, seen, missed and miss rate, overall and for
    the DMs whose recipient lists the relay as an inbox.

    The hour of an event is that of its first arrival; hourly rows exist for every hour in
    which the relay was connected at some point.
    """
    if obs.start_ms is None or obs.end_ms is None:
        empty = obs.spark.createDataFrame([], SCHEMA)
        return {OUTPUT: empty, HOURLY_OUTPUT: obs.spark.createDataFrame([], HOURLY_SCHEMA)}
    pieces = obs.cache(hour_pieces(connected_intervals(obs, obs.start_ms, obs.end_ms)))
    expected = (
        _expected_per_piece(obs, pieces)
        .groupBy("relay", "hour")
        .agg(F.sum("expected").alias("expected"))
    )
    delivered = (
        obs.deliveries()
        .where(_in_time(obs))
        .select("relay", "first_ts", _floor_hour(F.col("first_ts")).alias("hour"))
    )
    seen = (
        delivered.join(F.broadcast(pieces), ["relay", "hour"])
        .where(_in_piece())
        .groupBy("relay", "hour")
        .agg(F.count(F.lit(1)).alias("seen"))
    )
    sums = ["expected", "seen", "inbox_expected", "inbox_seen"]
    hourly_counts = obs.cache(
        expected.join(seen, ["relay", "hour"], "left")
        .join(_inbox_counts(obs, pieces), ["relay", "hour"], "left")
        .fillna(0, subset=sums[1:])
    )
    hour_text = F.date_format(F.timestamp_millis("hour"), "yyyy-MM-dd'T'HH:mm:ss'Z'")
    hourly = (
        _with_rates(hourly_counts)
        .orderBy("relay", "hour")
        .select("relay", hour_text.alias("hour"), *COUNT_COLUMNS)
    )
    totals = hourly_counts.groupBy("relay").agg(*[F.sum(c).alias(c) for c in sums])
    overall = _with_rates(_relays(obs).join(totals, "relay", "left").fillna(0, subset=sums))
    return {
        OUTPUT: overall.select("relay", *COUNT_COLUMNS).orderBy("relay"),
        HOURLY_OUTPUT: hourly,
    }


JOB = Job(name="dropped_events", description=__doc__ or "", compute=compute)


def main(argv: Sequence[str] | None = None) -> int:
    return job_main(JOB, argv)


if __name__ == "__main__":
    sys.exit(main())
