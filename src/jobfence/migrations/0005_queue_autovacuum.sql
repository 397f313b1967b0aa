-- jobfence 0005: the queue table churns (every job is an insert, an update and a delete), so
-- vacuum it after a fixed number of dead rows rather than a fraction of a table that is
-- mostly empty; dead rows otherwise slow every fetch. Takes effect where autovacuum is on.
ALTER TABLE jobfence_queue.messages SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 5000,
    autovacuum_analyze_scale_factor = 0.0,
    autovacuum_analyze_threshold = 5000
);
