-- As SQLite's migrations/0015_outbox_event_json_apart.sql (explained there): the event JSON
-- of `event` and `sealed` wakeups moves into outbox_events, keyed by the outbox row's id, and
-- outbox.has_event flags the rows that have one. Here every claim, hold and reschedule writes
-- a new version of the outbox row (HOT within the page, 0007), and a ~1.9 KB event (under the
-- TOAST threshold, so stored inline) made each such version about forty times the size of an
-- opaque row's, filling the pages' free room after a few claims. The event's row is written
-- once and never updated. A row trigger deletes it with its wakeup (also when a device's
-- deletion cascades); its WHEN skips opaque rows without calling the function. No foreign key
-- from outbox_events to the outbox: its ON DELETE action would run a lookup for every deleted
-- outbox row, opaque ones included. Existing rows keep their JSON under their own id.

CREATE TABLE outbox_events (
    wakeup_id BIGINT PRIMARY KEY,
    event_json TEXT NOT NULL
);
ALTER TABLE outbox ADD COLUMN has_event BOOLEAN NOT NULL DEFAULT false;
INSERT INTO outbox_events (wakeup_id, event_json)
    SELECT id, event_json FROM outbox WHERE event_json IS NOT NULL;
UPDATE outbox SET has_event = true WHERE event_json IS NOT NULL;
ALTER TABLE outbox DROP COLUMN event_json;
CREATE FUNCTION outbox_event_goes_with_its_wakeup() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM outbox_events WHERE wakeup_id = OLD.id;
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_event_goes_with_its_wakeup AFTER DELETE ON outbox
    FOR EACH ROW WHEN (OLD.has_event) EXECUTE FUNCTION outbox_event_goes_with_its_wakeup();
