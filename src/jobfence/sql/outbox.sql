-- Named queries of the transactional outbox (jobfence.outbox): what producers write when the
-- queue is external, what the relay takes, publishes and deletes, and the queue setting.
-- %(now)s is a clock for tests, NULL for the database's own (the PgQueue convention).

-- name: produce
-- What every producer runs (App.enqueue, enqueue_sync, Producer), on the caller's connection,
-- never committing it. jobfence.produce (migration 0019, SECURITY DEFINER) checks the job and
-- writes the queue row (with the NOTIFY that wakes workers at commit) when this database's queue
-- is PostgreSQL, the outbox row (waking the relay) when it is external, so that a producer role
-- needs EXECUTE on it and no privilege on any table.
SELECT jobfence.produce(
    %(consumer)s::text, %(queue)s::text, %(job_id)s::text, %(body)s::bytea,
    %(tenant_id)s::text, %(correlation_id)s::text, %(delay)s::interval
);

-- name: produce_traced
-- produce for a job with a trace context (jobfence.tracing): the nine-argument jobfence.produce
-- of migration 0024 sets it for the seven-argument one's insert only.
SELECT jobfence.produce(
    %(consumer)s::text, %(queue)s::text, %(job_id)s::text, %(body)s::bytea,
    %(tenant_id)s::text, %(correlation_id)s::text, %(delay)s::interval,
    %(traceparent)s::text, %(tracestate)s::text
);

-- name: outbox_insert
-- An outbox row whatever the setting: a replay's republish when the queue is external, or a
-- delayed retry the worker writes on a broker without native delay (prior_attempts: the
-- deliveries its job already had). The NOTIFY wakes the relay at commit, so that it waits for
-- the new row's due time.
INSERT INTO jobfence.outbox (
    queue, consumer, job_id, body, tenant_id, correlation_id, due_at, prior_attempts,
    traceparent, tracestate
)
VALUES (
    %(queue)s, %(consumer)s, %(job_id)s, %(body)s, %(tenant_id)s, %(correlation_id)s,
    coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval, %(prior_attempts)s,
    %(traceparent)s, %(tracestate)s
)
RETURNING id, pg_notify('jobfence_outbox', '');

-- name: outbox_withdraw
-- Takes back a retry's row written for a delivery that then turned out to have lost its lease
-- (the ack was refused: another delivery holds the job now). Deleted unless the relay already
-- published it (gone) or is publishing it right now (locked: left to the relay; the fence makes
-- that copy harmless). Returns the id when it was deleted.
DELETE FROM jobfence.outbox
WHERE id = (SELECT o.id FROM jobfence.outbox o WHERE o.id = %(id)s FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: outbox_take
-- The relay's next due rows, oldest first, locked until its transaction ends (a relay that
-- dies releases them; the next one publishes them again).
SELECT id, queue, consumer, job_id, body, tenant_id, correlation_id, attempts, prior_attempts,
       traceparent, tracestate
FROM jobfence.outbox
WHERE due_at <= coalesce(%(now)s::timestamptz, now())
ORDER BY due_at, id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: outbox_delete_sent
-- Rows the broker confirmed: gone, so the table never grows with history. Their queues are
-- written down (once each) for the check of a move away from this broker (migration 0017).
WITH sent AS (
    DELETE FROM jobfence.outbox WHERE id = ANY(%(ids)s::bigint[]) RETURNING queue
)
SELECT jobfence.note_broker_queues(array_agg(DISTINCT queue)) FROM sent;

-- name: outbox_mark_failed
-- A publish that failed: the row stays, due again after the relay's backoff.
UPDATE jobfence.outbox
SET attempts = least(greatest(attempts, 0), 2147483646) + 1, last_error = %(error)s, fell_due_at = coalesce(fell_due_at, due_at),
    due_at = coalesce(%(now)s::timestamptz, now())
             + make_interval(secs => %(delay_seconds)s::double precision)
WHERE id = %(id)s;

-- name: outbox_counts
-- For metrics: rows waiting (due or not), how long the longest-waiting publishable row has
-- waited since it first fell due (a row still waiting out its delay does not count; one whose
-- publishes failed counts from its first due time), and the rows due now; by the database clock.
WITH clock AS (SELECT coalesce(%(now)s::timestamptz, now()) AS at),
rows AS (
    SELECT coalesce(o.fell_due_at, o.due_at) AS first_due, o.due_at FROM jobfence.outbox o
)
SELECT count(r.*) AS waiting,
       coalesce(extract(epoch FROM (c.at - min(r.first_due) FILTER (WHERE r.first_due <= c.at))),
                0)::double precision AS oldest_age_seconds,
       count(r.*) FILTER (WHERE r.due_at <= c.at) AS due
FROM clock c LEFT JOIN rows r ON true
GROUP BY c.at;

-- name: outbox_next_due
-- Seconds until the next row falls due (NULL: the outbox is empty).
SELECT extract(epoch FROM (min(due_at) - coalesce(%(now)s::timestamptz, now())))::double precision
FROM jobfence.outbox;

-- name: outbox_try_lock
-- One relay publishes at a time per database (a session lock on its own connection).
SELECT pg_try_advisory_lock(%(key)s::bigint);

-- name: outbox_unlock
SELECT pg_advisory_unlock(%(key)s::bigint);

-- name: queue_setting
SELECT queue_kind, queue_location FROM jobfence.settings;

-- name: broker_queues
-- The queues the outbox relay published to on this database's broker (migration 0017).
SELECT queue FROM jobfence.broker_queues ORDER BY queue;

-- name: queue_set
-- Switches where jobs go (see jobfence.set_queue in migration 0013); returns the kind before.
SELECT jobfence.set_queue(%(kind)s::text, %(location)s::text);
