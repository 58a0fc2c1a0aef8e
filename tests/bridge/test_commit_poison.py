"""Only the database's passing states are retried by the committer (issue 34, item 8).

sqlite3 raises the same `OperationalError` for a busy file and for a statement that can never
run ("too many SQL variables"): the committer retried both forever, so one such batch would
stop every wakeup for good. Here the committer's connection allows fewer variables than one
batch's statements use (what a batch naming more keys than SQLite's limit did), a batch of 40
DMs fails, and the failure is the batch's own: it goes to the poison path (retried once, then
event by event), each DM is committed on its own, no outage is reported, and nothing is lost.
SQLite only: PostgreSQL's errors say by their class whether they are transient."""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.errors import error_name, transient
from sigil_push.store.records import IN_LIST_CHUNK
from testkit.fakes.harness import eventually
from testkit.in_process import in_process_bridge

RELAY = "wss://relay.example"
DMS = 40
VARIABLES = 16
"""Fewer than a 40-event batch's id lookup needs, more than one event's statements."""


def _retries() -> float:
    return REGISTRY.get_sample_value("sigil_push_bridge_commit_retries_total") or 0.0


async def _commit_dms(tmp_path: Path, count: int, variables: int) -> None:
    """`count` DMs to as many keys, ingested together (one batch), with at most `variables`
    per statement on the store's connections; returns once every wakeup is queued."""
    async with in_process_bridge(tmp_path, "push.db") as parts:
        db, devices, bridge = parts.db, parts.devices, parts.bridge
        recipients = [SecretKey.generate() for _ in range(count)]
        for index, key in enumerate(recipients):
            await devices.register(key.public_key_hex, "android", f"fcm-{index}", "opaque", (),
                                   None, 0)
        await eventually(lambda: len(bridge._registry.keys) >= count, what="the keys watched")
        link = bridge._link
        assert link is not None
        # the committer's own connection and the store's (its device reads)
        for connection in (link.db, parts.store.db):  # type: ignore[attr-defined, union-attr]
            await connection._execute(
                connection._conn.setlimit, sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, variables
            )
        retries = _retries()
        now_ms = int(time.time() * 1000)
        sender = SecretKey.generate()
        dms = [sign_event(sender, 4, "hi", [["p", key.public_key_hex]]) for key in recipients]
        for dm, key in zip(dms, recipients, strict=True):
            bridge.port.ingest.user_event(RELAY, key.public_key_hex, dm.to_json(), now_ms, False)

        async def all_queued() -> bool:
            rows = await db.execute_fetchall("SELECT DISTINCT event_id FROM outbox")
            return len(rows) == count

        await eventually(all_queued, timeout=60.0, what="every DM's wakeup in the outbox")
        assert _retries() == retries, "a deterministic failure was retried as an outage"
        assert bridge.supervisor.down() == [], "the committer reported itself impaired"


async def test_a_statement_that_can_never_run_is_not_retried_forever(tmp_path: Path) -> None:
    await _commit_dms(tmp_path, DMS, VARIABLES)


async def test_a_batch_naming_more_keys_than_sqlites_limit_is_committed_in_chunks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """700 recipients in one batch, 600 variables allowed: the `IN` lists go IN_LIST_CHUNK at
    a time, so the batch commits whole (no failed attempt, no event by event)."""
    assert IN_LIST_CHUNK < 600
    with caplog.at_level(logging.WARNING, logger="sigil_push.bridge.committer"):
        await _commit_dms(tmp_path, 700, 600)
    assert "failed" not in caplog.text


def test_busy_and_locked_are_transient_and_statement_faults_are_not() -> None:
    with sqlite3.connect(":memory:") as connection:
        connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 2)
        try:
            connection.execute("SELECT ?, ?, ?", (1, 2, 3))
        except sqlite3.OperationalError as exc:
            too_many = exc
        try:
            connection.execute("SELECT * FROM no_such_table")
        except sqlite3.OperationalError as exc:
            missing = exc
    assert not transient(too_many) and not transient(missing)
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]
    assert transient(busy)
    locked = sqlite3.OperationalError("database table is locked")
    locked.sqlite_errorcode = sqlite3.SQLITE_LOCKED_SHAREDCACHE  # type: ignore[attr-defined]
    assert transient(locked)
    assert transient(ConnectionResetError())


def test_a_failures_log_name_is_sqlites_own_and_never_its_message() -> None:
    """The committer's log lines name a failure by its type and SQLite's error name (which
    fault: a statement's, a disk's, a lock's), never by its message, which can quote values."""
    with sqlite3.connect(":memory:") as connection:
        try:
            connection.execute("SELECT * FROM no_such_table WHERE key = 'npub1secret'")
        except sqlite3.OperationalError as exc:
            missing = exc
    assert error_name(missing) == "OperationalError SQLITE_ERROR"
    assert error_name(ValueError("npub1secret")) == "ValueError"
