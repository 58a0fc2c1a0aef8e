-- The ingest's rows, cheaper to write (issue 23). Every DM is two rows written in the batch's
-- transaction, and in WAL mode a commit's cost is the pages it dirties: each page is written
-- to the WAL whole. Keys that are random 64-character ids spread a batch's inserts over every
-- page of an index, so the cost per row grew with the table.
--
-- seen_events: a rowid table (rows in arrival order, so its pages and the expiry index's are
-- appended to) with the id as its 32 bytes under a unique index. In the old WITHOUT ROWID
-- table both the table and the expiry index were random: the index's entries are
-- (keep_until, event_id), and one second's rows all share a keep_until. `unhex` is
-- registered by the migration runner (store/sqlite/database.py): SQLite has it only from 3.41.
--
-- catchup_items (0010, with 0013's noted_at kept): a row per relay's delivery of a DM (four rows a DM with four relays),
-- keyed (relay, recipient, event id) in hex, and a WITHOUT ROWID table's expiry index repeats
-- that whole key (some 155 bytes an entry, twice). Now a rowid table in arrival order with the
-- key's two ids as bytes under a unique index, and an expiry index of (created_at, rowid).
-- The recipient '' (a firehose DM for nobody here) stays an empty value.
--
-- outbox: a wakeup's uniqueness per (device, event) was a second index keyed by the random id
-- (some 76 bytes an entry, random like the old seen_events). One process owns a SQLite file
-- (store/sqlite/coordination.py) and its committer hands an event to the outbox only in the
-- transaction that records it in seen_events, after finding it in neither its memory nor
-- that table: an event's wakeups are written once without the constraint. PostgreSQL keeps
-- it: several workers overlap on a shard during a hand-over and rely on it. The outbox keeps
-- an index on device_id alone, for the claim's join and a device's deletion. Rebuilt (SQLite
-- cannot drop a table constraint) with its ids and its AUTOINCREMENT sequence (0007: ids
-- are never reused).
--
-- The PostgreSQL schema stores the ids as bytea too (migrations/postgres/0014_...).

CREATE TABLE seen_events_in_order (
    id INTEGER PRIMARY KEY,
    event_id BLOB NOT NULL UNIQUE,
    relay TEXT NOT NULL,
    keep_until INTEGER NOT NULL
);
INSERT INTO seen_events_in_order (event_id, relay, keep_until)
    SELECT unhex(event_id), relay, keep_until FROM seen_events ORDER BY keep_until;
DROP TABLE seen_events;
ALTER TABLE seen_events_in_order RENAME TO seen_events;
CREATE INDEX seen_events_by_expiry ON seen_events (keep_until);

CREATE TABLE outbox_by_device (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    device_id INTEGER NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    event_json TEXT,
    first_seen_ms INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_ms INTEGER NOT NULL,
    claimed_ms INTEGER
);
INSERT INTO outbox_by_device (id, device_id, event_id, relay, event_json, first_seen_ms, attempts,
                              next_attempt_ms, claimed_ms)
    SELECT id, device_id, event_id, relay, event_json, first_seen_ms, attempts, next_attempt_ms,
           claimed_ms
    FROM outbox;
-- the sequence goes on from the old table's (the largest id ever handed out, not only the
-- largest still queued), whose entry goes with it
DELETE FROM sqlite_sequence WHERE name = 'outbox_by_device';
INSERT INTO sqlite_sequence (name, seq) SELECT 'outbox_by_device', seq FROM sqlite_sequence
    WHERE name = 'outbox';
DROP TABLE outbox;
ALTER TABLE outbox_by_device RENAME TO outbox;
CREATE INDEX outbox_unclaimed_by_due ON outbox (next_attempt_ms) WHERE claimed_ms IS NULL;
CREATE INDEX outbox_by_device ON outbox (device_id);

CREATE TABLE catchup_items_in_order (
    id INTEGER PRIMARY KEY,
    relay TEXT NOT NULL,
    pubkey BLOB NOT NULL,
    event_id BLOB NOT NULL,
    created_at INTEGER NOT NULL,
    noted_at INTEGER NOT NULL DEFAULT 0,
    UNIQUE (relay, pubkey, event_id)
);
INSERT INTO catchup_items_in_order (relay, pubkey, event_id, created_at, noted_at)
    SELECT relay, unhex(pubkey), unhex(event_id), created_at, noted_at FROM catchup_items
    ORDER BY noted_at, created_at;
DROP TABLE catchup_items;
ALTER TABLE catchup_items_in_order RENAME TO catchup_items;
CREATE INDEX catchup_items_by_time ON catchup_items (created_at);
CREATE INDEX catchup_items_by_noted ON catchup_items (relay, noted_at);
