-- jobfence 0025: a dead letter's created_at is a date jobfence and its readers can handle.
--
-- jobfence stamps created_at with now(), but a role that may insert dead letters (the worker,
-- the relays, the owner) can write any timestamp. One in year 294276 or before year 1 made every
-- `jobfence dead-letters list` fail (Python's dates end at 9999 and start at year 1) and the
-- API's pages loop or fail; one near the end of PostgreSQL's range made the alert relay fail
-- every round for every key; one in a later year (2100) opened an alert group whose window
-- ended then, so the dead letters of that key joined it and none was paged. The check allows
-- what a dead letter can truly have been given: a time from year 1 up to a day ahead of the
-- database clock (room for another server's clock). The alert outbox copies it; the same check
-- holds there for the rows the worker and relay roles write themselves.
--
-- As in 0016, each check is added NOT VALID, then validated when no row already there breaks
-- it; otherwise it stays NOT VALID (new and updated rows are still checked) with a WARNING.
ALTER TABLE core.dead_letters
    ADD CONSTRAINT dead_letters_created_at_check
    CHECK (created_at >= '0001-01-01 00:00:00+00' AND created_at <= now() + interval '1 day')
    NOT VALID;
ALTER TABLE jobfence.alert_outbox
    ADD CONSTRAINT alert_outbox_created_at_check
    CHECK (created_at >= '0001-01-01 00:00:00+00' AND created_at <= now() + interval '1 day')
    NOT VALID;

DO $$
DECLARE
    c record;
    broken boolean;
BEGIN
    FOR c IN
        SELECT * FROM (VALUES
            ('core.dead_letters', 'dead_letters_created_at_check'),
            ('jobfence.alert_outbox', 'alert_outbox_created_at_check')
        ) AS t (tbl, name)
    LOOP
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE created_at < %L'
                       ' OR created_at > now() + interval %L)',
                       c.tbl, '0001-01-01 00:00:00+00', '1 day')
            INTO broken;
        IF broken THEN
            RAISE WARNING '%', format('jobfence: %s holds rows whose created_at is before year 1'
                ' or more than a day ahead: check %s stays NOT VALID (new and updated rows are'
                ' checked); validate it once they are gone', c.tbl, c.name);
        ELSE
            EXECUTE format('ALTER TABLE %s VALIDATE CONSTRAINT %I', c.tbl, c.name);
        END IF;
    END LOOP;
END
$$;
