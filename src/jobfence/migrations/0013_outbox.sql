-- jobfence 0013: the transactional outbox, for queues that are not in this database.
--
-- jobfence.settings holds one row saying where this database's jobs go: queue_kind
-- 'postgresql' (the default: the jobfence_queue.messages table) or the kind of an external
-- broker ('rabbitmq', 'nats', 'redis', 'memory'). With an external queue every producer
-- (App.enqueue, enqueue_sync, Producer, jobfence.enqueue) writes a jobfence.outbox row in the
-- caller's transaction instead of a queue row, and the outbox relay publishes it to the
-- broker after the commit. queue_location is the queue URL without its password, for people.
CREATE TABLE jobfence.settings (
    singleton      boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    queue_kind     text        NOT NULL DEFAULT 'postgresql' CHECK (queue_kind ~ '^[a-z_]{1,40}$'),
    queue_location text,
    updated_at     timestamptz NOT NULL DEFAULT now()
);
INSERT INTO jobfence.settings DEFAULT VALUES;

-- A message waiting to be published to the external queue. due_at is when the relay may
-- publish it (a delayed enqueue, or a broker's delayed retry, waits here). A row is deleted
-- once the broker confirmed it; attempts and last_error count failed publishes.
CREATE TABLE jobfence.outbox (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue          text        NOT NULL,
    consumer       text        NOT NULL,
    job_id         text        NOT NULL,
    body           bytea       NOT NULL,
    tenant_id      text,
    correlation_id text,
    due_at         timestamptz NOT NULL DEFAULT now(),
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text,
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_due_idx ON jobfence.outbox (due_at, id);

-- Switch where jobs go. Moving away from a queue takes that queue's table lock first (every
-- producer statement waits for it, then reads the new setting) and is refused while that
-- queue still holds messages: a job is never left where no worker reads it.
CREATE FUNCTION jobfence.set_queue(kind text, location text) RETURNS text
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    previous_kind text;
    waiting bigint;
BEGIN
    IF kind IS NULL OR kind !~ '^[a-z_]{1,40}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.set_queue: kind %s is not a queue kind',
                             quote_nullable(kind));
    END IF;
    SELECT s.queue_kind INTO previous_kind FROM jobfence.settings s FOR UPDATE;
    IF previous_kind = 'postgresql' AND kind <> 'postgresql' THEN
        LOCK TABLE jobfence_queue.messages IN EXCLUSIVE MODE;
        SELECT count(*) INTO waiting FROM jobfence_queue.messages;
        IF waiting > 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'object_not_in_prerequisite_state',
                MESSAGE = format('the PostgreSQL queue still holds %s message(s): run the'
                                 ' workers on it until it is empty (jobfence worker APP'
                                 ' --until empty), then switch to %s', waiting, kind);
        END IF;
    ELSIF previous_kind <> 'postgresql' AND kind = 'postgresql' THEN
        LOCK TABLE jobfence.outbox IN EXCLUSIVE MODE;
        SELECT count(*) INTO waiting FROM jobfence.outbox;
        IF waiting > 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'object_not_in_prerequisite_state',
                MESSAGE = format('the outbox still holds %s message(s) for %s: run the outbox'
                                 ' relay until it is empty (jobfence outbox-relay), then'
                                 ' switch to postgresql', waiting, previous_kind);
        END IF;
    END IF;
    UPDATE jobfence.settings
    SET queue_kind = kind, queue_location = location, updated_at = now();
    RETURN previous_kind;
END
$$;

-- jobfence.enqueue as in 0012, writing the outbox row instead of the queue row when the queue
-- is external. Returns the id of the queue message, or of the outbox row.
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
