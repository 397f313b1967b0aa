-- jobfence 0019: producers enqueue through functions, and need no privilege on any table.
--
-- jobfence.produce (the body as bytes: what every Python producer sends) and jobfence.enqueue
-- (the payload as jsonb: for SQL callers) are SECURITY DEFINER: they run as the owner of the
-- schema, check every argument, and write the queue row, or the outbox row when the queue is
-- external, with the columns only jobfence sets (attempts, lease_token, last_error, the outbox's
-- prior_attempts) left to their defaults and run_at never before now(). A role allowed to execute
-- them can enqueue and nothing else: it cannot read a queued payload, a dead letter or the
-- settings, nor write a row that would stop a queue. Both pin search_path and name every object
-- with its schema, so that nothing the caller creates can stand in for what they use.
--
-- EXECUTE is revoked from PUBLIC: `jobfence roles --print-sql` grants it to the producer role.
-- Every role that may insert into jobfence_queue.messages today keeps enqueueing through them.

-- Checks and writes one job for jobfence.produce and jobfence.enqueue (named in `caller`, so
-- that a refusal says which function refused). Runs with the rights of its caller: only those
-- two SECURITY DEFINER functions call it.
CREATE FUNCTION jobfence.write_job(
    caller         text,
    consumer       text,
    queue          text,
    job_id         text,
    body           bytea,
    tenant_id      text,
    correlation_id text,
    delay          interval
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    message_id bigint;
BEGIN
    IF consumer IS NULL OR consumer !~ '^[A-Za-z0-9_.:-]{1,200}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: consumer %s must be 1-200 characters of letters, digits'
                             ' and _ . : -', caller, quote_nullable(consumer));
    END IF;
    IF queue IS NULL OR queue !~ '^[A-Za-z0-9_.:-]{1,200}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: queue %s must be 1-200 characters of letters, digits'
                             ' and _ . : -', caller, quote_nullable(queue));
    END IF;
    IF job_id IS NULL OR job_id = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: job_id must be a non-empty string', caller);
    END IF;
    IF octet_length(job_id) > 1024 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: job_id is %s bytes long (UTF-8), at most 1024 are allowed',
                             caller, octet_length(job_id));
    END IF;
    IF octet_length(tenant_id) > 200 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: tenant_id is %s bytes long (UTF-8), at most 200 are allowed',
                             caller, octet_length(tenant_id));
    END IF;
    IF octet_length(correlation_id) > 1024 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: correlation_id is %s bytes long (UTF-8), at most 1024 are'
                             ' allowed', caller, octet_length(correlation_id));
    END IF;
    IF body IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = CASE caller
                WHEN 'jobfence.enqueue' THEN 'jobfence.enqueue: payload must be a JSON'
                     ' document, not NULL (a JSON null is ''null''::jsonb)'
                ELSE format('%s: body must be the bytes of a JSON document, not NULL', caller)
            END;
    END IF;
    IF delay IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: delay must be an interval, not NULL', caller);
    END IF;

    -- One statement, so that it waits for jobfence.set_queue's table lock before it reads the
    -- setting: a switch of queue can never strand a job in the queue it switched away from.
    -- A negative delay counts as none: run_at is never before now().
    WITH target AS (
        SELECT s.queue_kind <> 'postgresql' AS external FROM jobfence.settings s
    ), queued AS (
        INSERT INTO jobfence_queue.messages (
            queue, consumer, job_id, body, tenant_id, correlation_id, run_at
        )
        SELECT write_job.queue, write_job.consumer, write_job.job_id, write_job.body,
               write_job.tenant_id, write_job.correlation_id,
               pg_catalog.now() + greatest(write_job.delay, interval '0')
        FROM target WHERE NOT target.external
        RETURNING id, pg_catalog.pg_notify('jobfence_queue', write_job.queue)
    ), outboxed AS (
        INSERT INTO jobfence.outbox (
            queue, consumer, job_id, body, tenant_id, correlation_id, due_at
        )
        SELECT write_job.queue, write_job.consumer, write_job.job_id, write_job.body,
               write_job.tenant_id, write_job.correlation_id,
               pg_catalog.now() + greatest(write_job.delay, interval '0')
        FROM target WHERE target.external
        RETURNING id, pg_catalog.pg_notify('jobfence_outbox', '')
    )
    SELECT id INTO message_id FROM queued UNION ALL SELECT id FROM outboxed;
    RETURN message_id;
END
$$;

-- What every Python producer runs (App.enqueue, enqueue_sync, Producer, the Django and
-- SQLAlchemy producers): `body` is the JSON document's bytes as the producer encoded them.
-- Returns the id of the queue message, or of the outbox row.
CREATE FUNCTION jobfence.produce(
    consumer       text,
    queue          text,
    job_id         text,
    body           bytea,
    tenant_id      text     DEFAULT NULL,
    correlation_id text     DEFAULT NULL,
    delay          interval DEFAULT '0'
) RETURNS bigint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT jobfence.write_job('jobfence.produce', consumer, queue, job_id, body, tenant_id,
                              correlation_id, delay)
$$;

-- jobfence.enqueue as in 0013 (same arguments, checks and messages), now SECURITY DEFINER.
CREATE OR REPLACE FUNCTION jobfence.enqueue(
    consumer       text,
    queue          text,
    job_id         text,
    payload        jsonb,
    tenant_id      text     DEFAULT NULL,
    correlation_id text     DEFAULT NULL,
    delay          interval DEFAULT '0'
) RETURNS bigint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT jobfence.write_job('jobfence.enqueue', consumer, queue, job_id,
                              convert_to(jobfence.compact_json(payload), 'UTF8'), tenant_id,
                              correlation_id, delay)
$$;

REVOKE EXECUTE ON FUNCTION
    jobfence.write_job(text, text, text, text, bytea, text, text, interval),
    jobfence.produce(text, text, text, bytea, text, text, interval),
    jobfence.enqueue(text, text, text, jsonb, text, text, interval)
FROM PUBLIC;

-- Who could write queue rows before this migration keeps enqueueing after it.
DO $$
DECLARE
    grantee name;
BEGIN
    FOR grantee IN
        SELECT r.rolname FROM pg_catalog.pg_roles r
        WHERE NOT r.rolsuper AND r.rolname !~ '^pg_'
          AND r.oid <> (SELECT c.relowner FROM pg_catalog.pg_class c
                        WHERE c.oid = 'jobfence_queue.messages'::regclass)
          AND pg_catalog.has_table_privilege(r.oid, 'jobfence_queue.messages', 'INSERT')
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION'
                       ' jobfence.produce(text, text, text, bytea, text, text, interval),'
                       ' jobfence.enqueue(text, text, text, jsonb, text, text, interval)'
                       ' TO %I', grantee);
    END LOOP;
END
$$;
