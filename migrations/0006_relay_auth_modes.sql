-- What each gated relay's answers taught about NIP-42: one authenticated key per connection
-- ('single') or several ('multi'). Kept so a restart does not probe every relay again with a
-- signer request; `learned_at` lets an old verdict expire (relay software gets upgraded).

CREATE TABLE IF NOT EXISTS relay_auth_modes (
    relay TEXT PRIMARY KEY,
    mode TEXT NOT NULL CHECK (mode IN ('single', 'multi')),
    learned_at INTEGER NOT NULL
) WITHOUT ROWID;
