"""Delivery funnel: per push platform, how wakeups ended and how long they took.

A push record carries no device, and one event may be pushed to several devices of a
platform and retried, so each (event, platform) gets one *final outcome*: the best of its
final statuses in the order accepted > unregistered > rejected > failed. A ``retry``
followed by ``accepted`` is accepted; one device accepted and another unregistered is
accepted (someone was woken). ``retry`` and unknown statuses are not final: an event with
nothing else (still in flight when the window ends) counts in ``events`` but in no outcome
column. The latency of an (event, platform) is that of its final outcome (the smallest if
several records share it), i.e. first ``seen`` to the provider's answer, retries included.

Suppressed DMs (``suppressed`` records: paused, present, muted, not followed) woke no device,
so they belong to no platform and are no failure: they are counted in the ``suppressed``
column of a row of their own, platform ``none`` (absent when there were none). A DM held back
by a presence that then lapsed is also pushed once at the lapse, and counts in its platform
row as well.

The same funnel split by notification class (``delivery_by_class``: an addition to the
contract's ``delivery.csv``): each event's class is its kind's (``seen`` records carry the
kind: 4 and 1059 ``dm``, 1 ``mention``, 6 and 16 ``repost``, 7 ``reaction``, 9735 ``zap``,
anything else ``other``; an event with no ``seen`` record ``unknown``), a suppressed event's
the class its record names. An event's outcome there is its best final outcome over the
platforms; ``events`` counts the events pushed or suppressed, and an event held back and
later pushed by a deferred wakeup counts in both ``suppressed`` and its outcome.

Runs on its own with ``spark-submit analytics/delivery.py --input LOG --output DIR``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    # spark-submit runs this file as a script: make the `analytics` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType

from analytics.jobs import Job, job_main
from analytics.observations import Observations

OUTPUT = "delivery"
BY_CLASS = "delivery_by_class"
CLASS_OF_KIND = {4: "dm", 1059: "dm", 1: "mention", 6: "repost", 16: "repost", 7: "reaction",
                 9735: "zap"}
"""The bridge's notification classes by kind (sigil_push.bridge.watches; a test holds the two
equal: the jobs run under spark-submit without the service's package)."""
# Final statuses, best first; their position is the precedence rank.
FINAL_STATUSES = ("accepted", "unregistered", "rejected", "failed")
ACCURACY = 10_000


def _rank() -> Column:
    rank = F.when(F.col("status") == FINAL_STATUSES[0], 0)
    for position, status in enumerate(FINAL_STATUSES[1:], start=1):
        rank = rank.when(F.col("status") == status, position)
    return rank


def final_outcomes(pushes: DataFrame) -> DataFrame:
    """``event_id, platform, rank, latency_ms``: one final outcome per (event, platform).

    ``rank`` is null when the event has no final status on that platform yet.
    """
    rank = _rank()
    latency = F.col("latency_ms")
    # min over (rank, latency missing, latency): best status, then its quickest known answer.
    order = F.when(
        rank.isNotNull(), F.struct(rank.alias("rank"), latency.isNull().alias("unknown"), latency)
    )
    return (
        pushes.groupBy("event_id", "platform")
        .agg(F.min(order).alias("final"))
        .select(
            "event_id",
            "platform",
            F.col("final.rank").alias("rank"),
            F.col("final.latency_ms").alias("latency_ms"),
        )
    )


NO_PLATFORM = "none"
"""The platform of the row counting suppressed DMs (they woke no device)."""


def _suppressed_row(obs: Observations) -> DataFrame:
    """The `none` row: distinct suppressed DMs in ``events`` and ``suppressed``, no outcome."""
    counted = (
        obs.suppressions.select(F.lit(NO_PLATFORM).alias("platform"), "event_id")
        .distinct()
        .groupBy("platform")
        .agg(F.count(F.lit(1)).alias("events"))
    )
    zero = F.lit(0).cast(LongType())
    return counted.select(
        "platform",
        "events",
        *(zero.alias(status) for status in FINAL_STATUSES),
        *(F.lit(None).cast(LongType()).alias(name) for name in ("p50_ms", "p99_ms")),
        F.col("events").alias("suppressed"),
    )


def _class_of(kind: Column) -> Column:
    by_kind = F.when(kind.isNull(), F.lit("unknown"))
    for number, name in CLASS_OF_KIND.items():
        by_kind = by_kind.when(kind == number, F.lit(name))
    return by_kind.otherwise(F.lit("other"))


def by_class(obs: Observations, outcomes: DataFrame) -> DataFrame:
    """``class, events, accepted, unregistered, rejected, failed, suppressed``."""
    kinds = obs.seen.groupBy("event_id").agg(F.min("kind").alias("kind"))
    best = outcomes.groupBy("event_id").agg(F.min("rank").alias("rank"))
    pushed = best.join(kinds, "event_id", "left").select(
        "event_id", _class_of(F.col("kind")).alias("class"), "rank"
    )
    suppressed = obs.suppressions.select("event_id", "class").distinct()
    events = pushed.select("event_id", "class").unionByName(suppressed).distinct()
    totals = events.groupBy("class").agg(F.count(F.lit(1)).alias("events"))
    outcome_counts = pushed.groupBy("class").agg(
        *(F.count(F.when(F.col("rank") == position, 1)).alias(status)
          for position, status in enumerate(FINAL_STATUSES))
    )
    held = suppressed.groupBy("class").agg(F.count(F.lit(1)).alias("suppressed"))
    zero = F.lit(0).cast(LongType())
    return (
        totals.join(outcome_counts, "class", "left")
        .join(held, "class", "left")
        .select(
            "class",
            "events",
            *(F.coalesce(F.col(status), zero).alias(status) for status in FINAL_STATUSES),
            F.coalesce(F.col("suppressed"), zero).alias("suppressed"),
        )
        .orderBy("class")
    )


def compute(obs: Observations) -> dict[str, DataFrame]:
    """Per platform: events, accepted, unregistered, rejected, failed, p50_ms, p99_ms, and
    suppressed (always 0 there; the `none` row counts suppressed DMs)."""
    outcomes = final_outcomes(obs.pushes)
    counts = [
        F.count(F.when(F.col("rank") == position, 1)).alias(status)
        for position, status in enumerate(FINAL_STATUSES)
    ]
    quantiles = F.percentile_approx(
        F.when(F.col("rank").isNotNull(), F.col("latency_ms")), [0.5, 0.99], ACCURACY
    )
    funnel = outcomes.groupBy("platform").agg(
        F.count(F.lit(1)).alias("events"), *counts, quantiles.alias("q")
    )
    as_ms = [
        F.round(F.col("q")[i]).cast(LongType()).alias(name)
        for i, name in enumerate(("p50_ms", "p99_ms"))
    ]
    by_platform = funnel.select(
        "platform",
        "events",
        *FINAL_STATUSES,
        *as_ms,
        F.lit(0).cast(LongType()).alias("suppressed"),
    )
    return {
        OUTPUT: by_platform.unionByName(_suppressed_row(obs)).orderBy("platform"),
        BY_CLASS: by_class(obs, outcomes),
    }


JOB = Job(name="delivery", description=__doc__ or "", compute=compute)


def main(argv: Sequence[str] | None = None) -> int:
    return job_main(JOB, argv)


if __name__ == "__main__":
    sys.exit(main())
