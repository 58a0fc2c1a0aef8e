"""run_all end to end: the contract's files, the self-contained report, empty input."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from analytics.run import main, run_all
from tests.analytics.observation_logs import (
    CONTRACT_COLUMNS,
    SECOND,
    T0_MS,
    ObservationLog,
    canary,
    expect,
    push,
    relay,
    seen,
)

pytestmark = pytest.mark.spark

EXTRA_FILES = ["relay_latency_created_at.csv", "dropped_events_hourly.csv"]
REPO = Path(__file__).resolve().parents[2]


def read_csv(path: Path) -> list[list[str]]:
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


def test_run_all_writes_every_report(
    spark: SparkSession, log: ObservationLog, tmp_path: Path
) -> None:
    """Two relays, one of which misses an event sent to its inbox, a canary probe, and pushes
    on two platforms: the CSVs hold exactly the contract's columns and values, the Parquet
    copies the same rows, and the report opens with the summary, shows the canary first and
    references nothing on the network."""
    t = T0_MS
    log.write(
        "20261121T10",
        [
            relay(t, "wss://a", "connected"),
            relay(t, "wss://b", "connected"),
            seen(t + 1 * SECOND, "wss://a", "e1", kind=4, created_at=t // 1000),
            seen(t + 1 * SECOND + 300, "wss://b", "e1", kind=4, created_at=t // 1000),
            expect(t + 1 * SECOND + 5, "e1", ["wss://a", "wss://b"]),
            seen(t + 2 * SECOND, "wss://a", "e2"),
            expect(t + 2 * SECOND + 5, "e2", ["wss://b"]),
            canary(t + 2 * SECOND, "wss://a", "k1", received_ms=250),
            push(t + 3 * SECOND, "e1", "ios", "retry", 900),
            push(t + 4 * SECOND, "e1", "ios", "accepted", 2400),
            push(t + 4 * SECOND, "e2", "android", "rejected", 700),
            "corrupt {",
        ],
    )
    out = tmp_path / "reports"

    summary = run_all(log.path, str(out), master="local[2]")

    assert (
        summary.files_read,
        summary.records_read,
        summary.corrupt_lines,
        summary.records_in_window,
    ) == (1, 12, 1, 11)
    assert summary.rows == {
        "canary": 1,
        "relay_latency": 2,
        "relay_latency_created_at": 2,
        "dropped_events": 2,
        "dropped_events_hourly": 2,
        "delivery": 2,
        "delivery_by_class": 1,
    }
    assert read_csv(out / "relay_latency.csv")[1:] == [
        ["wss://a", "2", "0", "0", "0"],
        ["wss://b", "1", "300", "300", "300"],
    ]
    assert read_csv(out / "dropped_events.csv")[1:] == [
        ["wss://a", "2", "2", "0", "0.0", "1", "1", "0", "0.0"],
        ["wss://b", "2", "1", "1", "0.5", "2", "1", "1", "0.5"],
    ]
    assert read_csv(out / "canary.csv")[1:] == [["wss://a", "1", "1", "1", "1.0", "250", "250"]]
    assert read_csv(out / "delivery.csv")[1:] == [
        ["android", "1", "0", "0", "1", "0", "700", "700", "0"],
        ["ios", "1", "1", "0", "0", "0", "2400", "2400", "0"],
    ]
    for name, columns in CONTRACT_COLUMNS.items():
        assert read_csv(out / name)[0] == columns
        parquet = spark.read.parquet(str(out / name.replace(".csv", ".parquet")))
        assert parquet.columns == columns
        assert sorted(str(v) for r in parquet.collect() for v in r) == sorted(
            v for r in read_csv(out / name)[1:] for v in r
        )
    for name in EXTRA_FILES:
        assert (out / name).is_file()
    assert not [p.name for p in out.iterdir() if p.name.startswith("_tmp_")]

    page = (out / "report.html").read_text()
    assert not re.search(r"https?://", page)
    assert "2026-11-21T10:00:00Z to 2026-11-21T10:00:04.001Z" in page
    # Five charts (the funnel twice: per platform and per notification class), all inline.
    assert re.findall(r'src="([a-z]+):', page) == ["data"] * 5
    for text in ("wss://a", "wss://b", "lag_p99_ms", "inbox_miss_rate", "delivery_rate", "android"):
        assert text in page
    headings = [
        "Worst relays by inbox miss rate",
        "Worst relays by canary delivery",
        "Wakeups per platform",
        "Canary probes",
        "Missed DMs",
        "Relay latency",
        "Delivery funnel",
    ]
    positions = [page.index(h) for h in headings]
    assert positions == sorted(positions)
    # The summary ranks wss://b (inbox 1 of 2 missed) above wss://a.
    summary_part = page[positions[0] : positions[1]]
    assert summary_part.index("wss://b") < summary_part.index("wss://a")


def test_empty_input_gives_headers_and_a_report_saying_so(
    spark: SparkSession, log: ObservationLog, tmp_path: Path
) -> None:
    out = tmp_path / "reports"

    summary = run_all(log.path, str(out))

    assert summary.records_read == 0 and set(summary.rows.values()) == {0}
    for name, columns in CONTRACT_COLUMNS.items():
        assert read_csv(out / name) == [columns]
    page = (out / "report.html").read_text()
    assert "No data in this window." in page
    assert "<img" not in page


def test_main_reports_a_missing_input_as_bad_usage(tmp_path: Path) -> None:
    """Without a session of the tests' own: the check comes before one would start."""
    assert main(["--input", str(tmp_path / "missing"), "--output", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_job_modules_run_as_scripts() -> None:
    """spark-submit runs analytics/<job>.py as a plain script: the package must still import."""
    for script in ("run", "canary", "relay_latency", "dropped_events", "delivery"):
        result = subprocess.run(
            [sys.executable, str(REPO / "analytics" / f"{script}.py"), "--help"],
            capture_output=True,
            text=True,
            check=False,
            cwd="/",
        )
        assert result.returncode == 0, result.stderr
        assert "--since" in result.stdout
