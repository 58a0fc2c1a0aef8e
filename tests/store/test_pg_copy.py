"""`sigil-push migrate --from FILE.db` through the real CLI: an existing SQLite instance moves
onto a real PostgreSQL server with its registrations, waiting wakeups (resent under the same
collapse ids), handled event ids, baselines, cursors and used NIP-98 ids."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.factory import open_sqlite
from sigil_push.store.records import WebPushKeys
from sigil_push.store.seen import SeenEvents
from testkit.stores import open_test_store, seen_rows, sql_of
from tests.service.test_cli import run_cli

NOW_MS = int(time.time() * 1000)


async def _old_instance(path: Path) -> dict[str, object]:
    store = await open_sqlite(path)
    try:
        alice, bob = secrets.token_hex(32), secrets.token_hex(32)
        ios = (await store.devices.register(alice, "ios", "ab" * 32, "event_id", ["wss://a.example"], None, 0)).device
        up = (await store.devices.register(
            bob, "unifiedpush", "https://push.example/x", "opaque", (), WebPushKeys("p" * 87, "a" * 22), 0,
        )).device
        sealed = (await store.devices.register(
            alice, "ios", "cd" * 32, "sealed", (), None, 0,
            device_key=SecretKey.generate().public_key_hex,
        )).device
        event = sign_event(SecretKey.generate(), 4, "hi", [["p", alice]])
        await store.outbox.enqueue(event, "wss://a.example", NOW_MS, [ios, up, sealed])
        await store.outbox.resume(NOW_MS)
        due = await store.outbox.due(NOW_MS, 10)
        collapse = {w.id: store.outbox.collapse_id(w.id) for w in due}
        seen = SeenEvents(seen_rows(store), 3600, 10)
        await seen.save([(event.id, ("wss://a.example",), NOW_MS, event.created_at)],
                        [(event.id, "wss://b.example")])
        await sql_of(store).execute(
            "INSERT INTO relay_baselines VALUES (?, ?, ?)", ("wss://a.example", alice, 1)
        )
        await sql_of(store).execute("INSERT INTO relay_cursors VALUES (?, ?)", ("wss://a.example", 42))
        assert await store.auth_ids.claim("f" * 64, "e" * 128, "d" * 64)
        return {"alice": alice, "bob": bob, "event": event.id, "collapse": collapse,
                "ios": ios, "up": up, "sealed": (sealed.id, event.to_json())}
    finally:
        await store.close()


async def test_migrate_from_copies_an_sqlite_instance_into_postgres(
    tmp_path: Path, postgres_url: str
) -> None:
    old = await _old_instance(tmp_path / "old.db")
    config = tmp_path / "relays.toml"
    config.write_text(f'[server]\ndatabase = "{postgres_url}"\n')

    result = run_cli("migrate", "--config", str(config), "--from", str(tmp_path / "old.db"))
    assert result.returncode == 0, result.stderr
    assert "devices: 3" in result.stdout and "outbox: 3" in result.stdout
    assert "outbox_events: 1" in result.stdout

    store = await open_test_store(postgres_url, "new-worker")
    try:
        ios, _ = sorted(await store.devices.of_pubkey(str(old["alice"])), key=lambda d: d.id)
        assert ios == old["ios"]
        [up] = await store.devices.of_pubkey(str(old["bob"]))
        assert up == old["up"] and up.webpush_keys == WebPushKeys("p" * 87, "a" * 22)
        await store.outbox.resume(NOW_MS)
        due = await store.outbox.due(NOW_MS, 10)
        assert {w.id: store.outbox.collapse_id(w.id) for w in due} == old["collapse"]
        assert {w.event_id for w in due} == {old["event"]}
        # the sealed row's event came along (outbox_events, migration 0015), the others have none
        events = {w.device_id: w.event_json for w in due}
        sealed_id, event_json = old["sealed"]  # type: ignore[misc]
        assert json.loads(events.pop(sealed_id)) == event_json
        assert set(events.values()) == {None}
        assert not await store.auth_ids.claim("f" * 64, "e" * 128, "c" * 64), (
            "a spent NIP-98 event stays spent"
        )
        seen = SeenEvents(seen_rows(store), 3600, 10)
        await seen.lookup([str(old["event"])])
        assert seen.delivered_by(str(old["event"]), "wss://b.example")
        cursors = await sql_of(store).execute_fetchall("SELECT relay, live_until FROM relay_cursors")
        assert [tuple(r) for r in cursors] == [("wss://a.example", 42)]
        fresh = await store.devices.register(
            secrets.token_hex(32), "ios", "cd" * 32, "opaque", (), None, 0
        )
        assert fresh.device.id > max(ios.id, up.id, sealed_id), "ids continue after the copied ones"
    finally:
        await store.close()

    again = run_cli("migrate", "--config", str(config), "--from", str(tmp_path / "old.db"))
    assert again.returncode == 1
    assert len(again.stderr.strip().splitlines()) == 1 and "already has" in again.stderr


def test_migrate_from_needs_a_postgres_target(tmp_path: Path) -> None:
    config = tmp_path / "relays.toml"
    config.write_text('[server]\ndatabase = "local.db"\n')
    result = run_cli("migrate", "--config", str(config), "--from", str(tmp_path / "old.db"))
    assert result.returncode == 2
    assert "server.database" in result.stderr and len(result.stderr.strip().splitlines()) == 1
