-- The PostgreSQL schema equivalent to the SQLite migrations 0001-0004 (devices, single-use
-- NIP-98 ids, the outbox, the bridge's memory of handled events, cursors, relay lists and
-- delegated-auth sessions). Times are integers as in SQLite: seconds where SQLite uses
-- seconds, milliseconds in columns named *_ms. Uniqueness is what makes several workers safe:
-- a handled event id, an (event, device) outbox row and a NIP-98 id can each exist only once,
-- so two workers that both handle the same event can never both enqueue it.

CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE devices (
    id BIGSERIAL PRIMARY KEY,
    pubkey TEXT NOT NULL,
    platform TEXT NOT NULL,
    token TEXT NOT NULL UNIQUE,
    payload TEXT NOT NULL DEFAULT 'opaque',
    relays TEXT NOT NULL DEFAULT '[]',
    webpush_p256dh TEXT,
    webpush_auth TEXT,
    registered_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX devices_by_pubkey ON devices (pubkey);

CREATE TABLE nip98_used (
    event_id TEXT PRIMARY KEY,
    expires_at BIGINT NOT NULL
);
CREATE INDEX nip98_used_by_expiry ON nip98_used (expires_at);

-- claimed_ms: when the current claim was taken (as in SQLite 0003); claimed_until: when it
-- lapses, so a killed worker's claimed rows become due again for any other worker.
CREATE TABLE outbox (
    id BIGSERIAL PRIMARY KEY,
    device_id BIGINT NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    event_json TEXT,
    first_seen_ms BIGINT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_ms BIGINT NOT NULL,
    claimed_ms BIGINT,
    claimed_until_ms BIGINT,
    claimed_by TEXT,
    UNIQUE (device_id, event_id)
);
CREATE INDEX outbox_by_due ON outbox (next_attempt_ms);
CREATE INDEX outbox_by_claim_expiry ON outbox (claimed_until_ms) WHERE claimed_until_ms IS NOT NULL;

CREATE TABLE seen_events (
    event_id TEXT PRIMARY KEY,
    relay TEXT NOT NULL,
    keep_until BIGINT NOT NULL
);
CREATE INDEX seen_events_by_expiry ON seen_events (keep_until);

CREATE TABLE seen_on_relay (
    event_id TEXT NOT NULL,
    relay TEXT NOT NULL,
    keep_until BIGINT NOT NULL,
    PRIMARY KEY (event_id, relay)
);
CREATE INDEX seen_on_relay_by_expiry ON seen_on_relay (keep_until);

CREATE TABLE relay_baselines (
    relay TEXT NOT NULL,
    pubkey TEXT NOT NULL,
    baselined_at BIGINT NOT NULL,
    PRIMARY KEY (relay, pubkey)
);
CREATE INDEX relay_baselines_by_pubkey ON relay_baselines (pubkey);

CREATE TABLE relay_cursors (
    relay TEXT PRIMARY KEY,
    live_until BIGINT NOT NULL
);

CREATE TABLE relay_lists (
    pubkey TEXT NOT NULL,
    kind INTEGER NOT NULL,
    created_at BIGINT NOT NULL,
    relays TEXT NOT NULL,
    PRIMARY KEY (pubkey, kind)
);

CREATE TABLE auth_signers (
    pubkey TEXT PRIMARY KEY,
    signer_pubkey TEXT NOT NULL,
    relays TEXT NOT NULL,
    sealed_secret TEXT,
    sealed_client_key TEXT NOT NULL,
    status TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    updated_at BIGINT NOT NULL
);
