-- jobfence 0006: the triage query "pending dead letters of this queue and error class, newest
-- first" (the list filter and a bulk replay's snapshot) as one index range scan. Without it,
-- PostgreSQL combines two single-column indexes and sorts tens of thousands of rows (measured
-- at 1,000,000 dead letters: p95 37 ms -> 0.9 ms over 560 queue x error class pairs).
CREATE INDEX dead_letters_pending_queue_error_idx
    ON core.dead_letters (queue, error_class, created_at DESC, id DESC)
    WHERE status = 'pending_review';
