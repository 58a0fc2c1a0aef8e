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

from pyspark.sql import Column, DataFrame  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from analytics.jobs import Job, job_main  # noqa: E402
from analytics.observations import Observations  # noqa: E402

OUTPUT = "relay_latency"
CREATED_AT_OUTPUT = "relay_latency_created_at"
QUANTILES = (0.5, 0.9, 0.99)
# percentile_approx's accuracy: relative rank error 1/ACCURACY, ample for milliseconds.
ACCURACY = 10_000
NIP04_KIND = 4


def _quantiles(value: Column, prefix: str) -> list[Column]:
    """Aggregates for the p50/p90/p99 of ``value`` named ``<prefix>_p50_ms`` etc."""
    approx = F.percentile_approx(value, list(QUANTILES), ACCURACY)
    return [approx[i].alias(f"{prefix}_p{round(q * 100)}_ms") for i, q in enumerate(QUANTILES)]


def _summarise(deliveries: DataFrame, value: Column, prefix: str) -> DataFrame:
    quantiles = _quantiles(value, prefix)
    summary = deliveries.groupBy("relay").agg(F.count(F.lit(1)).alias("events"), F.struct(*quantiles).alias("q"))
    return summary.select("relay", "events", "q.*").orderBy("relay")


def compute(obs: Observations) -> dict[str, DataFrame]:
    """Per relay: distinct events delivered and lag p50/p90/p99 (ms); kind 4 age separately.

    Relays that delivered nothing in the window have no row here (their misses show in the
    dropped-events report).
    """
    deliveries = obs.deliveries()
    lag = F.col("ts") - F.col("first_ts")
    kind4 = deliveries.where((F.col("kind") == NIP04_KIND) & F.col("created_at").isNotNull())
    age = F.col("ts") - F.col("created_at") * 1000
    return {
        OUTPUT: _summarise(deliveries, lag, "lag"),
        CREATED_AT_OUTPUT: _summarise(kind4, age, "created_at_delay"),
    }


JOB = Job(name="relay_latency", description=__doc__ or "", compute=compute)


def main(argv: Sequence[str] | None = None) -> int:
    return job_main(JOB, argv)


if __name__ == "__main__":
    sys.exit(main())
