-- jobfence 0022: an enqueue costs PostgreSQL about what its insert costs.
--
-- 1. The trace-context column defaults cost no more than a plain column. The defaults of 0021
-- (jobfence.session_traceparent(), jobfence.session_tracestate()) called SQL functions that
-- PostgreSQL could not inline: a function whose body has a WHERE clause or a
-- subquery runs through the SQL-function executor, which plans its body again in every
-- statement. That cost every insert into the queue or the outbox about 150 us of server CPU,
-- with or without a trace context: as much as the insert itself. The same checks, each written
-- as one expression (CASE ... END), are inlined into the statement that uses them and cost
-- about a microsecond. Same arguments, same results, same names: the column defaults and
-- every caller pick them up as they are.
--
-- valid_tracestate checks a tracestate of at most 241 characters with a pattern without
-- bounded repeats (each such repeat makes PostgreSQL's regex engine track one state per
-- count: tens of microseconds a match), because in so short a value no key or value can
-- reach the W3C's limits of 256 characters (241 for a multi-tenant key's tenant); a longer
-- value is checked with the exact pattern.

CREATE OR REPLACE FUNCTION jobfence.valid_traceparent(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN value ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
                     AND substr(value, 4, 32) <> '00000000000000000000000000000000'
                     AND substr(value, 37, 16) <> '0000000000000000'
                THEN value END
$$;

CREATE OR REPLACE FUNCTION jobfence.valid_tracestate(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN length(value) BETWEEN 1 AND 512
                     AND array_length(string_to_array(value, ','), 1) <= 32
                     AND CASE WHEN length(value) <= 241
                         THEN value ~ ('^[ \t]*([a-z0-9][a-z0-9_*/-]*(@[a-z][a-z0-9_*/-]{0,13})?'
                                       '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)?'
                                       '(,[ \t]*([a-z0-9][a-z0-9_*/-]*(@[a-z][a-z0-9_*/-]{0,13})?'
                                       '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)?)*$')
                         ELSE value ~ ('^[ \t]*(([a-z0-9][a-z0-9_*/-]{0,255}'
                                       '|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})'
                                       '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)?'
                                       '(,[ \t]*(([a-z0-9][a-z0-9_*/-]{0,255}'
                                       '|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})'
                                       '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)?)*$')
                         END
                THEN value END
$$;

CREATE OR REPLACE FUNCTION jobfence.session_tracestate() RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN jobfence.session_traceparent() IS NOT NULL
                THEN jobfence.valid_tracestate(current_setting('jobfence.tracestate', true)) END
$$;

-- 2. jobfence.produce and jobfence.enqueue (the seven-argument functions of 0019): the same
-- arguments, checks, messages and results, at about the cost of the insert alone. Two changes:
-- - consumer and queue are checked with a pattern without a bounded repeat plus a length
--   check (the same rule: 1-200 of these characters), about 3 us where {1,200} took 15;
-- - the row is written by an INSERT into one table, the queue's first: the one statement of
--   0019 held an INSERT into each table, and PostgreSQL set up both, with their indexes, in
--   every call: about 30 us.

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
    IF produce.delay IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.produce: delay must be an interval, not NULL';
    END IF;
    IF produce.delay > interval '3650 days' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.produce: delay %s is over the limit of 3650 days',
                             produce.delay);
    END IF;

    -- Each insert reads the setting in its own statement, and so after it holds its table's
    -- lock: jobfence.set_queue holds an EXCLUSIVE lock on the table it switches away from until
    -- it commits, so each insert sees the setting in force, and a switch of queue can never
    -- strand a job in the queue it left. The PostgreSQL queue is tried first: one statement
    -- when it is the queue. Should the queue be switched back and forth between the two
    -- statements, they are tried again. A negative delay counts as none: run_at is never
    -- before now().
    FOR attempt IN 1..3 LOOP
        INSERT INTO jobfence_queue.messages (
            queue, consumer, job_id, body, tenant_id, correlation_id, run_at
        )
        SELECT produce.queue, produce.consumer, produce.job_id, produce.body,
               produce.tenant_id, produce.correlation_id,
               now() + greatest(produce.delay, interval '0')
        FROM jobfence.settings s WHERE s.queue_kind = 'postgresql'
        RETURNING id, pg_notify('jobfence_queue', produce.queue) INTO produce.produced_id, woken;
        EXIT WHEN FOUND;
        INSERT INTO jobfence.outbox (
            queue, consumer, job_id, body, tenant_id, correlation_id, due_at
        )
        SELECT produce.queue, produce.consumer, produce.job_id, produce.body,
               produce.tenant_id, produce.correlation_id,
               now() + greatest(produce.delay, interval '0')
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
    IF enqueue.delay IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.enqueue: delay must be an interval, not NULL';
    END IF;
    IF enqueue.delay > interval '3650 days' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.enqueue: delay %s is over the limit of 3650 days',
                             enqueue.delay);
    END IF;

    -- Each insert reads the setting in its own statement, and so after it holds its table's
    -- lock: jobfence.set_queue holds an EXCLUSIVE lock on the table it switches away from until
    -- it commits, so each insert sees the setting in force, and a switch of queue can never
    -- strand a job in the queue it left. The PostgreSQL queue is tried first: one statement
    -- when it is the queue. Should the queue be switched back and forth between the two
    -- statements, they are tried again. A negative delay counts as none: run_at is never
    -- before now().
    FOR attempt IN 1..3 LOOP
        INSERT INTO jobfence_queue.messages (
            queue, consumer, job_id, body, tenant_id, correlation_id, run_at
        )
        SELECT enqueue.queue, enqueue.consumer, enqueue.job_id, convert_to(jobfence.compact_json(enqueue.payload), 'UTF8'),
               enqueue.tenant_id, enqueue.correlation_id,
               now() + greatest(enqueue.delay, interval '0')
        FROM jobfence.settings s WHERE s.queue_kind = 'postgresql'
        RETURNING id, pg_notify('jobfence_queue', enqueue.queue) INTO message_id, woken;
        EXIT WHEN FOUND;
        INSERT INTO jobfence.outbox (
            queue, consumer, job_id, body, tenant_id, correlation_id, due_at
        )
        SELECT enqueue.queue, enqueue.consumer, enqueue.job_id, convert_to(jobfence.compact_json(enqueue.payload), 'UTF8'),
               enqueue.tenant_id, enqueue.correlation_id,
               now() + greatest(enqueue.delay, interval '0')
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
