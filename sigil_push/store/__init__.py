"""The store: one interface (`store.interface`), one backend per engine. Only this package
speaks SQL; each engine's repositories are written in that engine's own SQL (no translation).

- `store.sqlite`: the embedded default, one file (`database`, `devices`, `outbox`,
  `bridge_state`: baselines, cursors, relay lists, seen rows and the committer's
  transaction; `instance`: NIP-98 ids, signer sessions, learned AUTH modes, `meta`;
  `coordination`: one process, nothing to coordinate);
- `store.postgres`: many workers on one PostgreSQL server, the same modules plus `leases`,
  `sharding`, `signers` and `coordination` (how the workers share keys and sessions);
- shared by both: `records` (what the store hands out), `errors`, `limits` (the device and
  account limit policy), and the engine-free logic over the repositories: `seen` (the dedupe
  cache), `auth_ids` (batched NIP-98 claims), `auth_modes` (learned NIP-42 modes).

`open_store` (`store.factory`) picks the engine from `server.database`; nothing outside this
package asks which one is underneath: what differs between one process and several workers is
the store's `coordination`.
"""
