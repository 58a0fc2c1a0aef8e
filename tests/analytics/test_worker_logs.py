"""Several workers' observation logs: written by the service's own writer
(sigil_push/observations.py) under per-worker names, read all together by analytics.

- Two workers writing into one shared folder never share a file, each keeps its own hour
  files, and a housekeeping round compresses its own finished hours (and another worker's
  only an hour later).
- The analytics job reads both workers' files, plain and gzip, in one shared folder and in a
  folder per worker under a common parent, and prunes them by the hour in their names.
"""

from __future__ import annotations

import asyncio
import csv
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from analytics.observations import file_hour_ms, load_observations
from analytics.run import run_all
from sigil_push.observations import HOUR_MS, LOCK_NAME, ObservationLog, worker_of
from tests.analytics.observation_logs import HOUR, MINUTE, T0, T0_MS

pytestmark = pytest.mark.spark

WORKER_A = "host-a-101-abc123"
WORKER_B = "host.b-202-def456"


async def _write(folder: Path, worker: str, relay: str, events: list[str], hour_ms: int) -> None:
    """Records through the real writer: a seen record and a canary probe per event."""
    log = ObservationLog(folder, retention_days=0, worker=worker)
    await log.start()
    for index, event_id in enumerate(events):
        ts = hour_ms + index * MINUTE
        log.seen(relay, event_id, 1059, ts // 1000, ts)
        log.canary(ts, relay, f"probe-{event_id}", True, "", 120)
    await log.stop()


def _two_workers(folder_a: Path, folder_b: Path) -> None:
    asyncio.run(_write(folder_a, WORKER_A, "wss://a", ["a1", "a2", "a3"], T0_MS))
    asyncio.run(_write(folder_a, WORKER_A, "wss://a", ["a4"], T0_MS + HOUR))
    asyncio.run(_write(folder_b, WORKER_B, "wss://b", ["b1", "b2"], T0_MS))


def test_worker_names_carry_the_worker_and_the_hour() -> None:
    assert file_hour_ms(f"observations-{WORKER_A}-20261121T10.jsonl") == T0_MS
    assert file_hour_ms(f"observations-{WORKER_B}-20261121T11.jsonl.gz") == T0_MS + HOUR
    assert worker_of(f"observations-{WORKER_B}-20261121T11.jsonl.gz") == WORKER_B
    assert worker_of("observations-20261121T11.jsonl") == ""
    assert worker_of("notes.txt") is None


def test_workers_sharing_a_folder_write_and_tidy_their_own_files(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    _two_workers(folder, folder)
    names = sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)
    assert names == [
        f"observations-{WORKER_A}-20261121T10.jsonl",
        f"observations-{WORKER_A}-20261121T11.jsonl",
        f"observations-{WORKER_B}-20261121T10.jsonl",
    ]
    # at 11:30 worker A compresses its own 10:00 hour, not B's (B may still be appending)
    tidied = ObservationLog(folder, 0, WORKER_A).tidy(T0_MS + HOUR + 30 * MINUTE)
    assert tidied.compressed == 1
    assert (folder / f"observations-{WORKER_A}-20261121T10.jsonl.gz").exists()
    assert (folder / f"observations-{WORKER_B}-20261121T10.jsonl").exists()
    # an hour later B's 10:00 file is finished for anyone (B may be gone for good)
    ObservationLog(folder, 0, WORKER_A).tidy(T0_MS + 2 * HOUR_MS + MINUTE)
    assert (folder / f"observations-{WORKER_B}-20261121T10.jsonl.gz").exists()
    assert not (folder / f"observations-{WORKER_B}-20261121T10.jsonl").exists()
    # past the retention, every worker's hours go, whoever wrote them (ids change at restart)
    gone = ObservationLog(folder, 1, WORKER_B).tidy(T0_MS + 3 * 24 * HOUR_MS)
    assert (gone.deleted, gone.files) == (3, 0)
    assert [p.name for p in folder.iterdir()] == [LOCK_NAME]  # the housekeeping turns' lock


def test_analytics_reads_every_workers_files_in_one_folder(
    spark: SparkSession, tmp_path: Path
) -> None:
    folder = tmp_path / "shared"
    _two_workers(folder, folder)
    ObservationLog(folder, 0, WORKER_A).tidy(T0_MS + HOUR + 30 * MINUTE)  # one file gzipped

    obs = load_observations(spark, str(folder))
    assert obs.files_read == 3
    assert obs.records_read == 12
    assert obs.corrupt_lines == 0
    assert sorted(r.event_id for r in obs.seen.collect()) == ["a1", "a2", "a3", "a4", "b1", "b2"]
    obs.release()

    # the hour in the per-worker names still prunes: 10:00 opens both workers' 10:00 files
    obs = load_observations(spark, str(folder), since=T0, until=T0 + timedelta(hours=1))
    assert obs.files_read == 2
    assert sorted(r.event_id for r in obs.seen.collect()) == ["a1", "a2", "a3", "b1", "b2"]
    obs.release()

    summary_dir = tmp_path / "out"
    run_all(str(folder), str(summary_dir), master=None)
    with (summary_dir / "canary.csv").open() as handle:
        probes = {row["relay"]: int(row["probes"]) for row in csv.DictReader(handle)}
    assert probes == {"wss://a": 4, "wss://b": 2}


def test_analytics_reads_a_folder_per_worker_under_one_parent(
    spark: SparkSession, tmp_path: Path
) -> None:
    parent = tmp_path / "logs"
    _two_workers(parent / "worker-a", parent / "worker-b")
    (parent / "_temporary").mkdir()  # a half-written Spark output is not part of the log
    shutil.copy(parent / "worker-b" / f"observations-{WORKER_B}-20261121T10.jsonl",
                parent / "_temporary" / "observations-20261121T10.jsonl")

    obs = load_observations(spark, str(parent))
    assert obs.files_read == 3
    assert sorted(r.event_id for r in obs.seen.collect()) == ["a1", "a2", "a3", "a4", "b1", "b2"]
    obs.release()
