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
