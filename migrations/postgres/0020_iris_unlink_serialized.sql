-- Issue 33: an Iris subscription or device is deleted with its last link even when two links
-- go at once.
--
-- 0018's trigger deletes, after a link in iris_targets is removed, the subscription left
-- without links and the Iris device left without subscriptions. Under READ COMMITTED two
-- transactions removing the last two links of one subscription (APNs and FCM calling its two
-- tokens dead at once, two forgets on two connections) each saw the other's link, not yet
-- committed, and neither deleted it: a subscription pushing nowhere, still watched and counted
-- against its owner's 20. Likewise a device named by two subscriptions deleted together (Iris
-- runs its two syncs at once). Now the trigger locks the row it may delete before looking:
-- the second waits for the first to commit, and its check (a new statement, a new snapshot)
-- sees the first's removal. SQLite needs nothing: its writes are serialized on one connection.

CREATE OR REPLACE FUNCTION iris_target_unlinked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM iris_subscriptions WHERE id = OLD.subscription_id FOR UPDATE;
    DELETE FROM iris_subscriptions WHERE id = OLD.subscription_id
        AND NOT EXISTS (SELECT 1 FROM iris_targets WHERE subscription_id = OLD.subscription_id);
    PERFORM 1 FROM devices WHERE id = OLD.device_id AND payload = 'iris' FOR UPDATE;
    DELETE FROM devices WHERE id = OLD.device_id AND payload = 'iris'
        AND NOT EXISTS (SELECT 1 FROM iris_targets WHERE device_id = OLD.device_id);
    RETURN NULL;
END
$$;
