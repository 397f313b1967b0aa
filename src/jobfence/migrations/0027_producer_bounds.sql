-- jobfence 0027: a delay is bounded by when the job falls due, and a body by 64 MiB.
--
-- 1. jobfence.produce and jobfence.enqueue refused a delay over interval '3650 days', but an
-- interval compares a month as 30 days while now() + delay adds calendar months (and a day as
-- 24 hours while it adds calendar days): months and days of opposite signs passed the check.
-- A producer could set run_at (or the outbox's due_at) in the year 3225, where the job is never
-- run nor dead-lettered and `Worker.run(until="empty")` never returns, or centuries in the
-- past, ahead of every other job. The limit is now on the time the job falls due: at most 3650
-- days from now (counted in calendar days or in 24-hour periods, whichever is later, so that a
-- change of summer time never refuses a delay the interval check accepts). A delay that lands
-- before now() counts as none, as a negative delay always did. A delay with a part (months,
-- days or time) beyond a century is refused as over the limit before any arithmetic, so that
-- now() + delay never leaves timestamptz's range.
--
-- 2. A body is at most 67108864 bytes (64 MiB, jobfence.limits.MAX_BODY_BYTES): a dead letter
-- must always be able to hold the payload, as a jsonb document or as a base64 string a third
-- larger, and jsonb refuses a string over 268435455 bytes. A larger body was accepted, and then
-- its dead letter failed on every delivery: the job came back after every lease, for ever. For
-- jobfence.enqueue the size is that of the payload's compact JSON, the body it writes (now
-- encoded once, before the checks). Whatever the queue: the outbox's rows become dead letters
-- too.
--
-- Same arguments, same results, same messages otherwise; the nine-argument forms of 0021 call
-- these and pick them up as they are.

CREATE OR REPLACE FUNCTION jobfence.produce(
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
DECLARE
    kind text;
    max_bytes integer;
    woken text;
    due timestamptz;
BEGIN
    IF produce.consumer IS NULL OR produce.consumer !~ '^[A-Za-z0-9_.:-]+$'
       OR length(produce.consumer) > 200 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: consumer %s must be 1-200 characters of'
                             ' letters, digits and _ . : -', quote_nullable(produce.consumer));
    END IF;
    IF produce.queue IS NULL OR produce.queue !~ '^[A-Za-z0-9_.:-]+$'
       OR length(produce.queue) > 200 THEN
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
    IF octet_length(produce.body) > 67108864 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: body is %s bytes long, at most 67108864 are'
                             ' allowed', octet_length(produce.body));
    END IF;
    IF produce.delay IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.produce: delay must be an interval, not NULL';
    END IF;
    -- When the job falls due: at most 3650 days from now, checked on that time, not on the
    -- interval (migration 0027). A delay with no part ahead of now, or that lands before
    -- now(), counts as none.
    due := now();
    IF date_part('year', produce.delay) > 0 OR date_part('month', produce.delay) > 0
       OR date_part('day', produce.delay) > 0 OR date_part('hour', produce.delay) > 0
       OR date_part('minute', produce.delay) > 0 OR date_part('second', produce.delay) > 0 THEN
        IF produce.delay > interval '3650 days'
           OR abs(date_part('year', produce.delay)) > 100
           OR abs(date_part('day', produce.delay)) > 36500
           OR abs(date_part('hour', produce.delay)) > 876000 THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = format('jobfence.produce: delay %s is over the limit of 3650 days',
                                 produce.delay);
        END IF;
        due := greatest(now() + produce.delay, now());
        IF due > greatest(now() + interval '3650 days', now() + interval '87600 hours') THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = format('jobfence.produce: delay %s is over the limit of 3650 days',
                                 produce.delay);
        END IF;
    END IF;

    -- Each insert reads the setting in its own statement, and so after it holds its table's
    -- lock: jobfence.set_queue holds an EXCLUSIVE lock on the table it switches away from until
    -- it commits, so each insert sees the setting in force, and a switch of queue can never
    -- strand a job in the queue it left. The PostgreSQL queue is tried first: one statement
    -- when it is the queue. Should the queue be switched back and forth between the two
    -- statements, they are tried again. The job falls due at due, never before now().
    FOR attempt IN 1..3 LOOP
        INSERT INTO jobfence_queue.messages (
            queue, consumer, job_id, body, tenant_id, correlation_id, run_at
        )
        SELECT produce.queue, produce.consumer, produce.job_id, produce.body,
               produce.tenant_id, produce.correlation_id,
               due
        FROM jobfence.settings s WHERE s.queue_kind = 'postgresql'
        RETURNING id, pg_notify('jobfence_queue', produce.queue) INTO produce.produced_id, woken;
        EXIT WHEN FOUND;
        INSERT INTO jobfence.outbox (
            queue, consumer, job_id, body, tenant_id, correlation_id, due_at
        )
        SELECT produce.queue, produce.consumer, produce.job_id, produce.body,
               produce.tenant_id, produce.correlation_id,
               due
        FROM jobfence.settings s WHERE s.queue_kind <> 'postgresql'
          AND (s.queue_max_message_bytes IS NULL
               OR octet_length(produce.body) <= s.queue_max_message_bytes)
        RETURNING id, pg_notify('jobfence_outbox', '') INTO produce.produced_id, woken;
        EXIT WHEN FOUND;
        SELECT s.queue_kind, s.queue_max_message_bytes INTO kind, max_bytes
        FROM jobfence.settings s;
        IF kind IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'object_not_in_prerequisite_state',
                MESSAGE = 'jobfence.produce: jobfence.settings holds no row (run jobfence migrate)';
        END IF;
        IF kind <> 'postgresql' AND octet_length(produce.body) > max_bytes THEN
            produce.limit_bytes := max_bytes;
            produce.limit_kind := kind;
            EXIT;
        END IF;
    END LOOP;
    IF produce.produced_id IS NULL AND produce.limit_bytes IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
            MESSAGE = 'jobfence.produce: the queue was switched three times during one enqueue';
    END IF;
END
$$;

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
    kind text;
    max_bytes integer;
    woken text;
    encoded bytea;
    due timestamptz;
BEGIN
    IF enqueue.consumer IS NULL OR enqueue.consumer !~ '^[A-Za-z0-9_.:-]+$'
       OR length(enqueue.consumer) > 200 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: consumer %s must be 1-200 characters of'
                             ' letters, digits and _ . : -', quote_nullable(enqueue.consumer));
    END IF;
    IF enqueue.queue IS NULL OR enqueue.queue !~ '^[A-Za-z0-9_.:-]+$'
       OR length(enqueue.queue) > 200 THEN
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
    encoded := convert_to(jobfence.compact_json(enqueue.payload), 'UTF8');
    IF octet_length(encoded) > 67108864 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: payload is %s bytes long as compact JSON'
                             ' (UTF-8), at most 67108864 are allowed', octet_length(encoded));
    END IF;
    IF enqueue.delay IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.enqueue: delay must be an interval, not NULL';
    END IF;
    -- When the job falls due: at most 3650 days from now, checked on that time, not on the
    -- interval (migration 0027). A delay with no part ahead of now, or that lands before
    -- now(), counts as none.
    due := now();
    IF date_part('year', enqueue.delay) > 0 OR date_part('month', enqueue.delay) > 0
       OR date_part('day', enqueue.delay) > 0 OR date_part('hour', enqueue.delay) > 0
       OR date_part('minute', enqueue.delay) > 0 OR date_part('second', enqueue.delay) > 0 THEN
        IF enqueue.delay > interval '3650 days'
           OR abs(date_part('year', enqueue.delay)) > 100
           OR abs(date_part('day', enqueue.delay)) > 36500
           OR abs(date_part('hour', enqueue.delay)) > 876000 THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = format('jobfence.enqueue: delay %s is over the limit of 3650 days',
                                 enqueue.delay);
        END IF;
        due := greatest(now() + enqueue.delay, now());
        IF due > greatest(now() + interval '3650 days', now() + interval '87600 hours') THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = format('jobfence.enqueue: delay %s is over the limit of 3650 days',
                                 enqueue.delay);
        END IF;
    END IF;

    -- Each insert reads the setting in its own statement, and so after it holds its table's
    -- lock: jobfence.set_queue holds an EXCLUSIVE lock on the table it switches away from until
    -- it commits, so each insert sees the setting in force, and a switch of queue can never
    -- strand a job in the queue it left. The PostgreSQL queue is tried first: one statement
    -- when it is the queue. Should the queue be switched back and forth between the two
    -- statements, they are tried again. The job falls due at due, never before now().
    FOR attempt IN 1..3 LOOP
        INSERT INTO jobfence_queue.messages (
            queue, consumer, job_id, body, tenant_id, correlation_id, run_at
        )
        SELECT enqueue.queue, enqueue.consumer, enqueue.job_id, encoded,
               enqueue.tenant_id, enqueue.correlation_id,
               due
        FROM jobfence.settings s WHERE s.queue_kind = 'postgresql'
        RETURNING id, pg_notify('jobfence_queue', enqueue.queue) INTO message_id, woken;
        EXIT WHEN FOUND;
        INSERT INTO jobfence.outbox (
            queue, consumer, job_id, body, tenant_id, correlation_id, due_at
        )
        SELECT enqueue.queue, enqueue.consumer, enqueue.job_id, encoded,
               enqueue.tenant_id, enqueue.correlation_id,
               due
        FROM jobfence.settings s WHERE s.queue_kind <> 'postgresql'
        RETURNING id, pg_notify('jobfence_outbox', '') INTO message_id, woken;
        EXIT WHEN FOUND;
        SELECT s.queue_kind, s.queue_max_message_bytes INTO kind, max_bytes
        FROM jobfence.settings s;
        IF kind IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'object_not_in_prerequisite_state',
                MESSAGE = 'jobfence.enqueue: jobfence.settings holds no row (run jobfence migrate)';
        END IF;
    END LOOP;
    IF message_id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
            MESSAGE = 'jobfence.enqueue: the queue was switched three times during one enqueue';
    END IF;
    RETURN message_id;
END
$$;
