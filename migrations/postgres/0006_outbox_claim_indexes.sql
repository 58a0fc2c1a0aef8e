-- Delivery claims due rows oldest first (`ORDER BY next_attempt_ms, id LIMIT n FOR UPDATE
-- SKIP LOCKED`). With an index on next_attempt_ms alone, the planner read and sorted the whole
-- outbox for each batch of 500 (a full scan of 20,000 rows per claim, measured in
-- bench/scale.py); an index in the claim order lets it stop after the batch.
--
-- Each row is updated twice while it is sent (reserved, then claimed) and then deleted. An
-- update that changes no indexed column can stay on its page (a HOT update, no index entries
-- written) when the page has room: `outbox_by_claim_expiry` indexed claimed_until_ms, which
-- both updates change, and no query searches by it (a lapsed claim is found through the due
-- order), so it goes; the pages keep 30 % free for those updates.

CREATE INDEX outbox_by_due_order ON outbox (next_attempt_ms, id);
DROP INDEX outbox_by_due;
DROP INDEX outbox_by_claim_expiry;
ALTER TABLE outbox SET (fillfactor = 70);
