-- Named queries of the PostgreSQL queue adapter (schema jobfence_queue).

-- name: publish
-- Works on the caller's connection: inside the caller's transaction when one is open.
-- The NOTIFY is delivered at commit, waking idle workers. %(prior_attempts)s: deliveries of
-- this job already made (0 for a new job); receive counts the next one.
WITH inserted AS (
    INSERT INTO jobfence_queue.messages (
        queue, consumer, job_id, body, tenant_id, correlation_id, run_at, attempts,
        traceparent, tracestate
    )
    VALUES (
        %(queue)s, %(consumer)s, %(job_id)s, %(body)s, %(tenant_id)s, %(correlation_id)s,
        coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval, %(prior_attempts)s,
        %(traceparent)s, %(tracestate)s
    )
    RETURNING id
)
SELECT id, pg_notify('jobfence_queue', %(queue)s) FROM inserted;

-- name: receive
-- Takes up to %(limit)s due messages under a fresh lease. A message is due when run_at has
-- passed: new, scheduled for retry, or leased by a worker that did not finish in time.
-- One index range scan per queue (LATERAL), so a fetch costs the same at a backlog of 100 or
-- 100,000 messages; `queue = ANY(...)` with ORDER BY would sort the whole backlog every time.
WITH due AS (
    SELECT d.id
    FROM unnest(%(queues)s::text[]) AS q (name)
    CROSS JOIN LATERAL (
        SELECT m.id, m.run_at
        FROM jobfence_queue.messages m
        WHERE m.queue = q.name
          AND m.run_at <= coalesce(%(now)s::timestamptz, now())
        ORDER BY m.run_at, m.id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS d
    ORDER BY d.run_at, d.id
    LIMIT %(limit)s
)
-- The count is kept within integer's range whatever a producer wrote (a row with attempts at
-- its top is delivered with the highest attempt and dead-lettered, never overflowed into an
-- error that would stop every fetch).
UPDATE jobfence_queue.messages m
SET attempts = least(greatest(m.attempts, 0), 2147483646) + 1,
    run_at = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval,
    lease_token = %(lease_token)s::uuid
FROM due
WHERE m.id = due.id
RETURNING m.id, m.queue, m.consumer, m.job_id, m.body, m.tenant_id, m.correlation_id,
          m.attempts, m.lease_token, m.traceparent, m.tracestate;

-- name: ack
DELETE FROM jobfence_queue.messages WHERE id = %(id)s AND lease_token = %(lease_token)s;

-- name: extend
-- Moves the lease of a message this delivery still holds (same lease_token) forward, without
-- counting a delivery; a lost lease (the token changed or the message is gone) is left alone.
UPDATE jobfence_queue.messages
SET run_at = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval
WHERE id = %(id)s AND lease_token = %(lease_token)s;

-- name: ack_many
-- One statement for a batch of finished jobs; a message whose lease was lost is left alone.
DELETE FROM jobfence_queue.messages m
USING unnest(%(ids)s::bigint[], %(lease_tokens)s::uuid[]) AS a (id, lease_token)
WHERE m.id = a.id AND m.lease_token = a.lease_token;

-- name: retry
UPDATE jobfence_queue.messages
SET run_at = coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval,
    lease_token = NULL,
    last_error = %(last_error)s
WHERE id = %(id)s AND lease_token = %(lease_token)s;

-- name: release
-- Gives a message back without counting the delivery (shutdown, database outage: D7).
UPDATE jobfence_queue.messages
SET run_at = coalesce(%(now)s::timestamptz, now()),
    lease_token = NULL,
    attempts = greatest(attempts - 1, 0)
WHERE id = %(id)s AND lease_token = %(lease_token)s;

-- name: release_lost
-- Gives back, without counting that delivery, what fetches whose reply was lost leased: the
-- fetch chose its lease token, so only its messages carry it. They are still leased (run_at in
-- the future), which keeps this to the index's range of leased and scheduled messages.
UPDATE jobfence_queue.messages
SET run_at = coalesce(%(now)s::timestamptz, now()),
    lease_token = NULL,
    attempts = greatest(attempts - 1, 0)
WHERE queue = ANY(%(queues)s::text[])
  AND run_at > coalesce(%(now)s::timestamptz, now())
  AND lease_token = ANY(%(lease_tokens)s::uuid[]);

-- name: size
SELECT count(*) FILTER (WHERE run_at <= coalesce(%(now)s::timestamptz, now())) AS due,
       count(*) AS total
FROM jobfence_queue.messages
WHERE queue = ANY(%(queues)s::text[]);

-- name: backlog
-- Every message of every queue in the table, whoever holds it: what a move away would leave.
SELECT count(*) FROM jobfence_queue.messages;

-- name: depth
-- For /metrics: messages per queue by state, by the database clock. due: receivable now (new,
-- a retry whose time came, or a lease that ran out); scheduled: waiting for its time, held by
-- nobody; leased: held by a worker.
SELECT queue,
       count(*) FILTER (WHERE run_at <= now()) AS due,
       count(*) FILTER (WHERE run_at > now() AND lease_token IS NULL) AS scheduled,
       count(*) FILTER (WHERE run_at > now() AND lease_token IS NOT NULL) AS leased
FROM jobfence_queue.messages
GROUP BY queue;
