-- Several workers on one database. Each worker heartbeats its row in `workers`; recipient keys
-- are hashed into shards and each shard is leased by one worker at a time. `epoch` is the
-- fencing token: it grows on every change of owner, and a write made on behalf of a shard
-- checks it in the same transaction, so a worker that stalled past its lease cannot write late.

CREATE TABLE workers (
    worker_id TEXT PRIMARY KEY,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    heartbeat_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE shard_leases (
    shard INTEGER PRIMARY KEY CHECK (shard >= 0),
    owner TEXT,
    epoch BIGINT NOT NULL DEFAULT 0,
    expires_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity'
);
CREATE INDEX shard_leases_by_owner ON shard_leases (owner);
