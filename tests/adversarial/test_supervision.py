"""Supervision: a task that raises is logged, counted and restarted with backoff, reported as
down meanwhile; a commit batch holding a poison event is retried once, then committed event
by event, the poison skipped and counted, and nothing is remembered as seen before its write."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from sigil_push.bridge.pending import Arrival
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.records import Device
from sigil_push.supervisor import BackgroundTasks, Supervisor
from testkit.fakes.harness import eventually
from testkit.in_process import in_process_bridge
from testkit.stores import Engine

RELAY = "wss://relay.example"


def _restarts(task: str) -> float:
    return REGISTRY.get_sample_value("sigil_push_task_restarts_total", {"task": task}) or 0.0


async def test_a_failing_task_is_restarted_counted_and_reported_down() -> None:
    supervisor = Supervisor()
    runs: list[float] = []
    before = _restarts("flaky")
    seen_down: list[list[str]] = []

    async def flaky() -> None:
        runs.append(time.monotonic())
        if len(runs) < 3:
            raise OverflowError("boom")

    task = supervisor.spawn("flaky", flaky, core=True)
    while not task.done():
        if supervisor.down():
            seen_down.append(supervisor.down())
        await asyncio.sleep(0.005)
    assert len(runs) == 3
    assert _restarts("flaky") - before == 2
    assert ["flaky"] in seen_down
    assert supervisor.down() == []
    assert runs[2] - runs[1] > runs[1] - runs[0] > 0, "backoff grows"


async def test_an_impaired_task_is_down_with_its_reason_until_it_recovers() -> None:
    """A running core task that cannot work (the committer while the database refuses
    writes) is listed as down with its reason; a task waiting to restart says so."""
    supervisor = Supervisor()
    supervisor.impaired("bridge-commit", "database unavailable (OperationalError)")
    assert supervisor.down() == ["bridge-commit"]
    assert supervisor.reasons() == {"bridge-commit": "database unavailable (OperationalError)"}
    supervisor.impaired("bridge-commit", None)
    assert supervisor.down() == []
    assert supervisor.reasons() == {}
    release = asyncio.Event()

    async def fails_once() -> None:
        if not release.is_set():
            release.set()
            raise OverflowError("boom")

    task = supervisor.spawn("flaky-once", fails_once, core=True)
    await eventually(lambda: supervisor.down() == ["flaky-once"] or task.done(), what="down")
    if not task.done():
        assert supervisor.reasons() == {"flaky-once": "restarting after an exception"}
    await task
    assert supervisor.reasons() == {}


async def test_a_failed_background_task_is_logged_by_type_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A one-off task (an AUTH answer, a subscription sync) that raises is reported at once,
    its type only (the message may carry event data); a cancelled one is not a failure."""
    def failures() -> float:
        labels = {"task": "test-kind"}
        return REGISTRY.get_sample_value("sigil_push_background_task_failures_total", labels) or 0.0

    before = failures()
    tasks = BackgroundTasks("test-kind")
    hold = asyncio.Event()

    async def fails() -> None:
        raise KeyError("npub1secret")

    tasks.spawn(fails())
    tasks.spawn(hold.wait())
    with caplog.at_level(logging.ERROR, logger="sigil_push.supervisor"):
        while failures() == before:
            await asyncio.sleep(0.005)
        assert len(tasks.running()) == 1
        tasks.cancel()
        while tasks.running():
            await asyncio.sleep(0.005)
    assert failures() - before == 1
    assert "test-kind failed (KeyError)" in caplog.text
    assert "npub1secret" not in caplog.text


async def test_a_poison_event_is_skipped_after_two_failures_and_the_rest_is_committed(
    tmp_path: Path, engine: Engine
) -> None:
    recipient, sender = SecretKey.generate(), SecretKey.generate()
    async with in_process_bridge(tmp_path, engine.database("push.db")) as parts:
        db, devices, outbox, bridge = parts.db, parts.devices, parts.outbox, parts.bridge
        pubkey = recipient.public_key_hex
        await devices.register(pubkey, "android", "fcm-token", "opaque", (), None, 0)
        await eventually(lambda: pubkey in bridge._registry.keys, what="the key watched")
        events = [sign_event(sender, 4, f"m{i}", [["p", pubkey]]) for i in range(3)]
        poison = events[1].id
        committer = bridge._committer
        write = committer._write

        async def refusing(writes: list[tuple[Arrival, list[Device]]], *rest: Any) -> None:
            """A database that refuses one event's write (as an unforeseen value would)."""
            if any(arrival.event.id == poison for arrival, _ in writes):
                raise OverflowError("Python int too large to convert to SQLite INTEGER")
            await write(writes, *rest)

        committer._write = refusing  # type: ignore[method-assign, assignment]
        before = REGISTRY.get_sample_value("sigil_push_bridge_poison_events_total") or 0.0
        for event in events:  # one batch: nothing yields in between
            bridge.port.ingest.user_event(RELAY, pubkey, event.to_json(), int(time.time() * 1000), False)

        async def committed() -> bool:
            return await outbox.depth() == 2

        await eventually(committed, what="the good events committed")
        assert (REGISTRY.get_sample_value("sigil_push_bridge_poison_events_total") or 0) - before == 1
        rows = await db.execute_fetchall("SELECT event_id FROM outbox")
        assert {r[0] for r in rows} == {events[0].id, events[2].id}
        assert not bridge._seen.known(events[1].id), "a failed write leaves nothing seen"
        later = sign_event(sender, 4, "later", [["p", pubkey]])
        bridge.port.ingest.user_event(RELAY, pubkey, later.to_json(), int(time.time() * 1000), False)

        async def loop_alive() -> bool:
            return await outbox.depth() == 3

        await eventually(loop_alive, what="the commit loop still running")
        assert bridge.supervisor.down() == []
