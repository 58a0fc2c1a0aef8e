"""The PostgreSQL backend (asyncpg): migrations, shard leases and outbox claims."""
