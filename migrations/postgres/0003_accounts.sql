-- Many accounts per device (issue 10), as SQLite's 0005_accounts: a registration is an
-- (npub, device token) pair, so the UNIQUE constraint moves from `token` to (token, pubkey).
-- Existing rows become pairs, unchanged; ids and the outbox's references stay as they are.
-- The new constraint's index (token first) also serves lookups by token.

ALTER TABLE devices DROP CONSTRAINT devices_token_key;
ALTER TABLE devices ADD CONSTRAINT devices_token_pubkey_key UNIQUE (token, pubkey);
