-- Named queries on the core schema. Loaded by jobfence._sql; every query here is prepared
-- against a migrated database by tests/test_sql.py.

-- name: fence_insert
-- The dedupe fence: one row means "this job's work committed for this consumer".
-- Returns a row only when this transaction inserted it; a duplicate returns nothing (after
-- waiting for a concurrent holder of the same key to commit or roll back). The row returned
-- marks the transaction as the one holding a fence (fence_held).
INSERT INTO core.processed_jobs (job_id, consumer, tenant_id, expires_at)
VALUES (%(job_id)s, %(consumer)s, %(tenant_id)s, now() + %(ttl)s::interval)
ON CONFLICT (job_id, consumer) DO NOTHING
RETURNING pg_catalog.set_config('jobfence.fence', 'held', true);

-- name: fence_insert_group
-- The fences of a group of jobs committed together (a consumer's jobs_per_transaction): one
-- statement, rows in key order so two groups wait on each other's keys in one order. Returns
-- the keys it inserted (and marks the transaction, as fence_insert does); a key already there,
-- or listed twice, is a duplicate.
INSERT INTO core.processed_jobs (job_id, consumer, tenant_id, expires_at)
SELECT f.job_id, f.consumer, f.tenant_id, now() + f.ttl
FROM unnest(%(job_ids)s::text[], %(consumers)s::text[], %(tenant_ids)s::text[],
            %(ttls)s::interval[]) AS f (job_id, consumer, tenant_id, ttl)
ORDER BY f.job_id, f.consumer
ON CONFLICT (job_id, consumer) DO NOTHING
RETURNING job_id, consumer, pg_catalog.set_config('jobfence.fence', 'held', true);

-- name: fence_held
-- Sent in one pipeline with the COMMIT of a transaction in which a handler ran: it fails unless
-- the fence statement marked this very transaction (a setting local to it, set when it
-- inserted a fence row), and its failure aborts the transaction, so that the COMMIT after it
-- is skipped. A handler that ended the fence transaction with SQL (a ROLLBACK or COMMIT
-- statement) and began another leaves a transaction without the mark. It fails by reading a
-- setting named after the reason: no setting can have such a name. Constant: it is sent with
-- no parameters, as psycopg sends its COMMIT.
SELECT CASE WHEN pg_catalog.current_setting('jobfence.fence', true) = 'held'
            THEN 'held'
            ELSE pg_catalog.current_setting(
                'jobfence: this transaction does not hold the fence of its job')
       END;

-- name: fence_exists
SELECT EXISTS (
    SELECT 1 FROM core.processed_jobs WHERE job_id = %(job_id)s AND consumer = %(consumer)s
);

-- name: dead_letter_insert
-- A redelivered failure of a job that already has a pending dead letter inserts nothing (D5).
INSERT INTO core.dead_letters (
    job_id, queue, consumer, tenant_id, payload, payload_encoding, attempts,
    last_error, error_class, correlation_id, traceparent
)
VALUES (
    %(job_id)s, %(queue)s, %(consumer)s, %(tenant_id)s, %(payload)s, %(payload_encoding)s,
    %(attempts)s, %(last_error)s, %(error_class)s, %(correlation_id)s, %(traceparent)s
)
ON CONFLICT (job_id, consumer) WHERE status = 'pending_review' DO NOTHING
RETURNING id;

-- name: dead_letter_get
SELECT id, job_id, queue, consumer, tenant_id, payload, payload_encoding, attempts, last_error,
       error_class, correlation_id, status, discard_reason, created_at, resolved_at, resolved_by,
       traceparent
FROM core.dead_letters
WHERE id = %(id)s;

-- name: dead_letter_claim_replay
-- A replay's status change, first in its transaction: the UPDATE takes the row lock, and under
-- READ COMMITTED a concurrent replay or discard that commits first makes the status check fail
-- here (the row is re-read after the wait). It commits only together with the publish
-- (jobfence.dead_letters.replay_dead_letter). payload as text keeps its exact jsonb rendering.
-- No row returned: unknown id or no longer pending (dead_letter_status).
UPDATE core.dead_letters AS d
SET status = 'replayed', resolved_at = now(), resolved_by = %(resolved_by)s
WHERE d.id = %(id)s AND d.status = 'pending_review'
RETURNING d.id, d.job_id, d.queue, d.consumer, d.tenant_id, d.payload::text AS payload_text,
          d.payload_encoding, d.correlation_id, d.traceparent,
          EXISTS (SELECT 1 FROM core.processed_jobs p
                  WHERE p.job_id = d.job_id AND p.consumer = d.consumer) AS fenced;

-- name: dead_letter_discard
-- The whole discard in one statement: the UPDATE takes the row lock, and under READ COMMITTED a
-- concurrent replay or discard that commits first makes the status check fail here (the row is
-- re-read after the wait). No row returned: unknown id or no longer pending (dead_letter_status).
UPDATE core.dead_letters
SET status = 'discarded', discard_reason = %(reason)s, resolved_at = now(),
    resolved_by = %(resolved_by)s
WHERE id = %(id)s AND status = 'pending_review'
RETURNING id, job_id, queue, consumer, tenant_id, payload, payload_encoding, attempts,
          last_error, error_class, correlation_id, status, discard_reason, created_at,
          resolved_at, resolved_by, traceparent;

-- name: dead_letter_status
SELECT status FROM core.dead_letters WHERE id = %(id)s;

-- name: cleanup_held_since
-- For each consumer, since when the PostgreSQL queue may hold a copy of a job that committed:
-- the oldest of its messages that is not a job waiting for its first run (never delivered,
-- not yet due). Such a copy is a job whose worker died between its commit and its ack, and no
-- worker has taken that queue since; when one does, the job's fence makes the copy a
-- duplicate, so cleanup keeps every fence of that consumer written since then. Read once per
-- cleanup round (one scan of the queue table): a message enqueued later is younger than any
-- fence that can expire during the round.
SELECT consumer, min(created_at) AS since
FROM jobfence_queue.messages
WHERE attempts > 0 OR lease_token IS NOT NULL OR run_at <= now()
GROUP BY consumer;

-- name: cleanup_expired_batch
-- Deletes at most %(batch_size)s expired fence rows by the database clock, but none that a
-- copy of its job may still need (cleanup_held_since: %(held_consumers)s, %(held_since)s).
-- SKIP LOCKED keeps two cleanups (or a cleanup and a worker) from waiting on each other; the
-- outer re-check of expires_at means a row is never removed unless it is expired at delete
-- time.
WITH doomed AS (
    SELECT p.job_id, p.consumer
    FROM core.processed_jobs p
    WHERE p.expires_at < now()
      AND NOT EXISTS (
          SELECT 1
          FROM unnest(%(held_consumers)s::text[], %(held_since)s::timestamptz[])
              AS h (consumer, since)
          WHERE h.consumer = p.consumer AND h.since <= p.processed_at
      )
    ORDER BY p.expires_at
    LIMIT %(batch_size)s
    FOR UPDATE OF p SKIP LOCKED
)
DELETE FROM core.processed_jobs p
USING doomed
WHERE p.job_id = doomed.job_id AND p.consumer = doomed.consumer AND p.expires_at < now();

-- name: dead_letters_pending_summary
-- For /metrics (read at scrape time): dead letters pending review per (queue, consumer) and
-- the age of the oldest in each, by the database clock. Only pending rows are read.
SELECT queue, consumer, count(*) AS pending,
       extract(epoch FROM now() - min(created_at))::float8 AS oldest_age_seconds
FROM core.dead_letters
WHERE status = 'pending_review'
GROUP BY queue, consumer;

-- name: tables_without_autovacuum
-- jobfence's tables that every job leaves dead rows in (the fence through cleanup's deletes,
-- the PostgreSQL queue through each message's lease update and ack), where autovacuum cannot
-- reclaim them: off on the server (autovacuum, or track_counts it depends on) or off for the
-- table (autovacuum_enabled in its storage options). Found by name, so that a missing table
-- is no error here (start-up checks the migrations first).
SELECT n.nspname || '.' || c.relname AS table_name, server.enabled AS server_on
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
CROSS JOIN (SELECT current_setting('autovacuum')::boolean
                   AND current_setting('track_counts')::boolean AS enabled) AS server
WHERE (n.nspname, c.relname) IN (('core', 'processed_jobs'), ('jobfence_queue', 'messages'))
  AND (NOT server.enabled
       OR EXISTS (SELECT 1 FROM unnest(c.reloptions) AS o (option)
                  WHERE lower(o.option) IN ('autovacuum_enabled=false', 'autovacuum_enabled=off',
                                            'autovacuum_enabled=no', 'autovacuum_enabled=0',
                                            'autovacuum_enabled=f', 'autovacuum_enabled=n')))
ORDER BY 1;
