-- The same change as SQLite's migrations/0012_catchup_deliveries.sql (explained there): one
-- row per (recipient, DM) listing every relay that delivered it (joined by one space), in
-- place of 0010's row per relay.

CREATE TABLE IF NOT EXISTS catchup_deliveries (
    pubkey TEXT NOT NULL,
    event_id TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    relays TEXT NOT NULL,
    PRIMARY KEY (pubkey, event_id)
);
CREATE INDEX IF NOT EXISTS catchup_deliveries_by_time ON catchup_deliveries (created_at);
INSERT INTO catchup_deliveries (pubkey, event_id, created_at, relays)
    SELECT pubkey, event_id, MIN(created_at), string_agg(relay, ' ' ORDER BY relay)
    FROM catchup_items GROUP BY pubkey, event_id;
DROP TABLE catchup_items;
