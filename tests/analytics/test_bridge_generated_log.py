"""Analytics over an observation log written by the real bridge, not by hand.

Two real relays; every DM goes to the first, only every third to the second, so the second
relay "misses" a known number of events. After `sigil-push serve` stops, the Spark jobs must
report exactly that. The jobs read files, not the store, so the service runs on the default
engine (the file names of PostgreSQL workers: tests/analytics/test_worker_logs.py).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from analytics.run import run_all
from testkit.bridge_harness import eventually, new_token, register, relay_live, seen_count
from testkit.nostr_client import gift_wrap, kind4_dm, publish, user
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess

pytestmark = pytest.mark.spark

EVENTS = 12


def read_rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open(newline="") as handle:
        return {row["relay"]: row for row in csv.DictReader(handle)}


async def test_jobs_measure_what_the_bridge_observed(spark: SparkSession, tmp_path: Path) -> None:
    full, lossy = RelayProcess(tmp_path / "full").start(), RelayProcess(tmp_path / "lossy").start()
    service = ServiceProcess(tmp_path / "service", [full.url, lossy.url]).start()
    try:
        alice, bob = user(), user()
        register(service, alice, new_token())
        await eventually(
            lambda: relay_live(service, full.url, 1) and relay_live(service, lossy.url, 1),
            "both relays subscribed",
        )
        events = [
            kind4_dm(bob, alice, f"dm {i}") if i % 2 else gift_wrap(bob, alice, f"wrap {i}")
            for i in range(EVENTS)
        ]
        on_lossy = events[::3]
        for event in events:
            await publish(full.url, event)
        for event in on_lossy:
            await publish(lossy.url, event)
        await eventually(
            lambda: all(seen_count(service, e["id"]) == (2 if e in on_lossy else 1) for e in events),
            "every delivery observed",
        )
    finally:
        assert service.stop() == 0
        full.stop()
        lossy.stop()

    out = tmp_path / "report"
    summary = run_all(str(service.observations), str(out))
    assert summary.corrupt_lines == 0

    dropped = read_rows(out / "dropped_events.csv")
    assert dropped[full.url]["expected"] == str(EVENTS)
    assert dropped[full.url]["missed"] == "0"
    assert dropped[lossy.url]["seen"] == str(len(on_lossy))
    assert dropped[lossy.url]["missed"] == str(EVENTS - len(on_lossy))
    assert float(dropped[lossy.url]["miss_rate"]) == pytest.approx(
        (EVENTS - len(on_lossy)) / EVENTS, abs=1e-6
    )
    latency = read_rows(out / "relay_latency.csv")
    assert latency[full.url]["events"] == str(EVENTS)
    assert latency[lossy.url]["events"] == str(len(on_lossy))
    assert float(latency[lossy.url]["lag_p50_ms"]) >= 0
