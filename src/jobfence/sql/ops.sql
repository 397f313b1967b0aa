-- Named queries of the Ops management of dead letters (jobfence.ops). The list and count
-- queries take a WHERE clause composed in Python from a fixed set of column filters.

-- name: list_base
SELECT id, job_id, queue, consumer, tenant_id, payload_encoding, attempts, last_error,
       error_class, correlation_id, status, discard_reason, created_at, resolved_at, resolved_by,
       octet_length(payload::text) AS payload_size,
       CASE WHEN octet_length(payload::text) <= %(payload_limit)s THEN payload END AS payload,
       CASE WHEN octet_length(payload::text) > %(payload_limit)s
            THEN left(payload::text, %(summary_chars)s) END AS payload_summary
FROM core.dead_letters

-- name: list_rendered_base
-- A list page read without the item cache (jobfence.ops.ItemCache): for a page whose items
-- are probably not cached, and every page without a cache. Each dead letter as the API lists
-- it: the item as compact JSON text with the fields in the
-- order of jobfence.api.schemas.DeadLetterItemOut (the tests hold the two to each other). The
-- immutable fields were rendered when the row was inserted (migration 0008,
-- jobfence.dead_letter_renderings; rendered here instead for a row that has none); the fields
-- a resolution changes are rendered now, so an item is never stale. status needs no escaping
-- (a CHECK constraint holds it to three words). Only the item is selected: jobfence.ops takes
-- the next page's keyset from the last item itself. It appends the WHERE clause, the order
-- and the limit.
-- The fallback gets its row as a ROW(...) of the columns, in the table's order, built only
-- for a row without a rendering: passing `d` itself would make the scan build every listed row
-- as one composite value (a copy of the whole row, large payloads fetched from TOAST),
-- rendering or not. A column added to core.dead_letters must be added here too (the cast
-- fails otherwise, and every list test with it).
SELECT coalesce(r.head, jobfence.render_dead_letter_head(ROW(
           d.id, d.job_id, d.queue, d.consumer, d.tenant_id, d.payload, d.payload_encoding,
           d.attempts, d.last_error, d.error_class, d.correlation_id, d.status,
           d.discard_reason, d.created_at, d.resolved_at, d.resolved_by, d.traceparent
       )::core.dead_letters))
    || CASE WHEN d.status = 'pending_review'
            -- Most rows listed; 0001's constraints hold the other three fields NULL.
            THEN ',"status":"pending_review","discard_reason":null,"created_at":'
                 || coalesce(r.created_at_json, jobfence.render_timestamp(d.created_at))
                 || ',"resolved_at":null,"resolved_by":null}'
            ELSE ',"status":"' || d.status || '"'
                 || ',"discard_reason":' || coalesce(to_json(d.discard_reason)::text, 'null')
                 || ',"created_at":' || coalesce(r.created_at_json,
                                                 jobfence.render_timestamp(d.created_at))
                 || ',"resolved_at":' || coalesce(jobfence.render_timestamp(d.resolved_at),
                                                  'null')
                 || ',"resolved_by":' || coalesce(to_json(d.resolved_by)::text, 'null')
                 || '}' END AS item
FROM core.dead_letters d
LEFT JOIN jobfence.dead_letter_renderings r ON r.dead_letter_id = d.id

-- name: list_keys_base
-- A list page's rows for jobfence.ops.list_dead_letters_json: the key of the row's cached item
-- (id, created_at) and, for a row no longer pending, the fields its resolution set, rendered
-- as the two parts that go either side of the item's created_at (NULL while pending: the item
-- as if pending is then the whole item). status needs no escaping (a CHECK constraint holds
-- it to three words). jobfence.ops appends the WHERE clause, the order and the limit.
SELECT id, created_at,
       CASE WHEN status <> 'pending_review'
            THEN ',"status":"' || status || '"'
                 || ',"discard_reason":' || coalesce(to_json(discard_reason)::text, 'null')
       END AS resolved_head,
       CASE WHEN status <> 'pending_review'
            THEN ',"resolved_at":' || coalesce(jobfence.render_timestamp(resolved_at), 'null')
                 || ',"resolved_by":' || coalesce(to_json(resolved_by)::text, 'null') || '}'
       END AS resolved_tail
FROM core.dead_letters

-- name: list_items_base
-- list_keys_base's columns and each row's item as if pending (list_items_as_pending's), in one
-- statement: for a page whose items are only sometimes cached (jobfence.ops.ItemCache.plan).
-- NULL for a row without a rendering, which list_items_as_pending_unrendered then renders.
-- resolved_head and resolved_tail are list_keys_base's, written twice on purpose (a join would
-- cost the short statement its speed): tests/test_item_cache.py holds pages read either way
-- to the page list_rendered_base renders.
SELECT id, created_at,
       CASE WHEN status <> 'pending_review'
            THEN ',"status":"' || status || '"'
                 || ',"discard_reason":' || coalesce(to_json(discard_reason)::text, 'null')
       END AS resolved_head,
       CASE WHEN status <> 'pending_review'
            THEN ',"resolved_at":' || coalesce(jobfence.render_timestamp(resolved_at), 'null')
                 || ',"resolved_by":' || coalesce(to_json(resolved_by)::text, 'null') || '}'
       END AS resolved_tail,
       r.head || ',"status":"pending_review","discard_reason":null,"created_at":'
       || r.created_at_json || ',"resolved_at":null,"resolved_by":null}' AS item_as_pending
FROM core.dead_letters
LEFT JOIN jobfence.dead_letter_renderings r ON r.dead_letter_id = dead_letters.id

-- name: list_items_as_pending
-- The dead letters %(ids)s (a bigint[] literal) as list items rendered as if still pending:
-- their immutable fields as migration 0008 rendered them and the pending tail, in the order of
-- jobfence.api.schemas.DeadLetterItemOut (the tests hold the two to each other). What D5 keeps
-- immutable never changes, so jobfence.ops.ItemCache keeps these. A row without a rendering
-- (inserted while the trigger was disabled) is missing here: list_items_as_pending_unrendered
-- renders it.
SELECT dead_letter_id,
       head || ',"status":"pending_review","discard_reason":null,"created_at":'
       || created_at_json || ',"resolved_at":null,"resolved_by":null}'
FROM jobfence.dead_letter_renderings
WHERE dead_letter_id = ANY(%(ids)s::bigint[]);

-- name: list_items_as_pending_unrendered
-- list_items_as_pending for rows without a rendering, rendered now. The fallback gets its row
-- as a ROW(...) of the columns, in the table's order: a column added to core.dead_letters must
-- be added here too (the cast fails otherwise, and every list test with it).
SELECT d.id,
       jobfence.render_dead_letter_head(ROW(
           d.id, d.job_id, d.queue, d.consumer, d.tenant_id, d.payload, d.payload_encoding,
           d.attempts, d.last_error, d.error_class, d.correlation_id, d.status,
           d.discard_reason, d.created_at, d.resolved_at, d.resolved_by, d.traceparent
       )::core.dead_letters)
       || ',"status":"pending_review","discard_reason":null,"created_at":'
       || jobfence.render_timestamp(d.created_at) || ',"resolved_at":null,"resolved_by":null}'
FROM core.dead_letters d
WHERE d.id = ANY(%(ids)s::bigint[]);

-- name: show_json
-- One dead letter whole as the API shows it (jobfence.api.schemas.DeadLetterDetailOut,
-- rendered as in list_items_as_pending, timestamps by migration 0008's function) with whether a
-- fence row exists for its (job_id, consumer).
-- No row: no such dead letter.
SELECT '{"id":' || d.id
    || ',"job_id":' || to_json(d.job_id)
    || ',"queue":' || to_json(d.queue)
    || ',"consumer":' || to_json(d.consumer)
    || ',"tenant_id":' || coalesce(to_json(d.tenant_id)::text, 'null')
    || ',"payload":' || p.payload_text
    || ',"payload_encoding":' || to_json(d.payload_encoding)
    || ',"attempts":' || d.attempts
    || ',"last_error":' || to_json(d.last_error)
    || ',"error_class":' || to_json(d.error_class)
    || ',"correlation_id":' || coalesce(to_json(d.correlation_id)::text, 'null')
    || ',"status":' || to_json(d.status)
    || ',"discard_reason":' || coalesce(to_json(d.discard_reason)::text, 'null')
    || ',"created_at":' || jobfence.render_timestamp(d.created_at)
    || ',"resolved_at":' || coalesce(jobfence.render_timestamp(d.resolved_at), 'null')
    || ',"resolved_by":' || coalesce(to_json(d.resolved_by)::text, 'null')
    || ',"trace_id":' || coalesce(to_json(substr(d.traceparent, 4, 32))::text, 'null')
    || ',"fence_exists":' || EXISTS (SELECT 1 FROM core.processed_jobs f
                                     WHERE f.job_id = d.job_id AND f.consumer = d.consumer)
    || '}'
FROM core.dead_letters AS d
CROSS JOIN LATERAL (SELECT d.payload::text AS payload_text) AS p
WHERE d.id = %(id)s;

-- name: count_base
SELECT count(*) FROM core.dead_letters

-- name: fence_exists_for
SELECT EXISTS (
    SELECT 1 FROM core.processed_jobs WHERE job_id = %(job_id)s AND consumer = %(consumer)s
);

-- name: bulk_create
INSERT INTO jobfence.bulk_replays (filter, requested_by, max_items, total)
VALUES (%(filter)s, %(requested_by)s, %(max_items)s, 0)
RETURNING id;

-- name: bulk_set_total
UPDATE jobfence.bulk_replays SET total = %(total)s WHERE id = %(id)s;

-- name: bulk_get
SELECT id, filter, requested_by, max_items, total, status, created_at, updated_at, finished_at
FROM jobfence.bulk_replays WHERE id = %(id)s;

-- name: bulk_counts
SELECT coalesce(result, 'pending') AS result, count(*) AS n
FROM jobfence.bulk_replay_items WHERE bulk_replay_id = %(id)s
GROUP BY 1;

-- name: bulk_take_chunk
-- The next unprocessed items of a run with their dead letters, locked. SKIP LOCKED lets two
-- processes resume the same run without waiting on each other or doing an item twice.
SELECT i.dead_letter_id, d.job_id, d.queue, d.consumer, d.tenant_id,
       d.payload::text AS payload_text, d.payload_encoding, d.correlation_id, d.traceparent,
       d.status,
       EXISTS (SELECT 1 FROM core.processed_jobs p
               WHERE p.job_id = d.job_id AND p.consumer = d.consumer) AS fenced
FROM jobfence.bulk_replay_items i
JOIN core.dead_letters d ON d.id = i.dead_letter_id
WHERE i.bulk_replay_id = %(id)s AND i.result IS NULL
ORDER BY i.dead_letter_id
LIMIT %(limit)s
FOR UPDATE OF i, d SKIP LOCKED;

-- name: bulk_take_chunk_waiting
-- bulk_take_chunk when it found nothing free while items remain: their rows are locked by
-- another transaction (another run replaying the same dead letters, or another process
-- resuming this run). This one waits for them; PostgreSQL then re-reads each row as that
-- transaction left it: an item it processed drops out, a dead letter it replayed or
-- discarded comes back with its new status (not_pending here).
-- The same columns as bulk_take_chunk (tests/test_sql.py checks it).
SELECT i.dead_letter_id, d.job_id, d.queue, d.consumer, d.tenant_id,
       d.payload::text AS payload_text, d.payload_encoding, d.correlation_id, d.traceparent,
       d.status,
       EXISTS (SELECT 1 FROM core.processed_jobs p
               WHERE p.job_id = d.job_id AND p.consumer = d.consumer) AS fenced
FROM jobfence.bulk_replay_items i
JOIN core.dead_letters d ON d.id = i.dead_letter_id
WHERE i.bulk_replay_id = %(id)s AND i.result IS NULL
ORDER BY i.dead_letter_id
LIMIT %(limit)s
FOR UPDATE OF i, d;

-- name: lock_timeout
SELECT current_setting('lock_timeout') AS lock_timeout;

-- name: set_lock_timeout
-- For the rest of the transaction (or until set again).
SELECT set_config('lock_timeout', %(value)s::text, true);

-- name: bulk_fail_orphans
-- A run's items that name no dead letter (written by hand: bulk_replay_items has no foreign
-- key, and dead letters are never deleted) cannot be taken with their dead letter: each is
-- failed, saying so, so that the run ends instead of looking for them for ever.
UPDATE jobfence.bulk_replay_items i
SET result = 'failed', detail = 'no dead letter has this id', processed_at = now()
WHERE i.bulk_replay_id = %(id)s AND i.result IS NULL
  AND NOT EXISTS (SELECT 1 FROM core.dead_letters d WHERE d.id = i.dead_letter_id);

-- name: bulk_unprocessed
-- Whether a run has items left, locked or not.
SELECT EXISTS (SELECT 1 FROM jobfence.bulk_replay_items
               WHERE bulk_replay_id = %(id)s AND result IS NULL);

-- name: bulk_mark_replayed
UPDATE core.dead_letters
SET status = 'replayed', resolved_at = now(), resolved_by = %(resolved_by)s
WHERE id = ANY(%(ids)s::bigint[]) AND status = 'pending_review';

-- name: bulk_record_results
UPDATE jobfence.bulk_replay_items i
SET result = r.result, detail = r.detail, processed_at = now()
FROM unnest(%(ids)s::bigint[], %(results)s::text[], %(details)s::text[]) AS r(id, result, detail)
WHERE i.bulk_replay_id = %(bulk_id)s AND i.dead_letter_id = r.id;

-- name: bulk_touch
UPDATE jobfence.bulk_replays SET updated_at = now() WHERE id = %(id)s;

-- name: bulk_finish
UPDATE jobfence.bulk_replays
SET status = 'finished', finished_at = now(), updated_at = now()
WHERE id = %(id)s AND status = 'running'
  AND NOT EXISTS (SELECT 1 FROM jobfence.bulk_replay_items
                  WHERE bulk_replay_id = %(id)s AND result IS NULL);

-- name: bulk_items
SELECT dead_letter_id, result, detail, processed_at
FROM jobfence.bulk_replay_items
WHERE bulk_replay_id = %(id)s
  AND (%(result)s::text IS NULL OR coalesce(result, 'pending') = %(result)s::text)
  AND dead_letter_id > %(after)s
ORDER BY dead_letter_id
LIMIT %(limit)s;

-- name: bulk_snapshot_base
INSERT INTO jobfence.bulk_replay_items (bulk_replay_id, dead_letter_id)
SELECT %(bulk_id)s, id FROM core.dead_letters

-- name: group_base
-- Each dead letter's grouped columns (NULL for a column not grouped by); jobfence.ops appends
-- the filter's WHERE clause and counts the groups over this.
SELECT CASE WHEN %(by_queue)s::boolean THEN queue END AS queue,
       CASE WHEN %(by_consumer)s::boolean THEN consumer END AS consumer,
       CASE WHEN %(by_error_class)s::boolean THEN error_class END AS error_class,
       created_at
FROM core.dead_letters

-- name: payload_body
-- A dead letter's payload as the stored jsonb text, and its encoding: the bytes a replay
-- publishes (jobfence.codec.original_body), for `jobfence dead-letters show --payload-out`.
SELECT payload::text AS payload_text, payload_encoding FROM core.dead_letters WHERE id = %(id)s;
