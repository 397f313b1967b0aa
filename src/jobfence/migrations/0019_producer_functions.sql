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
-- Under the pinned search_path every object is named with its schema; the functions and
-- operators used unqualified (format, now, convert_to, ~, ...) are pg_catalog's.

-- What every Python producer runs (App.enqueue, enqueue_sync, Producer, the Django and
-- SQLAlchemy producers): `body` is the JSON document's bytes as the producer encoded them. The
-- checks and messages of jobfence.enqueue. Returns the id of the queue message, or of the
-- outbox row (produced_id); or, writing nothing and raising nothing, so that the caller's
-- transaction stays usable, no id and the largest message the external queue's broker accepts
-- with the queue's kind (limit_bytes, limit_kind) when the body is over it
-- (jobfence.settings.queue_max_message_bytes, recorded by the outbox relay: migration 0018). (PL/pgSQL rather than SQL: its plans are kept for the session, where a SECURITY
-- DEFINER SQL function would be planned again on every call.)
CREATE FUNCTION jobfence.produce(
    consumer       text,
    queue          text,
    job_id         text,
    body           bytea,
    tenant_id      text     DEFAULT NULL,
    correlation_id text     DEFAULT NULL,
    delay          interval DEFAULT '0',
    OUT produced_id bigint,
    OUT limit_bytes integer,
    OUT limit_kind  text
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF produce.consumer IS NULL OR produce.consumer !~ '^[A-Za-z0-9_.:-]{1,200}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: consumer %s must be 1-200 characters of'
                             ' letters, digits and _ . : -', quote_nullable(produce.consumer));
    END IF;
    IF produce.queue IS NULL OR produce.queue !~ '^[A-Za-z0-9_.:-]{1,200}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: queue %s must be 1-200 characters of'
                             ' letters, digits and _ . : -', quote_nullable(produce.queue));
    END IF;
    IF produce.job_id IS NULL OR produce.job_id = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.produce: job_id must be a non-empty string';
    END IF;
    IF octet_length(produce.job_id) > 1024 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: job_id is %s bytes long (UTF-8), at most 1024'
                             ' are allowed', octet_length(produce.job_id));
    END IF;
    IF octet_length(produce.tenant_id) > 200 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: tenant_id is %s bytes long (UTF-8), at most 200'
                             ' are allowed', octet_length(produce.tenant_id));
    END IF;
    IF octet_length(produce.correlation_id) > 1024 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: correlation_id is %s bytes long (UTF-8), at'
                             ' most 1024 are allowed', octet_length(produce.correlation_id));
    END IF;
    IF produce.body IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.produce: body must be the bytes of a JSON document, not NULL';
    END IF;
    IF produce.delay IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.produce: delay must be an interval, not NULL';
    END IF;
    IF produce.delay > interval '3650 days' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: delay %s is over the limit of 3650 days',
                             produce.delay);
    END IF;

    -- One statement, so that it waits for jobfence.set_queue's table lock before it reads the
    -- setting: a switch of queue can never strand a job in the queue it switched away from.
    -- A negative delay counts as none: run_at is never before now().
    WITH target AS (
        SELECT s.queue_kind <> 'postgresql' AS external, s.queue_kind AS kind,
               s.queue_max_message_bytes AS max_bytes,
               s.queue_kind <> 'postgresql'
                   AND octet_length(produce.body) > s.queue_max_message_bytes AS too_big
        FROM jobfence.settings s
    ), queued AS (
        INSERT INTO jobfence_queue.messages (
            queue, consumer, job_id, body, tenant_id, correlation_id, run_at
        )
        SELECT produce.queue, produce.consumer, produce.job_id, produce.body,
               produce.tenant_id, produce.correlation_id,
               now() + greatest(produce.delay, interval '0')
        FROM target WHERE NOT target.external
        RETURNING id, pg_notify('jobfence_queue', produce.queue)
    ), outboxed AS (
        INSERT INTO jobfence.outbox (
            queue, consumer, job_id, body, tenant_id, correlation_id, due_at
        )
        SELECT produce.queue, produce.consumer, produce.job_id, produce.body,
               produce.tenant_id, produce.correlation_id,
               now() + greatest(produce.delay, interval '0')
        FROM target WHERE target.external AND target.too_big IS NOT TRUE
        RETURNING id, pg_notify('jobfence_outbox', '')
    )
    SELECT r.id, r.max_bytes, r.kind
    INTO produce.produced_id, produce.limit_bytes, produce.limit_kind
    FROM (
        SELECT queued.id, NULL::integer AS max_bytes, NULL::text AS kind FROM queued
        UNION ALL SELECT outboxed.id, NULL, NULL FROM outboxed
        UNION ALL SELECT NULL::bigint, t.max_bytes, t.kind FROM target t WHERE t.too_big
    ) r;
END
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
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
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
    -- A negative delay counts as none: run_at is never before now().
    WITH target AS (
        SELECT s.queue_kind <> 'postgresql' AS external FROM jobfence.settings s
    ), queued AS (
        INSERT INTO jobfence_queue.messages (
            queue, consumer, job_id, body, tenant_id, correlation_id, run_at
        )
        SELECT enqueue.queue, enqueue.consumer, enqueue.job_id, convert_to(jobfence.compact_json(enqueue.payload), 'UTF8'),
               enqueue.tenant_id, enqueue.correlation_id,
               now() + greatest(enqueue.delay, interval '0')
        FROM target WHERE NOT target.external
        RETURNING id, pg_notify('jobfence_queue', enqueue.queue)
    ), outboxed AS (
        INSERT INTO jobfence.outbox (
            queue, consumer, job_id, body, tenant_id, correlation_id, due_at
        )
        SELECT enqueue.queue, enqueue.consumer, enqueue.job_id, convert_to(jobfence.compact_json(enqueue.payload), 'UTF8'),
               enqueue.tenant_id, enqueue.correlation_id,
               now() + greatest(enqueue.delay, interval '0')
        FROM target WHERE target.external
        RETURNING id, pg_notify('jobfence_outbox', '')
    )
    SELECT id INTO message_id FROM queued UNION ALL SELECT id FROM outboxed;
    RETURN message_id;
END
$$;

REVOKE EXECUTE ON FUNCTION
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
