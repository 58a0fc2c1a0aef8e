-- Users decide what wakes their phone (issue 20). Everything a user sets is per (npub, device
-- token) pair, on the pair's own `devices` row, so that another account registered on the same
-- token can never pause, mute or silence someone else's wakeups:
--   pause_until     Unix seconds; no wakeup for the pair before it (NULL: not paused)
--   senders         'anyone' or 'follows' (kind 4 only from the npub's kind 3 follows)
--   muted           the private mute list: sorted 32-byte keys packed end to end (at most
--                   1,000, so 32,000 bytes), replaced whole in one UPDATE; NULL: none
--   muted_count     how many keys `muted` holds (shown by GET /registrations, and the flag
--                   that tells the bridge to look at `muted` at all)
--   present_until   the app is in the foreground until then (POST /presence)
--   lapse_event_id, lapse_relay
--                   the newest DM the current presence held back: set by the bridge in the
--                   transaction that decided not to push it, cleared when the app ends the
--                   presence itself, and claimed (cleared, one outbox row written) in one
--                   transaction when the presence lapses by time: exactly one wakeup.
-- `muted` is added last: SQLite reads a row's columns in order, and a long list lies in overflow
-- pages that reading the columns after it (on every device load) would walk.
-- The PostgreSQL schema makes the same change in migrations/postgres/0009_preferences.sql.

ALTER TABLE devices ADD COLUMN pause_until INTEGER;
ALTER TABLE devices ADD COLUMN senders TEXT NOT NULL DEFAULT 'anyone';
ALTER TABLE devices ADD COLUMN muted_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE devices ADD COLUMN present_until INTEGER;
ALTER TABLE devices ADD COLUMN lapse_event_id TEXT;
ALTER TABLE devices ADD COLUMN lapse_relay TEXT;
ALTER TABLE devices ADD COLUMN muted BLOB;
CREATE INDEX devices_lapsing ON devices (present_until) WHERE lapse_event_id IS NOT NULL;

-- Each registered npub's newest kind 10000 (mute list) and kind 3 (contact list): the `p` tag
-- keys, sorted and packed as 32-byte keys (at most 10,000: 320,000 bytes), with what chose
-- this version (newest created_at, then lowest id, as NIP-01 says for replaceable events).
-- A rowid table, not WITHOUT ROWID: its rows are large, and in a WITHOUT ROWID table each
-- row's first kilobyte sits in the primary key's own leaves, which made every lookup by
-- pubkey (one per device read) a page of its own. `user_lists_flags` answers the question
-- asked with every device read (which lists does the npub have, with how many keys) from
-- the index alone; `entries` comes last so that reading the other columns never walks the
-- blob's overflow pages.
CREATE TABLE user_lists (
    pubkey TEXT NOT NULL,
    kind INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    event_id TEXT NOT NULL,
    entry_count INTEGER NOT NULL,
    truncated INTEGER NOT NULL DEFAULT 0,
    entries BLOB NOT NULL,
    PRIMARY KEY (pubkey, kind)
);
CREATE INDEX user_lists_flags ON user_lists (pubkey, kind, entry_count);
