-- Many accounts per device (issue 10): a registration is an (npub, device token) pair, so one
-- token may be registered by several npubs. The UNIQUE constraint moves from `token` to
-- (token, pubkey); every existing row becomes a pair, unchanged, ids included. The PostgreSQL
-- schema makes the same change in migrations/postgres/0003_device_pairs.sql.
--
-- SQLite cannot alter a UNIQUE constraint: `devices` is rebuilt. The outbox references device
-- ids (ON DELETE CASCADE), so dropping the old `devices` while the outbox still pointed at it
-- would, with foreign keys on (as `serve` runs), delete every queued wakeup. So the outbox is
-- rebuilt alongside, pointing at the new table, and both old tables are dropped child first:
-- when the old `devices` goes, nothing references it any more. Renaming the new table then
-- carries the outbox's reference along (SQLite >= 3.26 rewrites foreign keys on rename). This
-- works the same with foreign keys on or off, inside the runner's transaction.

CREATE TABLE devices_paired (
    id INTEGER PRIMARY KEY,
    pubkey TEXT NOT NULL,
    platform TEXT NOT NULL,
    token TEXT NOT NULL,
    payload TEXT NOT NULL DEFAULT 'opaque',
    relays TEXT NOT NULL DEFAULT '[]',
    webpush_p256dh TEXT,
    webpush_auth TEXT,
    registered_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    UNIQUE (token, pubkey)
);
INSERT INTO devices_paired (id, pubkey, platform, token, payload, relays, webpush_p256dh,
                            webpush_auth, registered_at, updated_at)
    SELECT id, pubkey, platform, token, payload, relays, webpush_p256dh, webpush_auth,
           registered_at, updated_at
    FROM devices;

CREATE TABLE outbox_paired (
    id INTEGER PRIMARY KEY,
    device_id INTEGER NOT NULL REFERENCES devices_paired (id) ON DELETE CASCADE,
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    event_json TEXT,
    first_seen_ms INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_ms INTEGER NOT NULL,
    claimed_ms INTEGER,
    UNIQUE (device_id, event_id)
);
INSERT INTO outbox_paired (id, device_id, event_id, relay, event_json, first_seen_ms, attempts,
                           next_attempt_ms, claimed_ms)
    SELECT id, device_id, event_id, relay, event_json, first_seen_ms, attempts, next_attempt_ms,
           claimed_ms
    FROM outbox;

DROP TABLE outbox;
DROP TABLE devices;
ALTER TABLE devices_paired RENAME TO devices;
ALTER TABLE outbox_paired RENAME TO outbox;

CREATE INDEX devices_by_pubkey ON devices (pubkey);
CREATE INDEX outbox_unclaimed_by_due ON outbox (next_attempt_ms) WHERE claimed_ms IS NULL;
