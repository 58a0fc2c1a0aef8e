-- The same change as SQLite's migrations/0017_notify_and_quiet.sql (explained there): each
-- pair's notification classes and quiet hours, the deferred wakeups table replacing the
-- one-event presence lapse mark, and a mute list's muted threads and words.

ALTER TABLE devices ADD COLUMN notify INTEGER NOT NULL DEFAULT 1;
ALTER TABLE devices ADD COLUMN quiet_from INTEGER;
ALTER TABLE devices ADD COLUMN quiet_to INTEGER;
ALTER TABLE devices ADD COLUMN quiet_tz TEXT;
CREATE INDEX devices_notify ON devices (pubkey) WHERE notify <> 1;

CREATE TABLE deferred_wakeups (
    device_id BIGINT NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    reason TEXT NOT NULL,
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    author TEXT,
    due_at BIGINT,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (device_id, reason, event_id)
);
CREATE INDEX deferred_wakeups_due ON deferred_wakeups (due_at) WHERE due_at IS NOT NULL;
INSERT INTO deferred_wakeups (device_id, reason, event_id, relay, author, due_at, created_at)
    SELECT id, 'present', lapse_event_id, lapse_relay, NULL, NULL, 0
    FROM devices WHERE lapse_event_id IS NOT NULL;
DROP INDEX devices_lapsing;
ALTER TABLE devices DROP COLUMN lapse_event_id;
ALTER TABLE devices DROP COLUMN lapse_relay;

ALTER TABLE user_lists ADD COLUMN threads BYTEA NOT NULL DEFAULT '\x'::bytea;
ALTER TABLE user_lists ADD COLUMN words TEXT NOT NULL DEFAULT '';
