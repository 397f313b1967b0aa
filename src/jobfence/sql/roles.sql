-- The database roles of a least-privilege deployment, printed by `jobfence roles --print-sql`.
-- Each {name} is replaced by a role name (plain lower-case identifiers only, checked before
-- printing). Every role is a NOLOGIN group role: grant it to the login roles that run each
-- component (GRANT jobfence_worker TO orders_worker). Apply it as a superuser after
-- `jobfence migrate`, and again after each upgrade's migrate: it is idempotent, and a new
-- version's grants cover the tables its migrations added.
--
-- The queries are applied in the order of this file.

-- name: create_roles
-- The six group roles, created when missing; none can log in.
DO $$
DECLARE
    wanted text;
BEGIN
    FOREACH wanted IN ARRAY ARRAY['{owner}', '{producer}', '{worker}', '{ops}', '{relay}',
                                  '{alert_relay}']
    LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = wanted) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', wanted);
        END IF;
    END LOOP;
END
$$;

-- name: owner
-- The owner runs `jobfence migrate` (a login role that is a member, with SET ROLE {owner}:
-- see docs/operations.md) and owns the schemas jobfence, core and jobfence_queue and all they
-- hold. The SECURITY DEFINER functions (jobfence.produce, jobfence.enqueue, the dead letters'
-- rendering trigger) run as this role, which is no superuser.
DO $$
DECLARE
    item record;
BEGIN
    EXECUTE format('GRANT CREATE ON DATABASE %I TO {owner}', current_database());
    FOR item IN
        SELECT n.nspname FROM pg_catalog.pg_namespace n
        WHERE n.nspname IN ('jobfence', 'core', 'jobfence_queue')
    LOOP
        EXECUTE format('ALTER SCHEMA %I OWNER TO {owner}', item.nspname);
    END LOOP;
    -- Tables (their identity sequences and indexes follow them) and functions.
    FOR item IN
        SELECT c.oid::regclass::text AS name FROM pg_catalog.pg_class c
        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname IN ('jobfence', 'core', 'jobfence_queue') AND c.relkind IN ('r', 'p', 'v')
    LOOP
        EXECUTE format('ALTER TABLE %s OWNER TO {owner}', item.name);
    END LOOP;
    FOR item IN
        SELECT p.oid::regprocedure::text AS name FROM pg_catalog.pg_proc p
        JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname IN ('jobfence', 'core', 'jobfence_queue')
    LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO {owner}', item.name);
    END LOOP;
END
$$;

-- name: producer
-- Enqueues (App.enqueue, enqueue_sync, Producer, Django, SQLAlchemy, psycopg2 and SQL's
-- jobfence.enqueue) through the two SECURITY DEFINER functions, to the PostgreSQL queue or the
-- outbox, whichever jobfence.settings names. No privilege on any table: it cannot read a queued
-- payload, a dead letter or the settings, nor write a column only jobfence sets.
GRANT USAGE ON SCHEMA jobfence TO {producer};
GRANT EXECUTE ON FUNCTION
    jobfence.produce(text, text, text, bytea, text, text, interval),
    jobfence.enqueue(text, text, text, jsonb, text, text, interval)
TO {producer};

-- name: worker
-- `jobfence worker` and Worker.run (with the outbox relay it runs on a broker), and
-- `jobfence cleanup`: takes, leases, retries, releases and acks queue rows, writes the fence,
-- dead letters and their alerts, retries through the outbox on brokers without native delay.
-- Dead letters: INSERT and SELECT only (no UPDATE, no DELETE).
GRANT USAGE ON SCHEMA jobfence, core, jobfence_queue TO {worker};
GRANT SELECT ON jobfence.schema_migrations TO {worker};
GRANT SELECT ON jobfence.settings TO {worker};                   -- the start-up comparison
GRANT UPDATE (queue_max_message_bytes) ON jobfence.settings TO {worker};  -- its relay: the broker's limit
GRANT SELECT, INSERT, UPDATE, DELETE ON core.processed_jobs TO {worker};  -- UPDATE, DELETE: cleanup
GRANT SELECT, INSERT ON core.dead_letters TO {worker};
GRANT INSERT, SELECT (dead_letter_id) ON jobfence.alert_outbox TO {worker};  -- SELECT: ON CONFLICT
GRANT SELECT, UPDATE, DELETE ON jobfence_queue.messages TO {worker};
GRANT SELECT, INSERT, UPDATE, DELETE ON jobfence.outbox TO {worker};

-- name: ops
-- The Ops API (`jobfence api`) and `jobfence dead-letters`: lists and shows dead letters (with
-- their payloads), replays one or in bulk, discards. A dead letter can only change status (the
-- four status columns): no INSERT, no DELETE, no TRUNCATE, no other column; the trigger on
-- core.dead_letters refuses the same. A replay publishes to the queue or the outbox; of the
-- queue it reads only what /metrics counts, never a payload.
GRANT USAGE ON SCHEMA jobfence, core, jobfence_queue TO {ops};
GRANT SELECT ON jobfence.schema_migrations, jobfence.settings TO {ops};
GRANT EXECUTE ON FUNCTION jobfence.queue_kind_after_moves() TO {ops};  -- a replay's publish
GRANT SELECT, UPDATE (status, discard_reason, resolved_at, resolved_by)
    ON core.dead_letters TO {ops};
GRANT SELECT (job_id, consumer) ON core.processed_jobs TO {ops};  -- "is it fenced?"
GRANT SELECT ON jobfence.dead_letter_renderings TO {ops};
GRANT SELECT, INSERT, UPDATE ON jobfence.bulk_replays, jobfence.bulk_replay_items TO {ops};
GRANT INSERT (queue, consumer, job_id, body, tenant_id, correlation_id, run_at, attempts,
              traceparent, tracestate),
      SELECT (id, queue, run_at, lease_token)
    ON jobfence_queue.messages TO {ops};
GRANT INSERT (queue, consumer, job_id, body, tenant_id, correlation_id, due_at, prior_attempts,
              traceparent, tracestate),
      SELECT (id)
    ON jobfence.outbox TO {ops};

-- name: relay
-- `jobfence outbox-relay`: publishes the outbox to the broker and deletes what it confirmed.
-- A message the broker refuses for good becomes a dead letter (and its alert row): INSERT only,
-- with the id it returns; it reads no dead letter. It records the broker's largest message.
GRANT USAGE ON SCHEMA jobfence, core TO {relay};
GRANT SELECT ON jobfence.schema_migrations TO {relay};
GRANT SELECT ON jobfence.settings TO {relay};                    -- the start-up comparison
GRANT UPDATE (queue_max_message_bytes) ON jobfence.settings TO {relay};  -- the broker's limit
GRANT SELECT, UPDATE, DELETE ON jobfence.outbox TO {relay};
GRANT INSERT, SELECT (id) ON core.dead_letters TO {relay};       -- PublishRefused, PublishFailed
GRANT INSERT, SELECT (dead_letter_id) ON jobfence.alert_outbox TO {relay};  -- SELECT: ON CONFLICT

-- name: alert_relay
-- `jobfence alert-relay`: groups new dead letters' alerts, opens, escalates and resolves Better
-- Stack incidents. Of the dead letters it reads what an incident quotes, never a payload.
GRANT USAGE ON SCHEMA jobfence, core TO {alert_relay};
GRANT SELECT ON jobfence.schema_migrations TO {alert_relay};
GRANT SELECT (id, job_id, queue, consumer, error_class, attempts, last_error, status, created_at,
               traceparent)
    ON core.dead_letters TO {alert_relay};
GRANT SELECT, UPDATE ON jobfence.alert_outbox TO {alert_relay};
GRANT SELECT, INSERT, UPDATE ON jobfence.alert_groups, jobfence.alerts, jobfence.alert_incidents
    TO {alert_relay};
