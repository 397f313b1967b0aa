-- jobfence 0003: what the Ops management of dead letters needs.

-- Listing newest first with one filter at a time stays an index range scan at millions of rows
-- (status and queue are covered by 0001; job_id by 0001).
CREATE INDEX dead_letters_consumer_created_idx
    ON core.dead_letters (consumer, created_at DESC, id DESC);
CREATE INDEX dead_letters_tenant_created_idx
    ON core.dead_letters (tenant_id, created_at DESC, id DESC);
CREATE INDEX dead_letters_error_class_created_idx
    ON core.dead_letters (error_class, created_at DESC, id DESC);
CREATE INDEX dead_letters_correlation_idx ON core.dead_letters (correlation_id);

-- A bulk replay: the filter it was asked with and the fixed snapshot of dead letters that
-- matched at that moment (its items). Items are processed in chunks, each in one transaction,
-- so an interrupted run leaves every item either done or still pending, and can be resumed.
CREATE TABLE jobfence.bulk_replays (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    filter       jsonb       NOT NULL,
    requested_by text        NOT NULL,
    max_items    integer     NOT NULL CHECK (max_items >= 1),
    total        integer     NOT NULL CHECK (total >= 0),
    status       text        NOT NULL DEFAULT 'running'
        CHECK (status IN ('running', 'finished')),
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);

CREATE TABLE jobfence.bulk_replay_items (
    bulk_replay_id bigint      NOT NULL REFERENCES jobfence.bulk_replays (id),
    dead_letter_id bigint      NOT NULL,
    -- NULL while not processed yet.
    result         text        CHECK (result IN ('replayed', 'already_processed', 'not_pending',
                                                 'failed')),
    detail         text,
    processed_at   timestamptz,
    PRIMARY KEY (bulk_replay_id, dead_letter_id)
);
CREATE INDEX bulk_replay_items_todo_idx
    ON jobfence.bulk_replay_items (bulk_replay_id, dead_letter_id) WHERE result IS NULL;
