-- jobfence 0004: Better Stack alerts on dead letters, durable and grouped (spec behaviour 4, D4).
--
-- The flow: the dead letter's own transaction records an outbox row (so an alert can never be
-- lost between the commit and the relay); the relay gathers outbox rows of one (queue, consumer,
-- error_class) within a window into a group; a closed group gets one alert row, delivered to
-- Better Stack as one incident. core.dead_letters stays append-only: nothing here touches it.

-- A group: dead letters of one (queue, consumer, error_class) whose created_at falls before
-- window_end, window_end being window_start (the first one's created_at) plus the window.
-- At most one group per key is open (collecting) at a time; closing it counts its members.
CREATE TABLE jobfence.alert_groups (
    id                   bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue                text        NOT NULL,
    consumer             text        NOT NULL,
    error_class          text        NOT NULL,
    window_start         timestamptz NOT NULL,
    window_end           timestamptz NOT NULL,
    closed_at            timestamptz,
    dead_letters         integer     NOT NULL DEFAULT 0,
    -- D4: set once the group's escalation was decided (raised, or not needed because no member
    -- was still pending_review when it became due). Decided groups are never looked at again.
    escalation_decided   boolean     NOT NULL DEFAULT false,
    CONSTRAINT alert_groups_window_valid CHECK (window_end > window_start),
    CONSTRAINT alert_groups_count_valid CHECK (dead_letters >= 0)
);
CREATE UNIQUE INDEX alert_groups_one_open_per_key
    ON jobfence.alert_groups (queue, consumer, error_class) WHERE closed_at IS NULL;
CREATE INDEX alert_groups_escalation_todo_idx
    ON jobfence.alert_groups (window_end) WHERE NOT escalation_decided;

-- One row per dead letter that needs alerting, written in the dead letter's transaction, and
-- only when that transaction really inserted the dead letter. The key columns are copied from
-- the dead letter row by the same INSERT ... SELECT, so they cannot disagree with it. No
-- foreign key to core.dead_letters: its rows are never deleted (D5, enforced by its trigger),
-- and the core table stays free of references from jobfence's bookkeeping.
CREATE TABLE jobfence.alert_outbox (
    dead_letter_id bigint      PRIMARY KEY,
    queue          text        NOT NULL,
    consumer       text        NOT NULL,
    error_class    text        NOT NULL,
    created_at     timestamptz NOT NULL,
    group_id       bigint      REFERENCES jobfence.alert_groups (id)
);
CREATE INDEX alert_outbox_ungrouped_idx
    ON jobfence.alert_outbox (queue, consumer, error_class, created_at) WHERE group_id IS NULL;
CREATE INDEX alert_outbox_group_idx ON jobfence.alert_outbox (group_id);

-- One row per incident to open: the alert of a closed group ('dead_letters') and at most one
-- escalation per group ('escalation', D4). dedup_key goes into the incident's metadata before
-- the first request is sent; after a crash or a lost answer the relay looks the key up in
-- Better Stack before creating again, so an incident is never opened twice.
-- attempts is incremented (and committed) before each request is sent.
CREATE TABLE jobfence.alerts (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_id        bigint      NOT NULL REFERENCES jobfence.alert_groups (id),
    kind            text        NOT NULL,
    dedup_key       text        NOT NULL,
    dead_letters    integer     NOT NULL,
    state           text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL,
    last_attempt_at timestamptz,
    last_error      text,
    incident_id     text,
    created_at      timestamptz NOT NULL,
    finished_at     timestamptz,
    CONSTRAINT alerts_kind_valid CHECK (kind IN ('dead_letters', 'escalation')),
    CONSTRAINT alerts_state_valid CHECK (state IN ('pending', 'sent', 'failed', 'cancelled')),
    CONSTRAINT alerts_incident_iff_sent CHECK ((state = 'sent') = (incident_id IS NOT NULL)),
    CONSTRAINT alerts_finished_iff_not_pending CHECK ((state = 'pending') = (finished_at IS NULL)),
    CONSTRAINT alerts_attempts_valid CHECK (attempts >= 0),
    CONSTRAINT alerts_dedup_key_unique UNIQUE (dedup_key),
    CONSTRAINT alerts_once_per_group_and_kind UNIQUE (group_id, kind)
);
CREATE INDEX alerts_due_idx ON jobfence.alerts (next_attempt_at, id) WHERE state = 'pending';
CREATE INDEX alerts_state_idx ON jobfence.alerts (state);
