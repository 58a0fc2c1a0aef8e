-- A relay's NIP-77 snapshot in parts (sigil_push/nostr/nip77_snapshot.py,
-- bridge/catchup_ledger.py): the parts of one sorted run, each appended with the items newer
-- than the run (no part is re-encoded for them), and parts of items out of the run's order;
-- all of them rewritten as one part now and then. `cut` is when a part was written (unix ms:
-- a restart reads the rows noted since the newest), `newest` its newest created_at (a part
-- whose newest item left the window is pruned). The one snapshot of 0013 becomes part 0.
CREATE TABLE IF NOT EXISTS catchup_snapshot_parts (
    relay TEXT NOT NULL,
    scope TEXT NOT NULL,
    part INTEGER NOT NULL,
    cut BIGINT NOT NULL,
    newest BIGINT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (relay, scope, part)
);
INSERT INTO catchup_snapshot_parts (relay, scope, part, cut, newest, data)
    SELECT relay, scope, 0, cut, cut / 1000 + 900, data FROM catchup_snapshots;
DROP TABLE catchup_snapshots;
