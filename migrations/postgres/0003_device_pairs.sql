-- A registration is an (npub, device token) pair: several npubs (accounts on one phone) may
-- register the same token, each proving its own key. The token alone is no longer unique;
-- the pair is. A dead token is found by token (every pair with it goes), hence the index.

ALTER TABLE devices DROP CONSTRAINT devices_token_key;
ALTER TABLE devices ADD CONSTRAINT devices_pubkey_token_key UNIQUE (pubkey, token);
CREATE INDEX devices_by_token ON devices (token);
