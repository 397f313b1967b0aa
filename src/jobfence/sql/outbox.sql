-- Named queries of the transactional outbox (jobfence.outbox): what producers write when the
-- queue is external, what the relay takes, publishes and deletes, and the queue setting.
-- %(now)s is a clock for tests, NULL for the database's own (the PgQueue convention).

-- name: produce
-- What every producer runs (App.enqueue, enqueue_sync, Producer), on the caller's connection,
-- never committing it. jobfence.produce (migration 0019, SECURITY DEFINER) checks the job and
-- writes the queue row (with the NOTIFY that wakes workers at commit) when this database's queue
-- is PostgreSQL, the outbox row (waking the relay) when it is external, so that a producer role
-- needs EXECUTE on it and no privilege on any table. Returns (id, NULL, NULL); or, writing
-- nothing and raising nothing (the caller's transaction stays usable), (NULL, limit, kind) when
-- the body is over the largest message the external queue's broker accepts
-- (queue_max_message_bytes, recorded by the outbox relay).
SELECT produced_id, limit_bytes, limit_kind FROM jobfence.produce(
    %(consumer)s::text, %(queue)s::text, %(job_id)s::text, %(body)s::bytea,
    %(tenant_id)s::text, %(correlation_id)s::text, %(delay)s::interval
);

-- name: produce_traced
-- produce for a job with a trace context (jobfence.tracing): the nine-argument jobfence.produce
-- of migration 0021 sets it for the seven-argument one's insert only. The same answer.
SELECT produced_id, limit_bytes, limit_kind FROM jobfence.produce(
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
-- published it (gone) or is publishing it right now (claimed: left to the relay; the fence
-- makes that copy harmless). Returns the id when it was deleted.
DELETE FROM jobfence.outbox
WHERE id = (
    SELECT o.id FROM jobfence.outbox o
    WHERE o.id = %(id)s AND (o.claimed_until IS NULL OR o.claimed_until <= now())
    FOR UPDATE SKIP LOCKED
)
RETURNING id;

-- name: outbox_claim
-- The relay's next due rows, oldest first, claimed until %(claim_seconds)s from now in a
-- transaction of their own: the relay publishes them after the commit, with no transaction
-- open while it waits for the broker. A row claimed by a relay that died is taken again once
-- its claim ended (or at once, after outbox_release_claims). The rows are updated through the
-- primary key (an array of the ids taken), so a claim costs the same whatever the outbox holds;
-- a join with the ids taken could be planned as a scan of the whole table. The relay sorts them.
-- A claim ending later than %(claim_seconds)s from now is not one a relay made (the active relay
-- makes claims that long, and clears every claim when it takes over): a row written with it by
-- hand is taken like any other.
WITH clock AS (SELECT coalesce(%(now)s::timestamptz, now()) AS at),
taken AS (
    SELECT o.id FROM jobfence.outbox o, clock c
    WHERE o.due_at <= c.at
      AND (o.claimed_until IS NULL OR o.claimed_until <= c.at
           OR o.claimed_until > c.at + make_interval(secs => %(claim_seconds)s::double precision))
    ORDER BY o.due_at, o.id
    LIMIT %(limit)s
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE jobfence.outbox o
SET claimed_until = c.at + make_interval(secs => %(claim_seconds)s::double precision)
FROM clock c
WHERE o.id = ANY(ARRAY(SELECT id FROM taken))
RETURNING o.id, o.queue, o.consumer, o.job_id, o.body, o.tenant_id, o.correlation_id,
          o.attempts, o.prior_attempts, o.traceparent, o.tracestate,
          -- For the relay to sort the batch by: a number, as a producer may write a due time no
          -- Python datetime holds (a date BC is finite, and due at once).
          extract(epoch FROM o.due_at)::double precision AS due_order,
          -- The row's publish id (a broker that keeps ids stores one copy of a row sent twice):
          -- the same each time this row is claimed, whichever relay claims it, and another for
          -- any other row, of this database or another. Made here, from the creation time as a
          -- number (a producer may write one no Python datetime holds: infinity, year 20000)
          -- and the ids as they are.
          left(encode(sha256(convert_to(concat_ws(E'\x1f', o.id,
              extract(epoch FROM o.created_at), o.queue, o.consumer, o.job_id), 'UTF8')),
              'hex'), 32) AS publish_id;

-- name: outbox_release_claims
-- A relay that becomes the active one clears every claim: the relay that made them is gone
-- (it held the lock this one now holds), so its rows are due again at once.
UPDATE jobfence.outbox SET claimed_until = NULL WHERE claimed_until IS NOT NULL;

-- name: outbox_delete_sent
-- Rows the broker confirmed: gone, so the table never grows with history. Their queues are
-- written down (once each) for the check of a move away from this broker (migration 0017).
WITH sent AS (
    DELETE FROM jobfence.outbox WHERE id = ANY(%(ids)s::bigint[]) RETURNING queue
)
SELECT jobfence.note_broker_queues(array_agg(DISTINCT queue)) FROM sent;

-- name: outbox_unclaim
-- Rows not published because the broker went away (%(error)s), or claimed ahead by a relay
-- that stops (NULL): claimed no more and not pushed back (the relay backs off as a whole,
-- once per outage); due as they were.
UPDATE jobfence.outbox
SET claimed_until = NULL, last_error = coalesce(%(error)s, last_error)
WHERE id = ANY(%(ids)s::bigint[]);

-- name: outbox_mark_failed
-- A publish of this one message that failed while the broker answered (not an outage): the
-- row stays, due again after its own backoff (%(delay_seconds)s, from its own count of failed
-- publishes, which the others' successes do not reset).
UPDATE jobfence.outbox
SET attempts = least(greatest(attempts, 0), 2147483646) + 1, last_error = %(error)s, fell_due_at = coalesce(fell_due_at, due_at),
    claimed_until = NULL,
    due_at = coalesce(%(now)s::timestamptz, now())
             + make_interval(secs => %(delay_seconds)s::double precision)
WHERE id = %(id)s;

-- name: outbox_dead_letter
-- A message the broker refuses for good (or that failed too often, or whose identifiers no
-- worker could take): its row leaves the outbox for a dead letter of its own error class, in
-- one statement; the caller records the alert with the id returned (none when the job already
-- has a dead letter pending review, D5). The identifiers are the caller's: the row's, or their
-- bounded stand-ins when the row's cannot be stored as they are (the payload keeps them whole).
WITH gone AS (
    DELETE FROM jobfence.outbox WHERE id = %(id)s RETURNING prior_attempts
)
INSERT INTO core.dead_letters (
    job_id, queue, consumer, tenant_id, payload, payload_encoding, attempts,
    last_error, error_class, correlation_id
)
SELECT %(job_id)s, %(queue)s, %(consumer)s, %(tenant_id)s, %(payload)s, %(payload_encoding)s,
       greatest(g.prior_attempts, 1), %(last_error)s, %(error_class)s, %(correlation_id)s
FROM gone g
ON CONFLICT (job_id, consumer) WHERE status = 'pending_review' DO NOTHING
RETURNING id;

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
-- Seconds until the next row falls due or its claim ends (NULL: the outbox is empty).
SELECT extract(epoch FROM (min(greatest(due_at, coalesce(claimed_until, due_at)))
                           - coalesce(%(now)s::timestamptz, now())))::double precision
FROM jobfence.outbox;

-- name: outbox_try_lock
-- One relay publishes at a time per database (a session lock on its own connection).
SELECT pg_try_advisory_lock(%(key)s::bigint);

-- name: outbox_unlock
SELECT pg_advisory_unlock(%(key)s::bigint);

-- name: queue_setting
SELECT queue_kind, queue_location FROM jobfence.settings;

-- name: queue_kind_after_moves
-- The record's queue kind once a move away from the PostgreSQL queue is over (migration 0024);
-- the lock it takes is held to the commit of the transaction that asks.
SELECT jobfence.queue_kind_after_moves();

-- name: broker_queues
-- The queues the outbox relay published to on this database's broker (migration 0017).
SELECT queue FROM jobfence.broker_queues ORDER BY queue;

-- name: queue_limit_set
-- The outbox relay records the largest message its broker accepts (NULL: unknown), for the
-- produce query; only when it changed, and only while the queue is external.
UPDATE jobfence.settings SET queue_max_message_bytes = %(max_bytes)s
WHERE queue_kind <> 'postgresql' AND queue_max_message_bytes IS DISTINCT FROM %(max_bytes)s;

-- name: queue_set
-- Switches where jobs go (see jobfence.set_queue in migration 0013); returns the kind before.
SELECT jobfence.set_queue(%(kind)s::text, %(location)s::text);
