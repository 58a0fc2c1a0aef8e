-- Sealed previews (issue 21): a registration may carry a device key, the x-only secp256k1 public
-- key the app keeps the secret of on the phone; payload mode 'sealed' encrypts each wakeup's
-- event to it. A new nullable column: every existing row keeps its values and has no key (NULL),
-- so it goes on being woken exactly as before. The PostgreSQL schema makes the same change in
-- migrations/postgres/0008_device_keys.sql.

ALTER TABLE devices ADD COLUMN device_key TEXT;
