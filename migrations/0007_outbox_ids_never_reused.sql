-- Outbox row ids are never reused. A wakeup's apns-collapse-id is a keyed hash of the id of its
-- first row, so that a resend after a crash replaces the first notification rather than adding
-- a second one. Without AUTOINCREMENT SQLite hands out max(id) + 1, which on a quiet instance
-- (the outbox empty between DMs) is 1 again and again: unrelated wakeups to different phones
-- shared a collapse id, and a phone replaced one notification with the next. PostgreSQL's
-- BIGSERIAL sequence never goes back, so only SQLite needs this.
--
-- AUTOINCREMENT cannot be added to a table in place: the outbox is rebuilt, ids kept. Nothing
-- references the outbox, so dropping the old table loses nothing. The sequence starts after
-- the largest id still queued; ids of rows deleted before this migration can come once more.

CREATE TABLE outbox_numbered (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    device_id INTEGER NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    event_json TEXT,
    first_seen_ms INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_ms INTEGER NOT NULL,
    claimed_ms INTEGER,
    UNIQUE (device_id, event_id)
);
INSERT INTO outbox_numbered (id, device_id, event_id, relay, event_json, first_seen_ms, attempts,
                             next_attempt_ms, claimed_ms)
    SELECT id, device_id, event_id, relay, event_json, first_seen_ms, attempts, next_attempt_ms,
           claimed_ms
    FROM outbox;

DROP TABLE outbox;
ALTER TABLE outbox_numbered RENAME TO outbox;

CREATE INDEX outbox_unclaimed_by_due ON outbox (next_attempt_ms) WHERE claimed_ms IS NULL;
