"""Canary probes: does each relay deliver a DM right now, and how fast?

The bridge publishes a gift wrap addressed to its own canary key to each probed relay at an
interval and watches for it through its normal subscriptions; every probe leaves a
``canary`` record. It is the ground truth the other jobs only infer: a relay that accepts the
probe but never hands it back is not delivering DMs, whatever its traffic looks like.

Per relay: ``probes`` = distinct probes (relay, event_id); ``published`` = those the relay
accepted (``OK true``); ``delivered`` = those that came back (``received_ms`` not null);
``delivery_rate = delivered / probes``, so a relay that refuses the write counts as not
delivering (a sender could not reach a recipient through it either; ``published`` tells the
two failures apart). ``p50_ms``/``p99_ms``: publish -> receive time of the delivered probes.
Should the bridge write a probe more than once (first at publishing, then on receipt), the
records of one probe are merged: published if any says so, the earliest ``received_ms``.

Runs on its own with ``spark-submit analytics/canary.py --input LOG --output DIR``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    # spark-submit runs this file as a script: make the `analytics` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType

from analytics.jobs import Job, job_main
from analytics.observations import Observations

OUTPUT = "canary"
COLUMNS = ("relay", "probes", "published", "delivered", "delivery_rate", "p50_ms", "p99_ms")
ACCURACY = 10_000


def compute(obs: Observations) -> dict[str, DataFrame]:
    """Per probed relay: probes, published, delivered, delivery_rate, p50_ms, p99_ms."""
    probes = obs.canaries.groupBy("relay", "event_id").agg(
        F.max(F.col("published").cast("int")).alias("published"),
        F.min(F.when(F.col("received_ms") >= 0, F.col("received_ms"))).alias("received_ms"),
    )
    per_relay = probes.groupBy("relay").agg(
        F.count(F.lit(1)).alias("probes"),
        F.sum("published").cast(LongType()).alias("published"),
        F.count("received_ms").alias("delivered"),
        F.percentile_approx("received_ms", [0.5, 0.99], ACCURACY).alias("q"),
    )
    rate = (F.col("delivered") / F.col("probes")).alias("delivery_rate")
    as_ms = [
        F.round(F.col("q")[i]).cast(LongType()).alias(name)
        for i, name in enumerate(("p50_ms", "p99_ms"))
    ]
    table = per_relay.select("relay", "probes", "published", "delivered", rate, *as_ms)
    return {OUTPUT: table.orderBy("relay")}


JOB = Job(name="canary", description=__doc__ or "", compute=compute)


def main(argv: Sequence[str] | None = None) -> int:
    return job_main(JOB, argv)


if __name__ == "__main__":
    sys.exit(main())
