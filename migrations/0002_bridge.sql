-- The relay bridge's memory: which events were already handled (exactly-once across relays and
-- restarts), which relay delivered which event first (one `seen` record per relay), which
-- (relay, key) pairs are past their first-subscription baseline, per-relay catch-up cursors,
-- and the latest kind 10050 / 10002 relay list of each registered key.

-- `relay` is the first relay that delivered the event; every further one gets a row in
-- seen_on_relay (one row per event in the common single-relay case keeps ingest cheap).
-- Retention is measured from the later of arrival and created_at, so an event whose
-- created_at is ahead of the clock is still remembered while a catch-up may return it.
CREATE TABLE IF NOT EXISTS seen_events (
    event_id TEXT PRIMARY KEY,
    relay TEXT NOT NULL,
    keep_until INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS seen_events_by_expiry ON seen_events (keep_until);

CREATE TABLE IF NOT EXISTS seen_on_relay (
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    keep_until INTEGER NOT NULL,
    PRIMARY KEY (event_id, relay)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS seen_on_relay_by_expiry ON seen_on_relay (keep_until);

CREATE TABLE IF NOT EXISTS relay_baselines (
    relay TEXT NOT NULL,
    pubkey TEXT NOT NULL,
    baselined_at INTEGER NOT NULL,
    PRIMARY KEY (relay, pubkey)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS relay_baselines_by_pubkey ON relay_baselines (pubkey);

CREATE TABLE IF NOT EXISTS relay_cursors (
    relay TEXT PRIMARY KEY,
    live_until INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS relay_lists (
    pubkey TEXT NOT NULL,
    kind INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    relays TEXT NOT NULL,
    PRIMARY KEY (pubkey, kind)
) WITHOUT ROWID;
