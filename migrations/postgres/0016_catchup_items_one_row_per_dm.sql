-- As SQLite's migrations/0016_catchup_items_one_row_per_dm.sql (explained there): one
-- catch-up row per DM and recipient, its `relays` listing every relay that delivered it
-- (space-separated), instead of a row per relay's copy; `noted_at` indexed alone.

CREATE TABLE catchup_items_by_dm (
    pubkey BYTEA NOT NULL,
    event_id BYTEA NOT NULL,
    created_at BIGINT NOT NULL,
    noted_at BIGINT NOT NULL DEFAULT 0,
    relays TEXT NOT NULL,
    PRIMARY KEY (pubkey, event_id)
);
INSERT INTO catchup_items_by_dm (pubkey, event_id, created_at, noted_at, relays)
    SELECT pubkey, event_id, MIN(created_at), MAX(noted_at),
           string_agg(relay, ' ' ORDER BY noted_at, relay)
    FROM catchup_items GROUP BY pubkey, event_id;
DROP TABLE catchup_items;
ALTER TABLE catchup_items_by_dm RENAME TO catchup_items;
ALTER INDEX catchup_items_by_dm_pkey RENAME TO catchup_items_pkey;
CREATE INDEX catchup_items_by_time ON catchup_items (created_at);
CREATE INDEX catchup_items_by_noted ON catchup_items (noted_at);
