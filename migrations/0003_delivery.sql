-- Delivery's bookkeeping on the outbox. A row is claimed (claimed_ms set, attempts counted)
-- just before its push goes out and deleted once the provider has answered for good. After a
-- crash the claimed rows are exactly the wakeups whose fate is unknown: they are resent at
-- start-up under the same apns-collapse-id (derived from the row), so a notification that did
-- get through is replaced rather than shown twice. attempts counts claims, so a wakeup that
-- brings the process down on every try is still given up eventually.

ALTER TABLE outbox ADD COLUMN claimed_ms INTEGER;

DROP INDEX IF EXISTS outbox_by_due;
CREATE INDEX IF NOT EXISTS outbox_unclaimed_by_due ON outbox (next_attempt_ms)
    WHERE claimed_ms IS NULL;
