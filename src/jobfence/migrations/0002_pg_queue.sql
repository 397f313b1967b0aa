-- jobfence 0002: the PostgreSQL queue adapter's own schema (not core).
CREATE SCHEMA IF NOT EXISTS jobfence_queue;

-- One row per message waiting or in flight. run_at is when it may next be received; receiving
-- moves run_at forward by the lease, so a message whose worker died becomes visible again when
-- its lease runs out. lease_token identifies the current holder: ack, retry and release only act
-- on the delivery that still holds the lease.
CREATE TABLE jobfence_queue.messages (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue          text        NOT NULL,
    consumer       text        NOT NULL,
    job_id         text        NOT NULL,
    body           bytea       NOT NULL,
    tenant_id      text,
    correlation_id text,
    attempts       integer     NOT NULL DEFAULT 0,
    run_at         timestamptz NOT NULL DEFAULT now(),
    lease_token    uuid,
    last_error     text,
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX messages_queue_run_at_idx ON jobfence_queue.messages (queue, run_at, id);
