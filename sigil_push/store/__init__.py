"""The store: one interface (`store.interface`), one backend per engine.

- `store.sqlite`: the embedded default, one file (`database`, `devices`, `outbox`);
- `store.postgres`: many workers on one PostgreSQL server;
- shared by both: `records` (what the store hands out), `errors`, and the modules whose SQL
  both engines run through the `Database` protocol (`seen`, `auth_ids`).

`open_store` (`store.factory`) picks the engine from `server.database`; nothing outside this
package asks which one is underneath.
"""
