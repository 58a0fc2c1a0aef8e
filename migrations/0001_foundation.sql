-- Devices registered for wakeups, single-use NIP-98 auth ids, the bridge's own key, and the
-- durable outbox of wakeups not yet answered by a provider.

CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS devices (
    id INTEGER PRIMARY KEY,
    pubkey TEXT NOT NULL,
    platform TEXT NOT NULL,
    token TEXT NOT NULL UNIQUE,
    payload TEXT NOT NULL DEFAULT 'opaque',
    relays TEXT NOT NULL DEFAULT '[]',
    webpush_p256dh TEXT,
    webpush_auth TEXT,
    registered_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS devices_by_pubkey ON devices (pubkey);

CREATE TABLE IF NOT EXISTS nip98_used (
    event_id TEXT PRIMARY KEY,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS nip98_used_by_expiry ON nip98_used (expires_at);

CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY,
    device_id INTEGER NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    event_json TEXT,
    first_seen_ms INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_ms INTEGER NOT NULL,
    UNIQUE (device_id, event_id)
);
CREATE INDEX IF NOT EXISTS outbox_by_due ON outbox (next_attempt_ms);
