"""Inbox-aware misses (``expect`` records, ``--grace``) and the canary job, by hand."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from analytics import canary as canary_job
from analytics import dropped_events
from analytics.observations import load_observations
from tests.analytics.observation_logs import (
    CONTRACT_COLUMNS,
    MINUTE,
    SECOND,
    T0_MS,
    ObservationLog,
    canary,
    expect,
    relay,
    seen,
)

pytestmark = pytest.mark.spark

A, B, C = "wss://a.example", "wss://b.example", "wss://c.example"


def rows(df: DataFrame) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in df.collect()]


def write_inbox_story(log: ObservationLog) -> None:
    """A and B stay up; C is down from 10:00:25 to 10:00:45.

    e1 inbox [A, B]: both deliver (B 500 ms later), and the bridge wrote its expect twice.
    e2 inbox [A, B]: B never delivers. e3 inbox [A, B]: B delivers 3 minutes late. e4 inbox
    [C] while C is down: nobody's inbox miss. e5 has no expect record (not a DM to a user of
    this bridge). e6 inbox [C, A] after C is back: C misses it. k1 is a canary probe that A
    delivered: it is nobody's DM, so B and C do not miss it.
    """
    t = T0_MS
    log.write(
        "20261121T10",
        [
            relay(t, A, "connected"),
            relay(t, B, "connected"),
            relay(t, C, "connected"),
            seen(t + 1 * SECOND, A, "e1"),
            expect(t + 1 * SECOND + 5, "e1", [A, B]),
            expect(t + 1 * SECOND + 9, "e1", [A, B]),
            seen(t + 1 * SECOND + 500, B, "e1"),
            seen(t + 10 * SECOND, A, "e2"),
            expect(t + 10 * SECOND + 5, "e2", [A, B]),
            seen(t + 20 * SECOND, A, "e3"),
            expect(t + 20 * SECOND + 5, "e3", [B, A]),
            canary(t + 22 * SECOND, A, "k1", received_ms=300),
            seen(t + 22 * SECOND + 300, A, "k1"),
            relay(t + 25 * SECOND, C, "disconnected"),
            seen(t + 30 * SECOND, A, "e4"),
            expect(t + 30 * SECOND + 5, "e4", [C]),
            seen(t + 40 * SECOND, A, "e5"),
            relay(t + 45 * SECOND, C, "connected"),
            seen(t + 50 * SECOND, A, "e6"),
            expect(t + 50 * SECOND + 5, "e6", [C, A, ""]),
            seen(t + 20 * SECOND + 3 * MINUTE, B, "e3"),
        ],
    )


def test_inbox_columns_count_only_the_dms_sent_to_the_relay(
    spark: SparkSession, log: ObservationLog
) -> None:
    """Overall, B expected all six DMs and (late e3 included) saw one: 5/6 missed, the noise
    the issue describes. Its inbox held e1, e2, e3: 2/3 missed. C expected e1-e3 and e6 but
    only e6 in its inbox (e4 came while it was down): 1/1 missed. A saw everything in time."""
    write_inbox_story(log)
    obs = load_observations(spark, log.path)

    results = dropped_events.compute(obs)

    dropped = results["dropped_events"]
    assert dropped.columns == CONTRACT_COLUMNS["dropped_events.csv"]
    assert rows(dropped) == [
        (A, 6, 6, 0, 0.0, 4, 4, 0, 0.0),
        (B, 6, 1, 5, 5 / 6, 3, 1, 2, 2 / 3),
        (C, 4, 0, 4, 1.0, 1, 0, 1, 1.0),
    ]
    hourly = results["dropped_events_hourly"]
    assert hourly.columns[:2] == ["relay", "hour"]
    assert hourly.columns[2:] == CONTRACT_COLUMNS["dropped_events.csv"][1:]
    assert rows(hourly.where("relay = 'wss://b.example'").drop("relay", "hour")) == [
        (6, 1, 5, 5 / 6, 3, 1, 2, 2 / 3)
    ]
    obs.release()


def test_a_longer_grace_forgives_the_late_delivery(spark: SparkSession, log: ObservationLog) -> None:
    """With five minutes of grace B's e3, 3 minutes late, is seen: overall 2 of 6, inbox 2 of 3."""
    write_inbox_story(log)
    obs = load_observations(spark, log.path, grace_ms=5 * MINUTE)

    dropped = dropped_events.compute(obs)["dropped_events"]

    assert rows(dropped.where("relay = 'wss://b.example'")) == [
        (B, 6, 2, 4, 4 / 6, 3, 2, 1, 1 / 3)
    ]
    obs.release()


def test_canary_counts_probes_publishes_and_round_trips(
    spark: SparkSession, log: ObservationLog
) -> None:
    """A: four probes, one refused ("blocked"), one accepted but never back; the two that came
    back took 800 and 1200 ms. B logged its first probe twice (at publish, then on receipt):
    one probe, delivered in 300 ms; its second took 500 ms. C's only probe never came back."""
    t = T0_MS
    log.write(
        "20261121T10",
        [
            canary(t, A, "k1", received_ms=800),
            canary(t + 5 * MINUTE, A, "k2", received_ms=1200.0),
            canary(t + 10 * MINUTE, A, "k3"),
            canary(t + 15 * MINUTE, A, "k4", published=False, ok_message="blocked: paid relay"),
            canary(t, B, "k5"),
            canary(t + 300, B, "k5", received_ms=300),
            canary(t + 5 * MINUTE, B, "k6", received_ms=500),
            canary(t, C, "k7"),
        ],
    )
    obs = load_observations(spark, log.path)

    result = canary_job.compute(obs)["canary"]

    assert result.columns == CONTRACT_COLUMNS["canary.csv"]
    assert rows(result) == [
        (A, 4, 3, 2, 0.5, 800, 1200),
        (B, 2, 2, 2, 1.0, 300, 500),
        (C, 1, 1, 0, 0.0, None, None),
    ]
    assert obs.corrupt_lines == 0
    obs.release()


def test_expect_and_canary_records_without_their_fields_are_corrupt(
    spark: SparkSession, log: ObservationLog
) -> None:
    """An expect without relays, a canary without `published` or with a text `received_ms`
    are counted as corrupt, not guessed at; the good ones still count."""
    t = T0_MS
    log.write(
        "20261121T10",
        [
            relay(t, A, "connected"),
            seen(t + SECOND, A, "e1"),
            expect(t + SECOND, "e1", [A]),
            {"type": "expect", "ts": t, "event_id": "e1"},
            {"type": "expect", "ts": t, "event_id": "e1", "relays": "wss://a.example"},
            {"type": "canary", "ts": t, "relay": A, "event_id": "k1", "received_ms": 5},
            {"type": "canary", "ts": t, "relay": A, "event_id": "k2", "published": True,
             "received_ms": "soon"},
            canary(t, A, "k3", received_ms=40),
        ],
    )
    obs = load_observations(spark, log.path)

    assert obs.corrupt_lines == 4
    assert rows(dropped_events.compute(obs)["dropped_events"]) == [(A, 1, 1, 0, 0.0, 1, 1, 0, 0.0)]
    assert rows(canary_job.compute(obs)["canary"]) == [(A, 1, 1, 1, 1.0, 40, 40)]
    obs.release()
