-- The ingest's hot path reads one row per recipient device (issue 20's cost): each pair carries
-- which lists its npub has stored, so that reading a device asks no other table.
--   list_flags      1: a kind 10000 with at least one key is stored for the npub; 2: a kind 3
--                   is (both: 3). Set from `user_lists` when a pair is written, and on every
--                   pair of the npub when one of its lists is stored (in that transaction).
-- Until now the device read computed it with a subquery on `user_lists_flags`: free while no
-- list is stored, but with 20,000 lists among 100,000 keys it was one more index probe per
-- device, mostly a page out of SQLite's cache (6.8 against 5.2 us a key read).
-- `muted` (a private list of up to 32,000 bytes, in overflow pages when long) stays the last
-- column, as 0009 placed it: SQLite appends a new column, so it is moved behind `list_flags`
-- by copying it into a new last column; reading the other columns never walks its pages.
-- The PostgreSQL schema makes the same change in migrations/postgres/0011_list_flags.sql.

ALTER TABLE devices ADD COLUMN list_flags INTEGER NOT NULL DEFAULT 0;
ALTER TABLE devices ADD COLUMN muted_last BLOB;
UPDATE devices SET muted_last = muted WHERE muted IS NOT NULL;
ALTER TABLE devices DROP COLUMN muted;
ALTER TABLE devices RENAME COLUMN muted_last TO muted;
UPDATE devices SET list_flags = (
    SELECT COALESCE(SUM(CASE WHEN l.kind = 10000 AND l.entry_count > 0 THEN 1
                             WHEN l.kind = 3 THEN 2 ELSE 0 END), 0)
    FROM user_lists l WHERE l.pubkey = devices.pubkey
) WHERE pubkey IN (SELECT pubkey FROM user_lists);
