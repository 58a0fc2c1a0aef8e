-- NIP-77 catch-up after a restart without reading the window back: a relay's sorted
-- (created_at, id) items with their prefix sums as one binary snapshot
-- (sigil_push/nostr/nip77_snapshot.py), written now and then and at a clean shutdown, and
-- when each catch-up item was written (`noted_at`, unix milliseconds), so a restart reads only
-- the rows noted since the snapshot's `cut` (ms; gift wraps are back-dated: created_at cannot tell).
-- One snapshot per relay and scope ('' for a firehose window); pruned with the window.
ALTER TABLE catchup_items ADD COLUMN noted_at INTEGER NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS catchup_items_by_noted ON catchup_items (relay, noted_at);
CREATE TABLE IF NOT EXISTS catchup_snapshots (
    relay TEXT NOT NULL,
    scope TEXT NOT NULL,
    cut INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (relay, scope)
);
