-- NIP-46 delegated AUTH: one remote-signer session per registered pubkey. The session's
-- client key and the bunker secret are sealed (AES-GCM under a key derived from the
-- bridge's key); the bunker URI itself is never stored whole.

CREATE TABLE IF NOT EXISTS auth_signers (
    pubkey TEXT PRIMARY KEY,
    signer_pubkey TEXT NOT NULL,
    relays TEXT NOT NULL,
    sealed_secret TEXT,
    sealed_client_key TEXT NOT NULL,
    status TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    updated_at INTEGER NOT NULL
) WITHOUT ROWID;
