-- A worker loads only the keys of its own shards (`PostgresDevices.watched_keys` once
-- narrowed). The shard of a key is its leading 32 bits modulo the shard count (256, as in
-- `sigil_push.shards.shard_of`); without this index every worker read the whole table to find
-- its share. The expression must stay exactly the one the query uses, literal 256 included,
-- for the planner to match it.

CREATE INDEX devices_by_shard
    ON devices (((('x' || substr(pubkey, 1, 8))::bit(32)::bigint % 256)::integer));
