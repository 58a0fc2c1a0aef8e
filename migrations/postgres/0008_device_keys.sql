-- Sealed previews (issue 21): a registration may carry a device key, the x-only secp256k1 public
-- key the app keeps the secret of on the phone; payload mode 'sealed' encrypts each wakeup's
-- event to it. A new nullable column without a default, so PostgreSQL changes only the catalog:
-- no table rewrite, and every existing row keeps its values with no key (NULL). SQLite makes the
-- same change in migrations/0008_device_keys.sql.

ALTER TABLE devices ADD COLUMN device_key TEXT;
