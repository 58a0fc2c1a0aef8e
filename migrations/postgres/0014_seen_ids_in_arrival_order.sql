-- As SQLite's migrations/0014_seen_ids_in_arrival_order.sql (explained there), the handled
-- event ids, and the recipients and event ids of catchup_items, are stored as their 32 bytes
-- (a firehose DM for nobody here keeps an empty recipient): half the size of the keys. A heap
-- table keeps its rows in arrival order already, and the outbox keeps its unique constraint
-- on (device_id, event_id): several workers rely on it during a shard's hand-over.

ALTER TABLE seen_events ALTER COLUMN event_id TYPE bytea USING decode(event_id, 'hex');
ALTER TABLE catchup_items
    ALTER COLUMN pubkey TYPE bytea USING decode(pubkey, 'hex'),
    ALTER COLUMN event_id TYPE bytea USING decode(event_id, 'hex');
