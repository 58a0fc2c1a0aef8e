-- As SQLite's migrations/0014_seen_ids_in_arrival_order.sql (explained there), the handled
-- event ids are stored as their 32 bytes: half the size of the primary key's entries. A heap
-- table keeps its rows in arrival order already, and the outbox keeps its unique constraint
-- on (device_id, event_id): several workers rely on it during a shard's hand-over.

ALTER TABLE seen_events ALTER COLUMN event_id TYPE bytea USING decode(event_id, 'hex');
