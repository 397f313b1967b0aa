-- jobfence 0021: the W3C trace context travels with a job (docs/observability.md).
--
-- The queue row and the outbox row carry the producer's traceparent and tracestate; a dead
-- letter keeps the traceparent of the attempt that failed. Every column is nullable: a job
-- with no trace context is what it was before.
--
-- A producer that cannot pass the context as an argument (a trigger, code in another
-- language) sets the session setting jobfence.traceparent (and jobfence.tracestate), for one
-- transaction with SET LOCAL or set_config(..., true); any row written without an explicit
-- value takes it (the columns' defaults). A value that is not a valid W3C header is dropped,
-- never an error: a job is never refused for its trace context.

-- The value when it is a version-00 traceparent (lowercase hex, ids not all zero), else NULL.
CREATE FUNCTION jobfence.valid_traceparent(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT value
    WHERE value ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
      AND substr(value, 4, 32) <> repeat('0', 32)
      AND substr(value, 37, 16) <> repeat('0', 16)
$$;

-- The value when it is a tracestate of at most 512 characters and 32 members, else NULL.
CREATE FUNCTION jobfence.valid_tracestate(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT value
    WHERE value <> '' AND length(value) <= 512
      AND array_length(string_to_array(value, ','), 1) <= 32
      AND NOT EXISTS (
          SELECT 1 FROM unnest(string_to_array(value, ',')) AS m (member)
          WHERE btrim(m.member, E' \t') <> ''
            AND m.member !~ ('^[ \t]*([a-z0-9][a-z0-9_*/-]{0,255}'
                             '|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})'
                             '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*$')
      )
$$;

-- The session's trace context (jobfence.traceparent, jobfence.tracestate), validated.
CREATE FUNCTION jobfence.session_traceparent() RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT jobfence.valid_traceparent(current_setting('jobfence.traceparent', true))
$$;

CREATE FUNCTION jobfence.session_tracestate() RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT jobfence.valid_tracestate(current_setting('jobfence.tracestate', true))
    WHERE jobfence.session_traceparent() IS NOT NULL
$$;

ALTER TABLE jobfence_queue.messages
    ADD COLUMN traceparent text DEFAULT jobfence.session_traceparent(),
    ADD COLUMN tracestate  text DEFAULT jobfence.session_tracestate();
ALTER TABLE jobfence.outbox
    ADD COLUMN traceparent text DEFAULT jobfence.session_traceparent(),
    ADD COLUMN tracestate  text DEFAULT jobfence.session_tracestate();
ALTER TABLE core.dead_letters ADD COLUMN traceparent text;

-- The dead letter's traceparent is immutable like its other columns (D5).
CREATE FUNCTION core.dead_letters_traceparent_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.traceparent IS DISTINCT FROM OLD.traceparent THEN
        RAISE EXCEPTION 'dead letter %: only status, discard_reason, resolved_at and resolved_by may change',
            OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER dead_letters_traceparent_guard_row
    BEFORE UPDATE ON core.dead_letters
    FOR EACH ROW EXECUTE FUNCTION core.dead_letters_traceparent_guard();

-- jobfence.enqueue with the trace context as arguments: the seven-argument function as it is,
-- with traceparent (and tracestate) set for its insert only. The arguments win over the
-- session setting; an invalid one is dropped.
CREATE FUNCTION jobfence.enqueue(
    consumer       text,
    queue          text,
    job_id         text,
    payload        jsonb,
    tenant_id      text,
    correlation_id text,
    delay          interval,
    traceparent    text,
    tracestate     text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    message_id bigint;
    saved_parent text := current_setting('jobfence.traceparent', true);
    saved_state text := current_setting('jobfence.tracestate', true);
BEGIN
    PERFORM set_config('jobfence.traceparent',
                       coalesce(jobfence.valid_traceparent(enqueue.traceparent), ''), true);
    PERFORM set_config('jobfence.tracestate',
                       coalesce(jobfence.valid_tracestate(enqueue.tracestate), ''), true);
    message_id := jobfence.enqueue(enqueue.consumer, enqueue.queue, enqueue.job_id,
                                   enqueue.payload, enqueue.tenant_id, enqueue.correlation_id,
                                   enqueue.delay);
    PERFORM set_config('jobfence.traceparent', coalesce(saved_parent, ''), true);
    PERFORM set_config('jobfence.tracestate', coalesce(saved_state, ''), true);
    RETURN message_id;
END
$$;

-- jobfence.produce (migration 0019) the same way: what the Python producers run for a job with
-- a trace context. Not SECURITY DEFINER: the caller needs EXECUTE on the seven-argument
-- function, as before, and nothing more.
CREATE FUNCTION jobfence.produce(
    consumer       text,
    queue          text,
    job_id         text,
    body           bytea,
    tenant_id      text,
    correlation_id text,
    delay          interval,
    traceparent    text,
    tracestate     text DEFAULT NULL,
    OUT produced_id bigint,
    OUT limit_bytes integer,
    OUT limit_kind  text
)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    saved_parent text := current_setting('jobfence.traceparent', true);
    saved_state text := current_setting('jobfence.tracestate', true);
BEGIN
    PERFORM set_config('jobfence.traceparent',
                       coalesce(jobfence.valid_traceparent(produce.traceparent), ''), true);
    PERFORM set_config('jobfence.tracestate',
                       coalesce(jobfence.valid_tracestate(produce.tracestate), ''), true);
    SELECT p.produced_id, p.limit_bytes, p.limit_kind
    INTO produce.produced_id, produce.limit_bytes, produce.limit_kind
    FROM jobfence.produce(produce.consumer, produce.queue, produce.job_id, produce.body,
                          produce.tenant_id, produce.correlation_id, produce.delay) AS p;
    PERFORM set_config('jobfence.traceparent', coalesce(saved_parent, ''), true);
    PERFORM set_config('jobfence.tracestate', coalesce(saved_state, ''), true);
END
$$;
