-- Users decide what wakes their phone (issue 20): the same change as SQLite's
-- migrations/0009_preferences.sql (the columns are explained there). Per (npub, token) pair on
-- its `devices` row; each npub's newest kind 10000 and kind 3 lists in `user_lists`, their keys
-- sorted and packed 32 bytes each.

ALTER TABLE devices ADD COLUMN pause_until BIGINT;
ALTER TABLE devices ADD COLUMN senders TEXT NOT NULL DEFAULT 'anyone';
ALTER TABLE devices ADD COLUMN muted_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE devices ADD COLUMN present_until BIGINT;
ALTER TABLE devices ADD COLUMN lapse_event_id TEXT;
ALTER TABLE devices ADD COLUMN lapse_relay TEXT;
ALTER TABLE devices ADD COLUMN muted BYTEA;
CREATE INDEX devices_lapsing ON devices (present_until) WHERE lapse_event_id IS NOT NULL;

CREATE TABLE user_lists (
    pubkey TEXT NOT NULL,
    kind INTEGER NOT NULL,
    created_at BIGINT NOT NULL,
    event_id TEXT NOT NULL,
    entry_count INTEGER NOT NULL,
    truncated INTEGER NOT NULL DEFAULT 0,
    entries BYTEA NOT NULL,
    PRIMARY KEY (pubkey, kind)
);
-- what every device read asks (which lists, how many keys), answered from the index alone
CREATE INDEX user_lists_flags ON user_lists (pubkey, kind) INCLUDE (entry_count);
