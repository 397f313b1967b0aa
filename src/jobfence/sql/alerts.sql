-- Named queries of the Better Stack alerting (jobfence.alerts): the outbox written with each
-- dead letter, the relay's grouping, escalation and delivery bookkeeping, and the counts.
-- %(now)s is the relay's clock, NULL for the database's own (the PgQueue convention).

-- name: outbox_record
-- Runs in the dead letter's own transaction, right after the dead letter insert, for the ids
-- that insert really returned. The key columns come from the dead letter row itself.
INSERT INTO jobfence.alert_outbox (dead_letter_id, queue, consumer, error_class, created_at)
SELECT id, queue, consumer, error_class, created_at
FROM core.dead_letters
WHERE id = ANY(%(dead_letter_ids)s::bigint[])
ON CONFLICT (dead_letter_id) DO NOTHING;

-- name: relay_try_lock
-- One relay delivers at a time (a session lock on the relay's own connection); others stand by.
SELECT pg_try_advisory_lock(%(key)s::bigint);

-- name: relay_unlock
SELECT pg_advisory_unlock(%(key)s::bigint);

-- name: outbox_classify
-- Files the next outbox rows (in id order) under their alert key (migration 0020), so that
-- nothing a producer chooses multiplies incidents:
-- * a dead letter for a consumer that is not registered, or whose identifiers cannot be
--   stored (unknown_consumer_classes), goes to its queue's one key (queue, '*', '*');
-- * an error class of a consumer gets its own key while the consumer has fewer than
--   max_error_classes classes with a dead letter pending review under their own key (the
--   newcomers of this batch counted in order of their first dead letter); any other goes to
--   the consumer's (queue, consumer, '*') key.
WITH batch AS (
    SELECT o.dead_letter_id, o.queue, o.consumer, o.error_class,
           o.error_class = ANY(%(unknown_consumer_classes)s::text[]) AS unknown
    FROM jobfence.alert_outbox o
    WHERE o.scope IS NULL
    ORDER BY o.dead_letter_id
    LIMIT %(limit)s
    FOR UPDATE
), consumers AS (
    SELECT DISTINCT queue, consumer FROM batch WHERE NOT unknown
), active AS (
    -- From the pending dead letters only (an index scan of the review backlog, not history).
    SELECT DISTINCT d.queue, d.consumer, d.error_class
    FROM consumers c
    JOIN core.dead_letters d
      ON d.queue = c.queue AND d.status = 'pending_review' AND d.consumer = c.consumer
    JOIN jobfence.alert_outbox o ON o.dead_letter_id = d.id AND o.scope = 'error_class'
), active_count AS (
    SELECT queue, consumer, count(*) AS n FROM active GROUP BY queue, consumer
), fresh AS (
    SELECT b.queue, b.consumer, b.error_class,
           row_number() OVER (PARTITION BY b.queue, b.consumer
                              ORDER BY min(b.dead_letter_id)) AS rank
    FROM batch b
    WHERE NOT b.unknown
      AND NOT EXISTS (SELECT 1 FROM active a
                      WHERE a.queue = b.queue AND a.consumer = b.consumer
                        AND a.error_class = b.error_class)
    GROUP BY b.queue, b.consumer, b.error_class
), decided AS (
    SELECT b.dead_letter_id,
           CASE WHEN b.unknown THEN 'unknown_consumers'
                WHEN f.rank IS NULL THEN 'error_class'
                WHEN f.rank + coalesce(ac.n, 0) <= %(max_error_classes)s THEN 'error_class'
                ELSE 'other_error_classes' END AS scope
    FROM batch b
    LEFT JOIN fresh f
      ON f.queue = b.queue AND f.consumer = b.consumer AND f.error_class = b.error_class
    LEFT JOIN active_count ac ON ac.queue = b.queue AND ac.consumer = b.consumer
)
UPDATE jobfence.alert_outbox o
SET scope = d.scope,
    key_consumer = CASE WHEN d.scope = 'unknown_consumers' THEN '*' ELSE o.consumer END,
    key_error_class = CASE WHEN d.scope = 'error_class' THEN o.error_class ELSE '*' END
FROM decided d
WHERE o.dead_letter_id = d.dead_letter_id
RETURNING o.scope;

-- name: group_attach
-- Outbox rows join their key's open group when they were written before its window ends
-- (a late committer written before window_start joins too: it has not been alerted yet).
UPDATE jobfence.alert_outbox o
SET group_id = g.id
FROM jobfence.alert_groups g
WHERE o.group_id IS NULL AND o.scope IS NOT NULL
  AND g.closed_at IS NULL
  AND g.queue = o.queue AND g.consumer = o.key_consumer AND g.error_class = o.key_error_class
  AND g.scope = o.scope
  AND o.created_at < g.window_end;

-- name: group_close_due
-- Closes the groups whose window is over, counts their members and creates each one's alert.
-- The dedup key is fixed here, before any request is sent.
WITH due AS (
    SELECT g.id
    FROM jobfence.alert_groups g
    WHERE g.closed_at IS NULL
      AND g.window_end <= coalesce(%(now)s::timestamptz, now())
    FOR UPDATE
), counted AS (
    SELECT due.id,
           (SELECT count(*) FROM jobfence.alert_outbox o WHERE o.group_id = due.id) AS members
    FROM due
), closed AS (
    UPDATE jobfence.alert_groups g
    SET closed_at = coalesce(%(now)s::timestamptz, now()),
        dead_letters = counted.members,
        escalation_decided = (counted.members = 0)
    FROM counted
    WHERE g.id = counted.id
    RETURNING g.id, g.dead_letters
)
INSERT INTO jobfence.alerts (group_id, kind, dedup_key, dead_letters, next_attempt_at, created_at)
SELECT id, 'dead_letters', 'jobfence-dl-' || id || '-' || gen_random_uuid(), dead_letters,
       coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now())
FROM closed
WHERE dead_letters > 0
RETURNING id;

-- name: group_open_new
-- Opens a group for every key with ungrouped rows and no open group; its window starts at the
-- oldest of those rows.
INSERT INTO jobfence.alert_groups (queue, consumer, error_class, scope, window_start, window_end)
SELECT o.queue, o.key_consumer, o.key_error_class, o.scope, min(o.created_at),
       min(o.created_at) + make_interval(secs => %(window_seconds)s::double precision)
FROM jobfence.alert_outbox o
WHERE o.group_id IS NULL AND o.scope IS NOT NULL
GROUP BY o.queue, o.key_consumer, o.key_error_class, o.scope
ON CONFLICT (queue, consumer, error_class, scope) WHERE closed_at IS NULL DO NOTHING
RETURNING id;

-- name: escalation_schedule
-- D4: a closed group whose window ended escalate_after ago, and whose first alert is done, is
-- decided once: with members still pending_review it gets one escalation alert; with none
-- (all replayed or discarded) it gets nothing. A decided group is never looked at again.
WITH due AS (
    SELECT g.id
    FROM jobfence.alert_groups g
    WHERE NOT g.escalation_decided
      AND g.closed_at IS NOT NULL
      AND g.window_end <= coalesce(%(now)s::timestamptz, now())
                          - make_interval(secs => %(escalate_after_seconds)s::double precision)
      AND EXISTS (SELECT 1 FROM jobfence.alerts a
                  WHERE a.group_id = g.id AND a.kind = 'dead_letters' AND a.state <> 'pending')
    ORDER BY g.window_end
    LIMIT %(limit)s
    FOR UPDATE
), counted AS (
    SELECT due.id,
           (SELECT count(*)
            FROM jobfence.alert_outbox o
            JOIN core.dead_letters d ON d.id = o.dead_letter_id
            WHERE o.group_id = due.id AND d.status = 'pending_review') AS pending
    FROM due
), decided AS (
    UPDATE jobfence.alert_groups g
    SET escalation_decided = true
    FROM counted
    WHERE g.id = counted.id
    RETURNING g.id
)
INSERT INTO jobfence.alerts (group_id, kind, dedup_key, dead_letters, next_attempt_at, created_at)
SELECT c.id, 'escalation', 'jobfence-esc-' || c.id || '-' || gen_random_uuid(), c.pending,
       coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now())
FROM counted c
JOIN decided d ON d.id = c.id
WHERE c.pending > 0
ON CONFLICT (group_id, kind) DO NOTHING
RETURNING id;

-- name: alert_claim_next
-- The next due alert. Its attempt is counted (and committed, autocommit) before the request is
-- sent, so a later attempt knows an earlier request may have reached Better Stack. An attempt
-- whose outcome was never recorded (the relay died, or the answer was lost) is not repeated
-- before it is lost_answer_wait_seconds old: by then Better Stack has finished it or dropped it,
-- so the lookup that comes first sees the incident it may have opened.
WITH next AS (
    SELECT id
    FROM jobfence.alerts
    WHERE state = 'pending' AND next_attempt_at <= coalesce(%(now)s::timestamptz, now())
      AND (last_attempt_at IS NULL
           OR next_attempt_at > last_attempt_at
           OR last_attempt_at <= coalesce(%(now)s::timestamptz, now())
                                 - make_interval(secs => %(lost_answer_wait_seconds)s::double precision))
    ORDER BY next_attempt_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE jobfence.alerts a
SET attempts = a.attempts + 1, last_attempt_at = coalesce(%(now)s::timestamptz, now())
FROM next
WHERE a.id = next.id
RETURNING a.id, a.group_id, a.kind, a.dedup_key, a.dead_letters, a.attempts, a.storm;

-- name: alert_group_context
-- What an incident says about its group, with how many members are still pending review now.
SELECT g.queue, g.consumer, g.error_class, g.scope, g.window_start, g.window_end,
       g.dead_letters,
       (SELECT count(*)
        FROM jobfence.alert_outbox o
        JOIN core.dead_letters d ON d.id = o.dead_letter_id
        WHERE o.group_id = g.id AND d.status = 'pending_review') AS still_pending,
       (SELECT min(o.dead_letter_id) FROM jobfence.alert_outbox o WHERE o.group_id = g.id)
           AS first_dead_letter_id,
       (SELECT max(o.dead_letter_id) FROM jobfence.alert_outbox o WHERE o.group_id = g.id)
           AS last_dead_letter_id,
       (SELECT max(o.created_at) FROM jobfence.alert_outbox o WHERE o.group_id = g.id)
           AS last_created_at
FROM jobfence.alert_groups g
WHERE g.id = %(group_id)s;

-- name: alert_group_samples
-- A few members to quote in the incident (the first line of each error only, at most %(chars)s
-- characters of it: the relay redacts, then cuts it shorter), with the trace id of the failed
-- attempt when it was traced (migration 0021).
SELECT d.id, d.job_id, d.attempts, left(split_part(d.last_error, E'\n', 1), %(chars)s) AS error_line,
       substr(d.traceparent, 4, 32) AS trace_id
FROM jobfence.alert_outbox o
JOIN core.dead_letters d ON d.id = o.dead_letter_id
WHERE o.group_id = %(group_id)s
  AND (NOT %(pending_only)s::boolean OR d.status = 'pending_review')
ORDER BY o.dead_letter_id
LIMIT %(limit)s;

-- name: alert_mark_sent
-- outcome: 'opened' (this alert created the incident) or 'found' (an earlier attempt had).
UPDATE jobfence.alerts
SET state = 'sent', incident_id = %(incident_id)s, outcome = %(outcome)s, last_error = NULL,
    finished_at = coalesce(%(now)s::timestamptz, now())
WHERE id = %(id)s AND state = 'pending'
RETURNING id;

-- name: alert_mark_retry
UPDATE jobfence.alerts
SET next_attempt_at = coalesce(%(now)s::timestamptz, now())
                      + make_interval(secs => %(delay_seconds)s::double precision),
    last_error = %(error)s
WHERE id = %(id)s AND state = 'pending'
RETURNING next_attempt_at;

-- name: alert_mark_failed
UPDATE jobfence.alerts
SET state = 'failed', last_error = %(error)s, finished_at = coalesce(%(now)s::timestamptz, now())
WHERE id = %(id)s AND state = 'pending'
RETURNING id;

-- name: alert_mark_cancelled
UPDATE jobfence.alerts
SET state = 'cancelled', last_error = %(reason)s,
    finished_at = coalesce(%(now)s::timestamptz, now())
WHERE id = %(id)s AND state = 'pending'
RETURNING id;

-- name: alerts_retry_failed
-- After fixing what made Better Stack refuse them (a token, a policy id): deliver them again.
-- Their attempts stay counted, so the relay looks for an existing incident first.
UPDATE jobfence.alerts
SET state = 'pending', finished_at = NULL,
    next_attempt_at = coalesce(%(now)s::timestamptz, now())
WHERE state = 'failed'
RETURNING id;

-- name: relay_next_wake
-- Seconds until the relay has something to do: an alert or a resolve due, or a window ending
-- (NULL: nothing).
SELECT extract(epoch FROM (
           least((SELECT min(next_attempt_at) FROM jobfence.alerts WHERE state = 'pending'),
                 (SELECT min(window_end) FROM jobfence.alert_groups WHERE closed_at IS NULL),
                 (SELECT min(resolve_next_at) FROM jobfence.alert_incidents
                  WHERE state = 'resolving' AND NOT resolve_refused))
           - coalesce(%(now)s::timestamptz, now())))::double precision AS seconds;

-- name: alert_counts
-- For metrics: alerts by state, and the dead letters not yet covered by a delivered (or
-- definitively failed) alert. Every part is an index scan, whatever the history's size.
SELECT
    (SELECT count(*) FROM jobfence.alerts WHERE state = 'pending') AS pending,
    (SELECT count(*) FROM jobfence.alerts WHERE state = 'sent') AS sent,
    (SELECT count(*) FROM jobfence.alerts WHERE state = 'failed') AS failed,
    (SELECT count(*) FROM jobfence.alerts WHERE state = 'cancelled') AS cancelled,
    (SELECT count(*) FROM jobfence.alert_outbox WHERE group_id IS NULL)
    + (SELECT count(*)
       FROM jobfence.alert_outbox o
       JOIN jobfence.alert_groups g ON g.id = o.group_id
       WHERE g.closed_at IS NULL)
    + (SELECT coalesce(sum(dead_letters), 0)
       FROM jobfence.alerts
       WHERE state = 'pending' AND kind = 'dead_letters') AS dead_letters_awaiting_alert,
    (SELECT min(created_at) FROM jobfence.alerts WHERE state = 'pending') AS oldest_pending_at;

-- The lifecycle of incidents (migration 0011): one unresolved incident per key.

-- name: incident_unresolved_for_key
-- The key's incident that is not resolved (as far as we know), with whether what we know of its
-- state is older than max_age_seconds (then Better Stack is asked before deciding on it).
SELECT i.id, i.incident_id, i.state, i.escalated_at,
       i.checked_at <= coalesce(%(now)s::timestamptz, now())
                       - make_interval(secs => %(max_age_seconds)s::double precision) AS stale
FROM jobfence.alert_incidents i
JOIN jobfence.alert_groups g
  ON g.queue = i.queue AND g.consumer = i.consumer AND g.error_class = i.error_class
     AND g.scope = i.scope
WHERE g.id = %(group_id)s AND i.state <> 'resolved';

-- name: incident_unresolved_of_group
-- For an escalation: the incident its group's dead letters alert was counted on (the key's,
-- or the storm's), when it is not resolved (as far as we know).
SELECT i.id, i.incident_id, i.state, i.escalated_at,
       i.checked_at <= coalesce(%(now)s::timestamptz, now())
                       - make_interval(secs => %(max_age_seconds)s::double precision) AS stale
FROM jobfence.alerts a
JOIN jobfence.alert_incidents i ON i.incident_id = a.incident_id
WHERE a.group_id = %(group_id)s AND a.kind = 'dead_letters' AND a.state = 'sent'
  AND i.state <> 'resolved';

-- name: incident_unresolved_storm
-- The storm incident that is not resolved (as far as we know), if any.
SELECT i.id, i.incident_id, i.state, i.escalated_at,
       i.checked_at <= coalesce(%(now)s::timestamptz, now())
                       - make_interval(secs => %(max_age_seconds)s::double precision) AS stale
FROM jobfence.alert_incidents i
WHERE i.scope = 'storm' AND i.state <> 'resolved';

-- name: storm_under_way
-- Whether a new incident may open now: not when max_new incidents (the storm's aside) opened
-- within the last period, nor while an alert was counted on a storm incident within it.
SELECT (SELECT count(*) FROM jobfence.alert_incidents
        WHERE scope <> 'storm'
          AND opened_at > coalesce(%(now)s::timestamptz, now())
                          - make_interval(secs => %(period_seconds)s::double precision))
           >= %(max_new)s
       OR EXISTS (SELECT 1 FROM jobfence.alert_incidents
                  WHERE scope = 'storm'
                    AND last_counted_at > coalesce(%(now)s::timestamptz, now())
                          - make_interval(secs => %(period_seconds)s::double precision))
       AS under_way,
       (SELECT count(*) FROM jobfence.alert_incidents
        WHERE scope <> 'storm'
          AND opened_at > coalesce(%(now)s::timestamptz, now())
                          - make_interval(secs => %(period_seconds)s::double precision))
       AS opened_in_period;

-- name: alert_mark_storm
-- This alert opens the storm incident: committed before its request goes out.
UPDATE jobfence.alerts SET storm = true WHERE id = %(id)s AND state = 'pending' RETURNING id;

-- name: storm_breakdown
-- What the storm incident counts, by key: the largest first.
SELECT g.queue, g.consumer, g.error_class, g.scope, sum(a.dead_letters)::bigint AS dead_letters,
       count(*) AS alerts
FROM jobfence.alerts a
JOIN jobfence.alert_groups g ON g.id = a.group_id
WHERE a.incident_id = %(incident_id)s AND a.kind = 'dead_letters'
GROUP BY g.queue, g.consumer, g.error_class, g.scope
ORDER BY dead_letters DESC, g.queue, g.consumer, g.error_class
LIMIT %(limit)s;

-- name: incident_register
-- The incident an alert opened (or found opened by its earlier attempt) becomes its key's one
-- unresolved incident. Runs in the transaction that marks the alert sent.
-- The storm incident (storm) has the key ('*', '*', '*', 'storm').
INSERT INTO jobfence.alert_incidents (queue, consumer, error_class, scope, incident_id,
                                      opened_by_alert, opened_at, dead_letters,
                                      reported_dead_letters, checked_at, last_counted_at)
SELECT CASE WHEN %(storm)s THEN '*' ELSE g.queue END,
       CASE WHEN %(storm)s THEN '*' ELSE g.consumer END,
       CASE WHEN %(storm)s THEN '*' ELSE g.error_class END,
       CASE WHEN %(storm)s THEN 'storm' ELSE g.scope END,
       %(incident_id)s, %(alert_id)s,
       coalesce(%(now)s::timestamptz, now()), %(dead_letters)s, %(dead_letters)s,
       coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now())
FROM jobfence.alert_groups g
WHERE g.id = %(group_id)s
ON CONFLICT DO NOTHING
RETURNING id;

-- name: incident_checked
-- Better Stack says the incident is not resolved (acknowledged or not).
UPDATE jobfence.alert_incidents
SET checked_at = coalesce(%(now)s::timestamptz, now()),
    acknowledged_at = %(acknowledged_at)s::timestamptz,
    acknowledged_by = %(acknowledged_by)s
WHERE id = %(id)s;

-- name: incident_checked_expire
-- What we know of the incident's state is out of date (an escalate was refused): the next
-- decision asks Better Stack first.
UPDATE jobfence.alert_incidents SET checked_at = '-infinity' WHERE id = %(id)s;

-- name: incident_mark_resolved
-- Resolved: by the relay (its resolve request answered 200, or 409 "already resolved" by us)
-- or by a person in Better Stack (seen on a state check or on a 409).
UPDATE jobfence.alert_incidents
SET state = 'resolved', resolved_at = coalesce(%(resolved_at)s::timestamptz, %(now)s::timestamptz, now()),
    resolved_by = %(resolved_by)s, resolution = %(resolution)s, resolve_error = NULL,
    resolve_refused = false, checked_at = coalesce(%(now)s::timestamptz, now())
WHERE id = %(id)s AND state <> 'resolved'
RETURNING id;

-- name: alert_mark_merged
-- A dead letters alert whose key already has an unresolved incident: no new incident; its dead
-- letters are counted on that one (reported later as an update comment). One statement, so the
-- count moves exactly when the alert is marked.
WITH merged AS (
    UPDATE jobfence.alerts
    SET state = 'sent', incident_id = %(incident_id)s, outcome = 'merged', last_error = NULL,
        finished_at = coalesce(%(now)s::timestamptz, now())
    WHERE id = %(alert_id)s AND state = 'pending'
    RETURNING dead_letters
)
UPDATE jobfence.alert_incidents i
SET dead_letters = i.dead_letters + merged.dead_letters,
    last_counted_at = coalesce(%(now)s::timestamptz, now())
FROM merged
WHERE i.id = %(id)s
RETURNING i.dead_letters;

-- name: alert_mark_escalated
-- An escalation that escalated the key's unresolved incident (or found it escalated already).
WITH sent AS (
    UPDATE jobfence.alerts
    SET state = 'sent', incident_id = %(incident_id)s, outcome = 'escalated', last_error = NULL,
        finished_at = coalesce(%(now)s::timestamptz, now())
    WHERE id = %(alert_id)s AND state = 'pending'
    RETURNING id
)
UPDATE jobfence.alert_incidents i
SET escalated_at = coalesce(i.escalated_at, coalesce(%(now)s::timestamptz, now()))
FROM sent
WHERE i.id = %(id)s
RETURNING i.id;

-- name: incident_resolve_request
-- Every dead letter of the key (filed under it by outbox_classify; for the storm incident,
-- every dead letter of the alerts counted on it) was replayed or discarded: the open incident
-- is to be resolved. Committed before the request goes out, so a restart still does it.
UPDATE jobfence.alert_incidents i
SET state = 'resolving', resolve_requested_at = coalesce(%(now)s::timestamptz, now()),
    resolve_next_at = coalesce(%(now)s::timestamptz, now()), resolve_error = NULL
-- One branch per scope (CASE runs only the incident's own), each an index scan of the
-- pending dead letters (the review backlog), never of the history.
WHERE i.state = 'open'
  AND NOT (CASE i.scope
      WHEN 'error_class' THEN EXISTS (
          SELECT 1 FROM core.dead_letters d
          JOIN jobfence.alert_outbox o ON o.dead_letter_id = d.id AND o.scope = 'error_class'
          WHERE d.queue = i.queue AND d.error_class = i.error_class
            AND d.consumer = i.consumer AND d.status = 'pending_review')
      WHEN 'other_error_classes' THEN EXISTS (
          SELECT 1 FROM core.dead_letters d
          JOIN jobfence.alert_outbox o
            ON o.dead_letter_id = d.id AND o.scope = 'other_error_classes'
          WHERE d.queue = i.queue AND d.consumer = i.consumer AND d.status = 'pending_review')
      WHEN 'unknown_consumers' THEN EXISTS (
          SELECT 1 FROM core.dead_letters d
          JOIN jobfence.alert_outbox o
            ON o.dead_letter_id = d.id AND o.scope = 'unknown_consumers'
          WHERE d.queue = i.queue AND d.status = 'pending_review')
      ELSE EXISTS (
          SELECT 1 FROM jobfence.alerts a
          JOIN jobfence.alert_outbox o ON o.group_id = a.group_id
          JOIN core.dead_letters d ON d.id = o.dead_letter_id
          WHERE a.incident_id = i.incident_id AND a.kind = 'dead_letters'
            AND d.status = 'pending_review')
      END)
RETURNING i.id;

-- name: incident_resolve_claim
-- The next due resolve, its attempt counted before the request, with the key's pending dead
-- letters counted again (a new one since the request: the incident stays open).
WITH next AS (
    SELECT id
    FROM jobfence.alert_incidents
    WHERE state = 'resolving' AND NOT resolve_refused
      AND resolve_next_at <= coalesce(%(now)s::timestamptz, now())
    ORDER BY resolve_next_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE jobfence.alert_incidents i
SET resolve_attempts = i.resolve_attempts + 1,
    resolve_last_attempt_at = coalesce(%(now)s::timestamptz, now())
FROM next
WHERE i.id = next.id
RETURNING i.id, i.incident_id, i.queue, i.consumer, i.error_class, i.dead_letters,
          i.resolve_attempts,
          CASE i.scope
              WHEN 'error_class' THEN (
                  SELECT count(*) FROM core.dead_letters d
                  JOIN jobfence.alert_outbox o
                    ON o.dead_letter_id = d.id AND o.scope = 'error_class'
                  WHERE d.queue = i.queue AND d.error_class = i.error_class
                    AND d.consumer = i.consumer AND d.status = 'pending_review')
              WHEN 'other_error_classes' THEN (
                  SELECT count(*) FROM core.dead_letters d
                  JOIN jobfence.alert_outbox o
                    ON o.dead_letter_id = d.id AND o.scope = 'other_error_classes'
                  WHERE d.queue = i.queue AND d.consumer = i.consumer
                    AND d.status = 'pending_review')
              WHEN 'unknown_consumers' THEN (
                  SELECT count(*) FROM core.dead_letters d
                  JOIN jobfence.alert_outbox o
                    ON o.dead_letter_id = d.id AND o.scope = 'unknown_consumers'
                  WHERE d.queue = i.queue AND d.status = 'pending_review')
              ELSE (
                  SELECT count(*) FROM jobfence.alerts a
                  JOIN jobfence.alert_outbox o ON o.group_id = a.group_id
                  JOIN core.dead_letters d ON d.id = o.dead_letter_id
                  WHERE a.incident_id = i.incident_id AND a.kind = 'dead_letters'
                    AND d.status = 'pending_review')
          END AS still_pending;

-- name: incident_resolve_cancel
-- A dead letter of the key arrived after the resolve was requested: the incident stays open.
UPDATE jobfence.alert_incidents
SET state = 'open', resolve_requested_at = NULL, resolve_next_at = NULL, resolve_error = NULL
WHERE id = %(id)s AND state = 'resolving'
RETURNING id;

-- name: incident_resolve_retry
UPDATE jobfence.alert_incidents
SET resolve_next_at = coalesce(%(now)s::timestamptz, now())
                      + make_interval(secs => %(delay_seconds)s::double precision),
    resolve_error = %(error)s
WHERE id = %(id)s AND state = 'resolving'
RETURNING resolve_next_at;

-- name: incident_resolve_refused
-- Better Stack refused the resolve for good (401, 403, 422...): kept, counted as refused (the
-- heartbeat says so) until `jobfence alert-relay --retry-failed`.
UPDATE jobfence.alert_incidents
SET resolve_refused = true, resolve_error = %(error)s
WHERE id = %(id)s AND state = 'resolving'
RETURNING id;

-- name: incidents_retry_refused
UPDATE jobfence.alert_incidents
SET resolve_refused = false, resolve_next_at = coalesce(%(now)s::timestamptz, now())
WHERE resolve_refused
RETURNING id;

-- name: incident_updates_due
-- Open incidents whose count grew since Better Stack was last told, and whose last update (or
-- opening) is at least update_interval_seconds old: one comment each, at most that often.
SELECT id, incident_id, queue, consumer, error_class, scope, dead_letters,
       reported_dead_letters, opened_at
FROM jobfence.alert_incidents
WHERE state = 'open' AND dead_letters > reported_dead_letters
  AND coalesce(last_update_at, opened_at)
      <= coalesce(%(now)s::timestamptz, now())
         - make_interval(secs => %(update_interval_seconds)s::double precision)
ORDER BY id
LIMIT %(limit)s;

-- name: incident_mark_updated
-- reported is the count the comment stated; a failed comment sets only last_update_at (NULL
-- reported), so it is tried again one interval later.
UPDATE jobfence.alert_incidents
SET reported_dead_letters = coalesce(%(reported)s, reported_dead_letters),
    updates = updates + (CASE WHEN %(reported)s::integer IS NULL THEN 0 ELSE 1 END),
    last_update_at = coalesce(%(now)s::timestamptz, now())
WHERE id = %(id)s
RETURNING id;

-- name: relay_health
-- What the relay's heartbeat reports: alerts and resolves refused for good, and how long the
-- oldest alert or resolve has been waiting to go out (seconds; NULL: none waits).
SELECT
    (SELECT count(*) FROM jobfence.alerts WHERE state = 'failed')
    + (SELECT count(*) FROM jobfence.alert_incidents WHERE resolve_refused) AS refused,
    extract(epoch FROM (
        coalesce(%(now)s::timestamptz, now())
        - least((SELECT min(created_at) FROM jobfence.alerts WHERE state = 'pending'),
                (SELECT min(resolve_requested_at) FROM jobfence.alert_incidents
                 WHERE state = 'resolving'))))::double precision AS oldest_waiting_seconds;
