"""The three jobs on hand-built logs, against counts and rates worked out by hand."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from analytics import delivery, dropped_events, relay_latency
from analytics.observations import load_observations
from sigil_push.bridge.watches import CLASS_OF_KIND
from tests.analytics.observation_logs import (
    CONTRACT_COLUMNS,
    HOUR,
    MINUTE,
    SECOND,
    T0,
    T0_MS,
    ObservationLog,
    push,
    relay,
    seen,
    suppressed,
)

pytestmark = pytest.mark.spark

A, B, C, D = "wss://a.example", "wss://b.example", "wss://c.example", "wss://d.example"
OVERALL = ["relay", "expected", "seen", "missed", "miss_rate"]
INBOX = ["relay", "inbox_expected", "inbox_seen", "inbox_missed", "inbox_miss_rate"]


def rows(df: DataFrame) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in df.collect()]


def write_disconnect_story(log: ObservationLog) -> None:
    """Relay B drops out from 10:00:30 to 10:01:00 while A stays up.

    e1 A first, B +500 ms; e2 B first, A +200 ms; e3 and e4 arrive (A) while B is down; B
    hands e3 over late, at reconnection catch-up; e5 (A) is missed by B; e6 at 11:00:10 (B)
    is missed by A.
    """
    t = T0_MS
    log.write(
        "20261121T10",
        [
            relay(t, A, "connected"),
            relay(t, B, "connected"),
            seen(t + 10 * SECOND, A, "e1"),
            seen(t + 10 * SECOND + 500, B, "e1"),
            seen(t + 20 * SECOND, B, "e2"),
            seen(t + 20 * SECOND + 200, A, "e2"),
            relay(t + 30 * SECOND, B, "disconnected"),
            seen(t + 40 * SECOND, A, "e3"),
            seen(t + 50 * SECOND, A, "e4"),
            relay(t + 60 * SECOND, B, "connected"),
            seen(t + 65 * SECOND, B, "e3"),
            seen(t + 70 * SECOND, A, "e5"),
        ],
    )
    log.write("20261121T11", [seen(t + HOUR + 10 * SECOND, B, "e6")])


def test_relay_that_disconnects_is_not_expected_to_deliver_meanwhile(
    spark: SparkSession, log: ObservationLog
) -> None:
    """A expects all six events and missed e6: 1/6. B expects e1, e2, e5, e6 (e3 and e4 were
    first seen while it was down): it missed e5, 1/4; its late e3 counts in neither."""
    write_disconnect_story(log)
    obs = load_observations(spark, log.path)

    results = dropped_events.compute(obs)

    assert rows(results["dropped_events"].select(OVERALL)) == [
        (A, 6, 5, 1, 1 / 6),
        (B, 4, 3, 1, 0.25),
    ]
    assert rows(results["dropped_events_hourly"].select(OVERALL[:1] + ["hour"] + OVERALL[1:])) == [
        (A, "2026-11-21T10:00:00Z", 5, 5, 0, 0.0),
        (A, "2026-11-21T11:00:00Z", 1, 0, 1, 1.0),
        (B, "2026-11-21T10:00:00Z", 3, 2, 1, 1 / 3),
        (B, "2026-11-21T11:00:00Z", 1, 1, 0, 0.0),
    ]
    obs.release()


def test_lag_is_measured_against_the_first_arrival(
    spark: SparkSession, log: ObservationLog
) -> None:
    """A delivered e1-e5 with lags 0, 200, 0, 0, 0; B delivered e1, e2, e3, e6 with lags
    500, 0, 25 000 (late catch-up), 0. Percentiles are nearest-rank on such small sets."""
    write_disconnect_story(log)
    obs = load_observations(spark, log.path)

    latency = relay_latency.compute(obs)["relay_latency"]

    assert latency.columns == CONTRACT_COLUMNS["relay_latency.csv"]
    assert rows(latency) == [(A, 5, 0, 200, 200), (B, 4, 0, 25_000, 25_000)]
    obs.release()


def test_window_start_infers_which_relays_were_connected(
    spark: SparkSession, log: ObservationLog
) -> None:
    """--since cuts off A's and C's `connected` records. A delivered before any state change,
    so it was up; C's first change is a disconnect at 10:30, so it was up until then and
    should have had e1; D only reports an `error` and delivers nothing: never expected."""
    log.write(
        "20261121T09", [relay(T0_MS - HOUR, A, "connected"), relay(T0_MS - HOUR, C, "connected")]
    )
    log.write(
        "20261121T10",
        [
            seen(T0_MS + 10 * MINUTE, A, "e1"),
            relay(T0_MS + 20 * MINUTE, D, "error"),
            relay(T0_MS + 30 * MINUTE, C, "disconnected"),
            seen(T0_MS + 40 * MINUTE, A, "e2"),
        ],
    )
    obs = load_observations(spark, log.path, since=T0, until=T0 + timedelta(hours=1))

    dropped = dropped_events.compute(obs)["dropped_events"]

    assert rows(dropped.select(OVERALL)) == [
        (A, 2, 2, 0, 0.0),
        (C, 1, 0, 1, 1.0),
        (D, 0, 0, 0, 0.0),
    ]
    obs.release()


def test_auth_states_and_reconnects_shape_the_connected_intervals(
    spark: SparkSession, log: ObservationLog
) -> None:
    """`auth_required` changes nothing, `authenticated_as_user` counts as connected, a repeated
    `connected` does not restart the interval and an `error` ends it."""
    t = T0_MS
    log.write(
        "20261121T10",
        [
            relay(t, A, "connected"),
            relay(t + 1 * SECOND, B, "auth_required"),
            seen(t + 2 * SECOND, A, "e1"),
            relay(t + 3 * SECOND, B, "authenticated_as_user"),
            relay(t + 4 * SECOND, B, "connected"),
            seen(t + 5 * SECOND, A, "e2"),
            relay(t + 6 * SECOND, B, "error"),
            seen(t + 7 * SECOND, A, "e3"),
            relay(t + 8 * SECOND, B, "auth_required"),
            seen(t + 9 * SECOND, A, "e4"),
        ],
    )
    obs = load_observations(spark, log.path)

    dropped = dropped_events.compute(obs)["dropped_events"]

    assert rows(dropped.select(OVERALL)) == [(A, 4, 4, 0, 0.0), (B, 1, 0, 1, 1.0)]
    obs.release()


def test_created_at_is_used_for_kind_4_only(spark: SparkSession, log: ObservationLog) -> None:
    """Kind 4: arrival minus created_at, reported apart (A: 2000 and 4000 ms, B: 2500 ms). The
    gift wrap's created_at, a day in the past, shows up nowhere: A's lag stays 0."""
    t = T0_MS
    log.write(
        "20261121T10",
        [
            relay(t, A, "connected"),
            relay(t, B, "connected"),
            seen(t + 2000, A, "e1", kind=4, created_at=t // 1000),
            seen(t + 2500, B, "e1", kind=4, created_at=t // 1000),
            seen(t + 3000, A, "e2", kind=1059, created_at=t // 1000 - 86_400),
            seen(t + 5000, A, "e3", kind=4, created_at=t // 1000 + 1),
        ],
    )
    obs = load_observations(spark, log.path)

    results = relay_latency.compute(obs)

    assert rows(results["relay_latency"]) == [(A, 3, 0, 0, 0), (B, 1, 500, 500, 500)]
    assert rows(results["relay_latency_created_at"]) == [
        (A, 2, 2000, 4000, 4000),
        (B, 1, 2500, 2500, 2500),
    ]
    obs.release()


def test_delivery_funnel_counts_one_final_outcome_per_event(
    spark: SparkSession, log: ObservationLog
) -> None:
    """ios: e1 retry then accepted (300 ms), e2 accepted on one device and unregistered on
    another (accepted, 200 ms), e3 only retried so far (no outcome), e4 failed (5000 ms).
    android: e1 rejected (80), e5 unregistered (40), e6 accepted without a latency."""
    t = T0_MS
    log.write(
        "20261121T10",
        [
            push(t + 1, "e1", "ios", "retry", 100),
            push(t + 2, "e1", "ios", "accepted", 300),
            push(t + 3, "e2", "ios", "unregistered", 50),
            push(t + 4, "e2", "ios", "accepted", 200),
            push(t + 5, "e3", "ios", "retry", 400),
            push(t + 6, "e4", "ios", "failed", 5000),
            push(t + 7, "e1", "android", "rejected", 80),
            push(t + 8, "e5", "android", "unregistered", 40),
            push(t + 9, "e6", "android", "accepted", None),
        ],
    )
    obs = load_observations(spark, log.path)

    funnel = delivery.compute(obs)["delivery"]

    assert funnel.columns == CONTRACT_COLUMNS["delivery.csv"]
    assert rows(funnel) == [
        ("android", 3, 1, 1, 1, 0, 40, 80, 0), ("ios", 4, 2, 0, 0, 1, 300, 5000, 0)
    ]
    obs.release()


def test_the_funnel_splits_by_notification_class(
    spark: SparkSession, log: ObservationLog
) -> None:
    """A DM and a mention accepted, a reaction rejected, a zap muted (class from its record),
    a repost quiet then pushed at the window's end (in both columns), an old record without
    a class (a DM's), a push of an event never seen (unknown) and one of another kind."""
    t = T0_MS
    log.write(
        "20261121T10",
        [
            seen(t, "wss://a", "dm", 4), seen(t, "wss://a", "note", 1),
            seen(t, "wss://a", "like", 7), seen(t, "wss://a", "boost", 16),
            seen(t, "wss://a", "article", 30023),
            push(t + 1, "dm", "ios", "accepted", 10),
            push(t + 2, "note", "android", "accepted", 20),
            push(t + 3, "like", "ios", "rejected", 30),
            suppressed(t + 4, "zap", "muted", "zap"),
            suppressed(t + 5, "boost", "quiet", "repost"),
            push(t + 6, "boost", "ios", "accepted", 60_000),
            suppressed(t + 7, "old", "paused"),
            push(t + 8, "ghost", "ios", "failed", 5),
            push(t + 9, "article", "ios", "accepted", 5),
        ],
    )
    obs = load_observations(spark, log.path)

    split = delivery.compute(obs)[delivery.BY_CLASS]

    assert split.columns == ["class", "events", "accepted", "unregistered", "rejected",
                             "failed", "suppressed"]
    assert rows(split) == [
        ("dm", 2, 1, 0, 0, 0, 1),
        ("mention", 1, 1, 0, 0, 0, 0),
        ("other", 1, 1, 0, 0, 0, 0),
        ("reaction", 1, 0, 0, 1, 0, 0),
        ("repost", 1, 1, 0, 0, 0, 1),
        ("unknown", 1, 0, 0, 0, 1, 0),
        ("zap", 1, 0, 0, 0, 0, 1),
    ]
    obs.release()


def test_the_class_of_each_kind_is_the_bridges() -> None:
    assert delivery.CLASS_OF_KIND == dict(CLASS_OF_KIND)


def test_suppressed_dms_have_their_own_column_not_failures(
    spark: SparkSession, log: ObservationLog
) -> None:
    """e1 paused (recorded twice: two workers), e2 muted: the `none` row counts 2 suppressed
    DMs and no outcome. e3 was held back by a presence and pushed at its lapse: suppressed in
    the `none` row and accepted on ios. e4 accepted as usual. A suppressed record without a
    reason is corrupt."""
    t = T0_MS
    log.write(
        "20261121T10",
        [
            suppressed(t + 1, "e1", "paused"),
            suppressed(t + 2, "e1", "paused"),
            suppressed(t + 3, "e2", "muted"),
            suppressed(t + 4, "e3", "present"),
            push(t + 5, "e3", "ios", "accepted", 90_000),
            push(t + 6, "e4", "ios", "accepted", 100),
            {"type": "suppressed", "ts": t + 7, "event_id": "e5"},
        ],
    )
    obs = load_observations(spark, log.path)
    assert obs.corrupt_lines == 1

    funnel = delivery.compute(obs)["delivery"]

    assert funnel.columns == CONTRACT_COLUMNS["delivery.csv"]
    assert rows(funnel) == [
        ("ios", 2, 2, 0, 0, 0, 100, 90_000, 0),
        ("none", 3, 0, 0, 0, 0, None, None, 3),
    ]
    obs.release()
