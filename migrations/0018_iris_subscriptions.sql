-- Issue 33: the Iris-compatible API, and NIP-98 auth events single-use as whole events.
--
-- nip98_used is keyed by the whole auth event (id and signature) and remembers the request it
-- was spent on (`request`: hex SHA-256 of method, URL and body). Iris signs without a
-- `payload` tag, so two of its requests in one second share an event id and differ only in
-- their signatures (BIP-340 signing draws fresh randomness); only the key's owner can make a
-- second valid signature. The very same auth event is accepted again only for the same
-- request (an idempotent retry), never for another body. The rows live three minutes: the
-- table is recreated rather than converted (a row's request was never recorded).
--
-- iris_subscriptions holds each subscription as received (`document`, JSON: GET must return
-- it unchanged, since Iris finds its own subscriptions by reading them back); iris_targets
-- links it to its push targets, which are rows of `devices` (payload 'iris'; platform
-- 'webpush', 'webhook', 'ios' or 'android'), so the outbox, its exactly-once per (event,
-- device) and delivery are those of every other push. One endpoint in several of a
-- subscriber's subscriptions is one device row: an event is pushed once per endpoint.
-- Unlinking a target (a subscription replaced or deleted, a device forgotten because its
-- endpoint answered 404 or 410) deletes, in the same statement, a subscription left without
-- targets and an Iris device left without subscriptions: every path that removes one keeps
-- the other consistent, on every worker.
-- The PostgreSQL tree does the same (migrations/postgres/0018_...).

DROP TABLE nip98_used;
CREATE TABLE nip98_used (
    event_id TEXT NOT NULL,
    sig TEXT NOT NULL,
    request TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (event_id, sig)
) WITHOUT ROWID;
CREATE INDEX nip98_used_by_expiry ON nip98_used (expires_at);

CREATE TABLE iris_subscriptions (
    id TEXT PRIMARY KEY,
    pubkey TEXT NOT NULL,
    document TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE INDEX iris_subscriptions_by_pubkey ON iris_subscriptions (pubkey);

CREATE TABLE iris_targets (
    subscription_id TEXT NOT NULL REFERENCES iris_subscriptions (id) ON DELETE CASCADE,
    device_id INTEGER NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    PRIMARY KEY (subscription_id, device_id)
);
CREATE INDEX iris_targets_by_device ON iris_targets (device_id);

CREATE TRIGGER iris_target_unlinked AFTER DELETE ON iris_targets
BEGIN
    DELETE FROM iris_subscriptions WHERE id = OLD.subscription_id
        AND NOT EXISTS (SELECT 1 FROM iris_targets WHERE subscription_id = OLD.subscription_id);
    DELETE FROM devices WHERE id = OLD.device_id AND payload = 'iris'
        AND NOT EXISTS (SELECT 1 FROM iris_targets WHERE device_id = OLD.device_id);
END;
