"""Relay latency: how far each relay lags behind the first relay to deliver an event.

Lag is measured against the earliest arrival of the same event over all relays, never against
``created_at``: NIP-59 back-dates gift wraps (kind 1059) by up to two days. For kind 4 the
arrival minus ``created_at`` is still informative (it includes the sender's publishing delay
and clock skew), so it is reported on its own in ``relay_latency_created_at``.

Runs on its own with ``spark-submit analytics/relay_latency.py --input LOG --output DIR``.
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

from analytics.jobs import Job, job_main
from analytics.observations import Observations

OUTPUT = "relay_latency"
CREATED_AT_OUTPUT = "relay_latency_created_at"
QUANTILES = (0.5, 0.9, 0.99)
# percentile_approx's accuracy: relative rank error 1/ACCURACY, ample for milliseconds.
ACCURACY = 10_000
NIP04_KIND = 4


def _quantiles(value: Column, prefix: str) -> Column:
    """A struct of the p50/p90/p99 of ``value``, fields named ``<prefix>_p50_ms`` etc."""
    approx = F.percentile_approx(value, list(QUANTILES), ACCURACY)
    return F.struct(
        *[approx[i].alias(f"{prefix}_p{round(q * 100)}_ms") for i, q in enumerate(QUANTILES)]
    )


def compute(obs: Observations) -> dict[str, DataFrame]:
    """Per relay: distinct events delivered and lag p50/p90/p99 (ms); kind 4 age separately.

    Both tables come from one aggregation pass over the deliveries. Relays that delivered
    nothing in the window have no row here (their misses show in the dropped-events report).
    """
    lag = F.col("ts") - F.col("first_ts")
    kind4 = (F.col("kind") == NIP04_KIND) & F.col("created_at").isNotNull()
    age = F.when(kind4, F.col("ts") - F.col("created_at") * 1000)
    per_relay = obs.cache(
        obs.deliveries()
        .groupBy("relay")
        .agg(
            F.count(F.lit(1)).alias("events"),
            _quantiles(lag, "lag").alias("lag"),
            F.count(age).alias("kind4_events"),
            _quantiles(age, "created_at_delay").alias("age"),
        )
    )
    return {
        OUTPUT: per_relay.select("relay", "events", "lag.*").orderBy("relay"),
        CREATED_AT_OUTPUT: per_relay.where(F.col("kind4_events") > 0)
        .select("relay", F.col("kind4_events").alias("events"), "age.*")
        .orderBy("relay"),
    }


JOB = Job(name="relay_latency", description=__doc__ or "", compute=compute)


def main(argv: Sequence[str] | None = None) -> int:
    return job_main(JOB, argv)


if __name__ == "__main__":
    sys.exit(main())
