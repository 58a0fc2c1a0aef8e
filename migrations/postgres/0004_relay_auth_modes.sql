-- What each gated relay's answers taught about NIP-42: one authenticated key per connection
-- ('single') or several ('multi'), shared by every worker and kept over restarts;
-- `learned_at` lets an old verdict expire (relay software gets upgraded).

CREATE TABLE IF NOT EXISTS relay_auth_modes (
    relay TEXT PRIMARY KEY,
    mode TEXT NOT NULL CHECK (mode IN ('single', 'multi')),
    learned_at BIGINT NOT NULL
);
