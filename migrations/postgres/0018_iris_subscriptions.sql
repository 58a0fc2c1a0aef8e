-- As SQLite's migrations/0018_iris_subscriptions.sql (explained there): NIP-98 auth events
-- single-use as whole events (id and signature) with the request they were spent on; Iris
-- subscriptions as received, linked to their push targets (rows of `devices`); unlinking a
-- target deletes a subscription left without targets and an Iris device left without
-- subscriptions.

DROP TABLE nip98_used;
CREATE TABLE nip98_used (
    event_id TEXT NOT NULL,
    sig TEXT NOT NULL,
    request TEXT NOT NULL,
    expires_at BIGINT NOT NULL,
    PRIMARY KEY (event_id, sig)
);
CREATE INDEX nip98_used_by_expiry ON nip98_used (expires_at);

CREATE TABLE iris_subscriptions (
    id TEXT PRIMARY KEY,
    pubkey TEXT NOT NULL,
    document TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX iris_subscriptions_by_pubkey ON iris_subscriptions (pubkey);

CREATE TABLE iris_targets (
    subscription_id TEXT NOT NULL REFERENCES iris_subscriptions (id) ON DELETE CASCADE,
    device_id BIGINT NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    PRIMARY KEY (subscription_id, device_id)
);
CREATE INDEX iris_targets_by_device ON iris_targets (device_id);

CREATE FUNCTION iris_target_unlinked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM iris_subscriptions WHERE id = OLD.subscription_id
        AND NOT EXISTS (SELECT 1 FROM iris_targets WHERE subscription_id = OLD.subscription_id);
    DELETE FROM devices WHERE id = OLD.device_id AND payload = 'iris'
        AND NOT EXISTS (SELECT 1 FROM iris_targets WHERE device_id = OLD.device_id);
    RETURN NULL;
END
$$;
CREATE TRIGGER iris_target_unlinked AFTER DELETE ON iris_targets
    FOR EACH ROW EXECUTE FUNCTION iris_target_unlinked();
