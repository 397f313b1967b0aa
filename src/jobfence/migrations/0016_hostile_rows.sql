-- jobfence 0016: what a producer writes cannot stop a queue.
--
-- A row in jobfence_queue.messages or jobfence.outbox is written by producers (App.enqueue,
-- jobfence.enqueue, or an INSERT of their own). These checks refuse values no producer means and
-- jobfence never writes: a negative delivery count, and a due time at infinity (a job no worker
-- would ever take). They hold for every role, a superuser's INSERT included. The queries that
-- read and update these rows stay robust besides (a count at the top of integer's range is taken
-- and dead-lettered, never overflowed), so one row never stops the others.
--
-- Each check is added NOT VALID, then validated when no row already there breaks it. A database
-- that holds such a row keeps the check NOT VALID (every new or updated row is still checked)
-- and the migration says so with a WARNING, instead of failing: validate it once that row is
-- gone (ALTER TABLE ... VALIDATE CONSTRAINT ...).
ALTER TABLE jobfence_queue.messages
    ADD CONSTRAINT messages_attempts_check CHECK (attempts >= 0) NOT VALID,
    ADD CONSTRAINT messages_run_at_check CHECK (isfinite(run_at)) NOT VALID;
ALTER TABLE jobfence.outbox
    ADD CONSTRAINT outbox_attempts_check CHECK (attempts >= 0) NOT VALID,
    ADD CONSTRAINT outbox_due_at_check CHECK (isfinite(due_at)) NOT VALID;

DO $$
DECLARE
    c record;
    broken boolean;
BEGIN
    FOR c IN
        SELECT * FROM (VALUES
            ('jobfence_queue.messages', 'messages_attempts_check', 'attempts < 0'),
            ('jobfence_queue.messages', 'messages_run_at_check', 'NOT isfinite(run_at)'),
            ('jobfence.outbox', 'outbox_attempts_check', 'attempts < 0'),
            ('jobfence.outbox', 'outbox_due_at_check', 'NOT isfinite(due_at)')
        ) AS t (tbl, name, breaks)
    LOOP
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE %s)', c.tbl, c.breaks)
            INTO broken;
        IF broken THEN
            RAISE WARNING '%', format('jobfence: %s holds rows where %s: check %s stays NOT'
                ' VALID (new and updated rows are checked); validate it once they are gone',
                c.tbl, c.breaks, c.name);
        ELSE
            EXECUTE format('ALTER TABLE %s VALIDATE CONSTRAINT %I', c.tbl, c.name);
        END IF;
    END LOOP;
END
$$;

-- jobfence.enqueue as in 0013, refusing a delay over 3650 days (about ten years) with SQLSTATE
-- 22023 like every other bad argument, instead of a timestamp overflow (22008) further on.
CREATE OR REPLACE FUNCTION jobfence.enqueue(
    consumer       text,
    queue          text,
    job_id         text,
    payload        jsonb,
    tenant_id      text     DEFAULT NULL,
    correlation_id text     DEFAULT NULL,
    delay          interval DEFAULT '0'
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    message_id bigint;
BEGIN
    IF enqueue.consumer IS NULL OR enqueue.consumer !~ '^[A-Za-z0-9_.:-]{1,200}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: consumer %s must be 1-200 characters of'
                             ' letters, digits and _ . : -', quote_nullable(enqueue.consumer));
    END IF;
    IF enqueue.queue IS NULL OR enqueue.queue !~ '^[A-Za-z0-9_.:-]{1,200}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: queue %s must be 1-200 characters of'
                             ' letters, digits and _ . : -', quote_nullable(enqueue.queue));
    END IF;
    IF enqueue.job_id IS NULL OR enqueue.job_id = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.enqueue: job_id must be a non-empty string';
    END IF;
    IF octet_length(enqueue.job_id) > 1024 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: job_id is %s bytes long (UTF-8), at most 1024'
                             ' are allowed', octet_length(enqueue.job_id));
    END IF;
    IF octet_length(enqueue.tenant_id) > 200 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: tenant_id is %s bytes long (UTF-8), at most 200'
                             ' are allowed', octet_length(enqueue.tenant_id));
    END IF;
    IF octet_length(enqueue.correlation_id) > 1024 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: correlation_id is %s bytes long (UTF-8), at'
                             ' most 1024 are allowed', octet_length(enqueue.correlation_id));
    END IF;
    IF enqueue.payload IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.enqueue: payload must be a JSON document, not NULL'
                      ' (a JSON null is ''null''::jsonb)';
    END IF;
    IF enqueue.delay IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.enqueue: delay must be an interval, not NULL';
    END IF;
    IF enqueue.delay > interval '3650 days' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: delay %s is over the limit of 3650 days',
                             enqueue.delay);
    END IF;

    -- One statement, so that it waits for jobfence.set_queue's table lock before it reads the
    -- setting: a switch of queue can never strand a job in the queue it switched away from.
    WITH target AS (
        SELECT s.queue_kind <> 'postgresql' AS external FROM jobfence.settings s
    ), queued AS (
        INSERT INTO jobfence_queue.messages (
            queue, consumer, job_id, body, tenant_id, correlation_id, run_at
        )
        SELECT enqueue.queue, enqueue.consumer, enqueue.job_id,
               convert_to(jobfence.compact_json(enqueue.payload), 'UTF8'),
               enqueue.tenant_id, enqueue.correlation_id,
               now() + greatest(enqueue.delay, interval '0')
        FROM target WHERE NOT target.external
        RETURNING id, pg_notify('jobfence_queue', enqueue.queue)
    ), outboxed AS (
        INSERT INTO jobfence.outbox (
            queue, consumer, job_id, body, tenant_id, correlation_id, due_at
        )
        SELECT enqueue.queue, enqueue.consumer, enqueue.job_id,
               convert_to(jobfence.compact_json(enqueue.payload), 'UTF8'),
               enqueue.tenant_id, enqueue.correlation_id,
               now() + greatest(enqueue.delay, interval '0')
        FROM target WHERE target.external
        RETURNING id, pg_notify('jobfence_outbox', '')
    )
    SELECT id INTO message_id FROM queued UNION ALL SELECT id FROM outboxed;
    RETURN message_id;
END
$$;
