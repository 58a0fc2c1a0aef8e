-- Notifications beyond DMs, quiet hours and deferred wakeups (issue 32).
--   devices.notify      bit mask of the pair's notification classes (bridge/watches.py:
--                       1 dm, 2 mention, 4 repost, 8 reaction, 16 zap); 1 is `["dm"]`, what
--                       every pair had before
--   devices.quiet_from, quiet_to
--                       the pair's quiet window in seconds of the local day (never equal);
--   devices.quiet_tz    its IANA zone; all three NULL: no quiet hours
--   deferred_wakeups    the events a deferring rule (`present`, `quiet`) held back from a
--                       pair, with their visible author (NULL: a gift wrap or an anonymous
--                       zap), until the rule stops holding: then they are claimed (deleted)
--                       in one transaction that writes at most one outbox row, for the
--                       newest of them that would still wake the pair (not paused since,
--                       author not muted since). `due_at`: a quiet window's end; NULL for a
--                       presence, which is due when the pair's `present_until` passes.
--                       It replaces the one-event mark of 0009 (`lapse_event_id`,
--                       `lapse_relay`), whose marks move here.
--   user_lists.threads  a kind 10000's `e` tags (muted threads), packed 32 bytes each, sorted
--   user_lists.words    its `word` tags, lowercase, newline-separated
-- `muted` is moved back to the last column of `devices` (see 0011), behind the new ones.
-- The PostgreSQL schema makes the same change in migrations/postgres/0017_notify_and_quiet.sql.

ALTER TABLE devices ADD COLUMN notify INTEGER NOT NULL DEFAULT 1;
ALTER TABLE devices ADD COLUMN quiet_from INTEGER;
ALTER TABLE devices ADD COLUMN quiet_to INTEGER;
ALTER TABLE devices ADD COLUMN quiet_tz TEXT;
CREATE INDEX devices_notify ON devices (pubkey) WHERE notify != 1;

CREATE TABLE deferred_wakeups (
    device_id INTEGER NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    reason TEXT NOT NULL,
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    author TEXT,
    due_at INTEGER,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (device_id, reason, event_id)
);
CREATE INDEX deferred_wakeups_due ON deferred_wakeups (due_at) WHERE due_at IS NOT NULL;
INSERT INTO deferred_wakeups (device_id, reason, event_id, relay, author, due_at, created_at)
    SELECT id, 'present', lapse_event_id, lapse_relay, NULL, NULL, 0
    FROM devices WHERE lapse_event_id IS NOT NULL;
DROP INDEX devices_lapsing;
ALTER TABLE devices DROP COLUMN lapse_event_id;
ALTER TABLE devices DROP COLUMN lapse_relay;

ALTER TABLE devices ADD COLUMN muted_last BLOB;
UPDATE devices SET muted_last = muted WHERE muted IS NOT NULL;
ALTER TABLE devices DROP COLUMN muted;
ALTER TABLE devices RENAME COLUMN muted_last TO muted;

ALTER TABLE user_lists ADD COLUMN threads BLOB NOT NULL DEFAULT x'';
ALTER TABLE user_lists ADD COLUMN words TEXT NOT NULL DEFAULT '';
