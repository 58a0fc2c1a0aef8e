-- The event JSON of `event` and `sealed` wakeups moves out of the outbox row into a table of
-- its own (issue 21). SQLite writes a whole record again on every UPDATE of it: the claim (an
-- UPDATE ... RETURNING per batch), `hold`, `reschedule` and the crash-time release each rewrote
-- a sealed row's ~1.9 KB of event with the few bytes that changed, so a claim batch of sealed
-- rows dirtied about a page a row or two (each written whole to the WAL) instead of one page
-- for some fifty rows. The event is written once, when the wakeup is queued, and never again.
--
-- outbox_events: one row per outbox row that carries the event (keyed by the outbox row's id,
-- so its rows are appended in id order and live exactly as long as their wakeup). Not shared by
-- the event's several devices: most DMs wake one or two phones, and a shared copy would need a
-- reference index on the outbox and a sweep when its last row goes, paid on every sealed row.
-- outbox.has_event says which rows have one, so the claim reads the JSON (a lookup by id in
-- its RETURNING) for those rows only, and an opaque row costs no lookup anywhere. The trigger
-- deletes a row's event with it, also when a device's deletion cascades to its rows; opaque
-- rows skip it on the flag. A wakeup and its event are written by one statement, an insert
-- into the view `outbox_queue` (the outbox with its events), whose trigger writes both: on the
-- connection the bridge and delivery share, a claim could otherwise run between two statements
-- and hand out a row whose event is not written yet.
--
-- Existing rows keep their JSON: copied to outbox_events under their own id, flagged, then the
-- column is dropped (the outbox's ids and AUTOINCREMENT sequence are untouched). PostgreSQL
-- makes the same change (migrations/postgres/0015_outbox_event_json_apart.sql).

CREATE TABLE outbox_events (
    wakeup_id INTEGER PRIMARY KEY,
    event_json TEXT NOT NULL
);
ALTER TABLE outbox ADD COLUMN has_event INTEGER NOT NULL DEFAULT 0;
INSERT INTO outbox_events (wakeup_id, event_json)
    SELECT id, event_json FROM outbox WHERE event_json IS NOT NULL ORDER BY id;
UPDATE outbox SET has_event = 1 WHERE event_json IS NOT NULL;
ALTER TABLE outbox DROP COLUMN event_json;
CREATE TRIGGER outbox_event_goes_with_its_wakeup AFTER DELETE ON outbox WHEN OLD.has_event
BEGIN
    DELETE FROM outbox_events WHERE wakeup_id = OLD.id;
END;
CREATE VIEW outbox_queue AS
    SELECT o.id, o.device_id, o.event_id, o.relay, e.event_json, o.first_seen_ms
    FROM outbox o LEFT JOIN outbox_events e ON o.has_event AND e.wakeup_id = o.id;
CREATE TRIGGER outbox_queue_writes_wakeup_and_event INSTEAD OF INSERT ON outbox_queue
BEGIN
    INSERT INTO outbox (device_id, event_id, relay, has_event, first_seen_ms, next_attempt_ms)
        VALUES (NEW.device_id, NEW.event_id, NEW.relay, NEW.event_json IS NOT NULL,
                NEW.first_seen_ms, NEW.first_seen_ms);
    INSERT INTO outbox_events (wakeup_id, event_json)
        SELECT last_insert_rowid(), NEW.event_json WHERE NEW.event_json IS NOT NULL;
END;
