"""`sigil-push analytics` as a user runs it: a real process, its own Spark session."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tests.analytics.observation_logs import SECOND, T0_MS, ObservationLog, relay, seen

pytestmark = pytest.mark.spark


def test_cli_writes_the_contract_reports(tmp_path: Path) -> None:
    log = ObservationLog(tmp_path / "observations")
    log.write(
        "20261121T10",
        [
            relay(T0_MS, "wss://a", "connected"),
            relay(T0_MS, "wss://b", "connected"),
            seen(T0_MS + 1 * SECOND, "wss://a", "e1"),
            seen(T0_MS + 3 * SECOND, "wss://b", "e1"),
            seen(T0_MS + 5 * SECOND, "wss://a", "e2"),
            "{not json",
        ],
    )
    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, "-m", "sigil_push", "analytics", "--master", "local[1]",
         "--input", log.path, "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 corrupt lines" in result.stdout
    with (out / "dropped_events.csv").open(newline="") as handle:
        rows = {row["relay"]: row for row in csv.DictReader(handle)}
    assert rows["wss://b"]["expected"] == "2" and rows["wss://b"]["missed"] == "1"
    assert rows["wss://a"]["missed"] == "0"
    assert (out / "report.html").read_text().count("<table") >= 3


def test_cli_missing_input_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sigil_push", "analytics", "--master", "local[1]",
         "--input", str(tmp_path / "absent"), "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip()
