-- What negentropy reconciliation offers a relay (0010's `catchup_items`), one row per
-- (recipient, DM) listing every relay that delivered it, instead of one row per relay.
-- On the real network every DM comes from 3-5 relays: each relay's row was two B-tree
-- inserts at a random key (the primary key and the time index), as much work for SQLite as
-- the event's own `seen_events` and outbox rows together, and most of the system time a
-- further relay's copy cost (WAL pages written and read back). A relay delivering a DM
-- already listed is appended to its row in place (the row's key and time stay).
--   relays   the relays' URLs joined by one space (no URL has a space), in the order they
--            were written; a relay is looked up as a whole word of it.
-- The PostgreSQL schema makes the same change in migrations/postgres/0012_catchup_deliveries.sql.

CREATE TABLE IF NOT EXISTS catchup_deliveries (
    pubkey TEXT NOT NULL,
    event_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    relays TEXT NOT NULL,
    PRIMARY KEY (pubkey, event_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS catchup_deliveries_by_time ON catchup_deliveries (created_at);
INSERT INTO catchup_deliveries (pubkey, event_id, created_at, relays)
    SELECT pubkey, event_id, MIN(created_at), group_concat(relay, ' ')
    FROM catchup_items GROUP BY pubkey, event_id;
DROP TABLE catchup_items;
