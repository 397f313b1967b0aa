-- jobfence 0012: enqueue from SQL, for any language, driver or trigger, in the caller's
-- transaction. jobfence.enqueue writes the same jobfence_queue.messages row as the Python
-- producers (the named query `publish` of adapters/pg_queue.sql) and sends the same NOTIFY,
-- delivered at commit. When the queue is a broker rather than this table, this function is
-- where it will write the outbox row instead, so callers keep calling it unchanged.

-- The compact JSON text of a document: no space after ',' and ':', the separators Python's
-- producers write, so one document gives the same body bytes from SQL and from Python (object
-- keys come in jsonb's order: shorter keys first, then bytewise). jsonb's own text puts a space
-- after every ',' and ':' outside strings and nowhere else, so one pass removes them: the
-- pattern matches either a whole string (kept as is) or a separator and its space. About ten
-- times faster than walking the document with jsonb_each.
CREATE FUNCTION jobfence.compact_json(doc jsonb) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT regexp_replace(doc::text, '("(?:[^"\\]|\\.)*")|([,:]) ', '\1\2', 'g')
$$;

-- Returns the new message's id. Bad arguments raise SQLSTATE 22023 (invalid_parameter_value)
-- with a message naming the argument; nothing is written. A negative delay counts as none.
CREATE FUNCTION jobfence.enqueue(
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

    INSERT INTO jobfence_queue.messages (
        queue, consumer, job_id, body, tenant_id, correlation_id, run_at
    )
    VALUES (
        enqueue.queue, enqueue.consumer, enqueue.job_id,
        convert_to(jobfence.compact_json(enqueue.payload), 'UTF8'),
        enqueue.tenant_id, enqueue.correlation_id,
        now() + greatest(enqueue.delay, interval '0')
    )
    RETURNING id INTO message_id;
    PERFORM pg_notify('jobfence_queue', enqueue.queue);
    RETURN message_id;
END
$$;
