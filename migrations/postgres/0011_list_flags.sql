-- The same change as SQLite's migrations/0011_list_flags.sql (explained there): each pair
-- carries which lists its npub has stored (1: a kind 10000 with keys, 2: a kind 3), so that
-- the device read of every DM asks no other table. Column order does not matter here (a long
-- `muted` is TOASTed out of the row).

ALTER TABLE devices ADD COLUMN list_flags INTEGER NOT NULL DEFAULT 0;
UPDATE devices SET list_flags = (
    SELECT COALESCE(SUM(CASE WHEN l.kind = 10000 AND l.entry_count > 0 THEN 1
                             WHEN l.kind = 3 THEN 2 ELSE 0 END), 0)
    FROM user_lists l WHERE l.pubkey = devices.pubkey
) WHERE pubkey IN (SELECT pubkey FROM user_lists);
