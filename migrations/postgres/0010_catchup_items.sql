-- What negentropy (NIP-77) reconciliation needs: which DMs each relay has delivered, with
-- their created_at, within the catch-up window. On reconnect the bridge offers these
-- (id, created_at) items for a shard's keys (or, on a firehose relay, for the whole window)
-- and fetches only what the relay has beyond them. `pubkey` is the recipient the delivery
-- was matched to ('' for a firehose relay's DM for nobody here: its id still saves a fetch).
-- Rows older than the window are pruned by the housekeeping, so the table is bounded by it.
CREATE TABLE IF NOT EXISTS catchup_items (
    relay TEXT NOT NULL,
    pubkey TEXT NOT NULL,
    event_id TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (relay, pubkey, event_id)
);
CREATE INDEX IF NOT EXISTS catchup_items_by_time ON catchup_items (created_at);
