-- jobfence 0009: dead letters of one queue, newest first (the list filter queue= alone) as one
-- index range scan. 0001's (queue, status, created_at, id) index orders by time only within a
-- status, so PostgreSQL walked the whole table's time index and dropped the other queues' rows
-- (about 1,900 of them for a 50-row page at 1,000,000 dead letters over 20 queues), and for a
-- quiet queue far more. With it every single filter the API lists by equality, other than
-- job_id and correlation_id (a few rows each), has an index in the page's order.
CREATE INDEX dead_letters_queue_created_idx
    ON core.dead_letters (queue, created_at DESC, id DESC);
