"""Reading the observation log: schema, corrupt lines, compressed files and time pruning."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pyspark.sql import SparkSession

from analytics.observations import InputError, file_hour_ms, load_observations
from tests.analytics.observation_logs import HOUR, MINUTE, T0, T0_MS, ObservationLog, relay, seen

pytestmark = pytest.mark.spark


def test_file_names_give_the_hour_they_hold() -> None:
    """Only names of the form observations-YYYYMMDDTHH.jsonl[.gz] carry an hour (UTC)."""
    assert file_hour_ms("observations-20261121T10.jsonl") == T0_MS
    assert file_hour_ms("observations-20261121T11.jsonl.gz") == T0_MS + HOUR
    assert file_hour_ms("observations-20261121.jsonl") is None
    assert file_hour_ms("observations-20261121T10.jsonl.tmp") is None


def test_corrupt_lines_are_counted_not_fatal(spark: SparkSession, log: ObservationLog) -> None:
    """Malformed JSON, wrong types, missing type or required fields count as corrupt lines;
    unknown record types are skipped silently; extra fields are ignored; gzip files are read."""
    log.write(
        "20261121T10",
        [
            seen(T0_MS + 1, "wss://a", "e1"),
            '{"type": "seen", "ts": 17952552',
            '{"type": "seen", "ts": "yesterday", "relay": "wss://a", "event_id": "e2"}',
            {"type": "seen", "ts": T0_MS + 2, "event_id": "e3"},
            {"relay": "wss://a", "ts": T0_MS + 3},
            {"type": "from_a_newer_bridge", "ts": T0_MS + 4, "relay": "wss://a"},
            {**relay(T0_MS, "wss://a", "connected"), "extra": {"nested": [1, 2]}},
            "",
        ],
    )
    log.write("20261121T11", [seen(T0_MS + HOUR + 5, "wss://b", "e1"), "not json"], compress=True)

    obs = load_observations(spark, log.path)

    assert obs.files_read == 2
    assert obs.records_read == 9
    assert obs.corrupt_lines == 5
    assert obs.records_in_window == 3
    assert sorted(tuple(r) for r in obs.seen.select("relay", "event_id").collect()) == [
        ("wss://a", "e1"),
        ("wss://b", "e1"),
    ]
    assert (obs.start_ms, obs.end_ms) == (T0_MS, T0_MS + HOUR + 6)
    obs.release()


def test_since_and_until_open_only_the_hours_needed(
    spark: SparkSession, log: ObservationLog
) -> None:
    """A window opens only the files of its hours (the corrupt line of 09:00 is never read)
    and drops rows outside it, such as a straggler written into the 10:00 file after 11:00."""
    log.write("20261121T09", [relay(T0_MS - HOUR, "wss://a", "connected"), "{{{"])
    log.write(
        "20261121T10",
        [seen(T0_MS + 10 * MINUTE, "wss://a", "e1"), seen(T0_MS + HOUR + 500, "wss://a", "e9")],
    )
    log.write("20261121T11", [seen(T0_MS + HOUR + 10 * MINUTE, "wss://a", "e3")])

    obs = load_observations(spark, log.path, since=T0, until=T0 + timedelta(hours=1))

    assert obs.files_read == 1
    assert obs.records_read == 2
    assert obs.corrupt_lines == 0
    assert obs.records_in_window == 1
    assert [r.event_id for r in obs.seen.collect()] == ["e1"]
    assert (obs.start_ms, obs.end_ms) == (T0_MS, T0_MS + HOUR)
    obs.release()


def test_empty_folder_is_an_empty_window(spark: SparkSession, log: ObservationLog) -> None:
    obs = load_observations(spark, log.path)

    assert (obs.files_read, obs.records_read, obs.corrupt_lines, obs.records_in_window) == (
        0,
        0,
        0,
        0,
    )
    assert obs.start_ms is None and obs.end_ms is None
    obs.release()


def test_missing_input_and_inverted_window_are_usage_errors(
    spark: SparkSession, log: ObservationLog
) -> None:
    with pytest.raises(InputError, match="does not exist"):
        load_observations(spark, log.path + "/nope")
    with pytest.raises(InputError, match="before --until"):
        load_observations(spark, log.path, since=T0, until=T0)
