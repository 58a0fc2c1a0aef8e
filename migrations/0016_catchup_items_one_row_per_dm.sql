-- One catch-up row per DM and recipient, listing every relay that delivered it (issue 23).
-- With every DM from several relays, catchup_items held a row per relay's copy: a rowid, an
-- entry in the (relay, pubkey, event_id) unique index and two in the expiry and `noted_at`
-- indexes, about 6 us of SQLite's CPU each, which was most of what a further relay's copy
-- cost the bridge. The copies of one DM are noted within a second and written in one flush,
-- so they now share one row whose `relays` lists them, space-separated (no URL has a space,
-- as in seen_events.relay); a relay's copy written by a later flush is appended to the row
-- (and its `noted_at` moved on, so a restart's read past a snapshot's cut finds it). A relay's
-- items are the rows that list it.
--
-- A row keeps the first created_at written for its id: a firehose relay's DM for nobody here
-- is noted from its unverified text, and a relay that sent another time for a known id only
-- has that id fetched again by its next reconciliation (then dropped as a copy).
--
-- The moved rows keep their order by `noted_at`; `noted_at` is indexed alone (the relay is
-- read from the rows), the expiry index is unchanged. The PostgreSQL tree does the same
-- (migrations/postgres/0016_...).

CREATE TABLE catchup_items_by_dm (
    id INTEGER PRIMARY KEY,
    pubkey BLOB NOT NULL,
    event_id BLOB NOT NULL,
    created_at INTEGER NOT NULL,
    noted_at INTEGER NOT NULL DEFAULT 0,
    relays TEXT NOT NULL,
    UNIQUE (pubkey, event_id)
);
INSERT INTO catchup_items_by_dm (pubkey, event_id, created_at, noted_at, relays)
    SELECT pubkey, event_id, MIN(created_at), MAX(noted_at), group_concat(relay, ' ')
    FROM catchup_items GROUP BY pubkey, event_id ORDER BY MAX(noted_at), MIN(created_at);
DROP TABLE catchup_items;
ALTER TABLE catchup_items_by_dm RENAME TO catchup_items;
CREATE INDEX catchup_items_by_time ON catchup_items (created_at);
CREATE INDEX catchup_items_by_noted ON catchup_items (noted_at);
