"""The store: one interface (`store.interface`), one backend per engine.

SQLite is the embedded default (its modules are `sigil_push.db`, `devices`, `outbox`, `seen`,
`auth_ids` today); PostgreSQL lives in `store.postgres`. `open_store` picks by
`server.database`.
"""
