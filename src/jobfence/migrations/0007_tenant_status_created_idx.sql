-- jobfence 0007: dead letters of one tenant in one status, newest first (the list filters
-- tenant_id + status, e.g. "what did we discard for this tenant", "what is pending for this
-- tenant") as one index range scan. Without it, PostgreSQL combines the tenant and the status
-- indexes (tens of thousands of rows for a status) and sorts: measured at 1,000,000 dead
-- letters, 20-30 ms per query and p95 400-550 ms for the endpoint under 32 clients.
CREATE INDEX dead_letters_tenant_status_created_idx
    ON core.dead_letters (tenant_id, status, created_at DESC, id DESC);
