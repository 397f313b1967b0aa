-- jobfence 0001: the dedupe fence and the dead letters (spec: job-infrastructure.md, D3, D5).
CREATE SCHEMA IF NOT EXISTS core;

-- The fence. One row per (job_id, consumer) whose work committed; written inside the work
-- transaction. Not partitioned by time: the primary key stays globally unique (D3).
CREATE TABLE core.processed_jobs (
    job_id       text        NOT NULL,
    consumer     text        NOT NULL,
    tenant_id    text,
    processed_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    CONSTRAINT processed_jobs_pkey PRIMARY KEY (job_id, consumer),
    CONSTRAINT processed_jobs_expiry_after_processing CHECK (expires_at > processed_at)
);
-- Cleanup walks this index in bounded batches.
CREATE INDEX processed_jobs_expires_at_idx ON core.processed_jobs (expires_at);

CREATE TABLE core.dead_letters (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id           text        NOT NULL,
    queue            text        NOT NULL,
    consumer         text        NOT NULL,
    tenant_id        text,
    -- The full payload. When the original bytes are not UTF-8 JSON that jsonb can hold (D6),
    -- payload_encoding is 'base64' and payload is {"encoding": "base64", "data": ..., "note": ...}.
    payload          jsonb       NOT NULL,
    payload_encoding text        NOT NULL DEFAULT 'json',
    attempts         integer     NOT NULL,
    last_error       text        NOT NULL,
    error_class      text        NOT NULL,
    correlation_id   text,
    status           text        NOT NULL DEFAULT 'pending_review',
    discard_reason   text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    resolved_at      timestamptz,
    resolved_by      text,
    CONSTRAINT dead_letters_status_valid
        CHECK (status IN ('pending_review', 'replayed', 'discarded')),
    CONSTRAINT dead_letters_payload_encoding_valid
        CHECK (payload_encoding IN ('json', 'base64')),
    CONSTRAINT dead_letters_attempts_positive CHECK (attempts >= 1),
    -- D5: a non-blank discard reason exactly when discarded.
    CONSTRAINT dead_letters_discard_reason_iff_discarded
        CHECK ((status = 'discarded') = (discard_reason IS NOT NULL AND discard_reason ~ '[^[:space:]]')),
    CONSTRAINT dead_letters_discard_reason_length
        CHECK (discard_reason IS NULL OR char_length(discard_reason) <= 2000),
    -- Who and when are recorded exactly when a dead letter leaves pending_review.
    CONSTRAINT dead_letters_resolution_iff_resolved
        CHECK ((status = 'pending_review') = (resolved_at IS NULL)
               AND (status = 'pending_review') = (resolved_by IS NULL)
               AND (resolved_by IS NULL OR resolved_by ~ '[^[:space:]]'))
);

-- D5: a redelivered failure cannot create a second pending dead letter.
CREATE UNIQUE INDEX dead_letters_one_pending_per_job
    ON core.dead_letters (job_id, consumer) WHERE status = 'pending_review';
-- Listing by status, queue and time (newest first, keyset on (created_at, id)).
CREATE INDEX dead_letters_status_created_idx ON core.dead_letters (status, created_at DESC, id DESC);
CREATE INDEX dead_letters_queue_status_created_idx
    ON core.dead_letters (queue, status, created_at DESC, id DESC);
CREATE INDEX dead_letters_created_idx ON core.dead_letters (created_at DESC, id DESC);
CREATE INDEX dead_letters_job_id_idx ON core.dead_letters (job_id);

-- D5 in the database: append-only except the pending_review -> replayed | discarded transition.
CREATE FUNCTION core.dead_letters_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('DELETE', 'TRUNCATE') THEN
        RAISE EXCEPTION 'core.dead_letters is append-only: % is not allowed', TG_OP
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    -- TG_OP = 'UPDATE'. Immutable columns first, so the error names the real problem.
    IF (NEW.id, NEW.job_id, NEW.queue, NEW.consumer, NEW.tenant_id, NEW.payload,
        NEW.payload_encoding, NEW.attempts, NEW.last_error, NEW.error_class, NEW.correlation_id,
        NEW.created_at)
       IS DISTINCT FROM
       (OLD.id, OLD.job_id, OLD.queue, OLD.consumer, OLD.tenant_id, OLD.payload,
        OLD.payload_encoding, OLD.attempts, OLD.last_error, OLD.error_class, OLD.correlation_id,
        OLD.created_at) THEN
        RAISE EXCEPTION 'dead letter %: only status, discard_reason, resolved_at and resolved_by may change',
            OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF OLD.status <> 'pending_review' THEN
        RAISE EXCEPTION 'dead letter % is already % and cannot change', OLD.id, OLD.status
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF NEW.status NOT IN ('replayed', 'discarded') THEN
        RAISE EXCEPTION 'dead letter % may only move from pending_review to replayed or discarded, not to %',
            OLD.id, NEW.status
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER dead_letters_guard_row
    BEFORE UPDATE OR DELETE ON core.dead_letters
    FOR EACH ROW EXECUTE FUNCTION core.dead_letters_guard();
CREATE TRIGGER dead_letters_guard_truncate
    BEFORE TRUNCATE ON core.dead_letters
    FOR EACH STATEMENT EXECUTE FUNCTION core.dead_letters_guard();
