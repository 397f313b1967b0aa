-- jobfence 0011: the alert lifecycle. One Better Stack incident per (queue, consumer,
-- error_class) at a time: while it is open, the alerts of later groups of that key are merged
-- into it (counted here, reported as comments); once every dead letter of the key is replayed
-- or discarded, the relay resolves it; an escalation (D4) escalates it instead of opening a
-- new one. Each step is recorded before its request is sent, so a crash neither loses it nor
-- repeats it silently (see jobfence.alerts.relay).

-- An alert of kind 'dead_letters' either opened an incident or was merged into the key's open
-- one (merged_into_incident). An escalation either opened one or escalated the open one.
ALTER TABLE jobfence.alerts ADD COLUMN outcome text;
ALTER TABLE jobfence.alerts ADD CONSTRAINT alerts_outcome_valid
    CHECK (outcome IS NULL OR outcome IN ('opened', 'found', 'merged', 'escalated'));

-- One row per incident the relay opened (or found it had opened), as last known from Better
-- Stack's documented API. state: 'open' (as far as we know), 'resolving' (every dead letter of
-- the key was replayed or discarded: the resolve request is due or in flight), 'resolved'
-- (by a person in Better Stack, or by the relay: resolution says which, resolved_by who).
CREATE TABLE jobfence.alert_incidents (
    id                    bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue                 text        NOT NULL,
    consumer              text        NOT NULL,
    error_class           text        NOT NULL,
    incident_id           text        NOT NULL,
    opened_by_alert       bigint      NOT NULL REFERENCES jobfence.alerts (id),
    opened_at             timestamptz NOT NULL,
    state                 text        NOT NULL DEFAULT 'open',
    -- Dead letters counted on our side (the opening alert's and every merged one's), and the
    -- count Better Stack was last told (in the incident or an update comment).
    dead_letters          integer     NOT NULL,
    reported_dead_letters integer     NOT NULL,
    updates               integer     NOT NULL DEFAULT 0,
    last_update_at        timestamptz,
    -- When Better Stack last confirmed the state (GET /api/v3/incidents/{id}), and what it said.
    checked_at            timestamptz NOT NULL,
    acknowledged_at       timestamptz,
    acknowledged_by       text,
    escalated_at          timestamptz,
    -- The resolve step: requested (committed before the request goes out), attempts, retries.
    resolve_requested_at  timestamptz,
    resolve_attempts      integer     NOT NULL DEFAULT 0,
    resolve_next_at       timestamptz,
    resolve_last_attempt_at timestamptz,
    resolve_error         text,
    resolve_refused       boolean     NOT NULL DEFAULT false,
    resolved_at           timestamptz,
    resolved_by           text,
    resolution            text,
    CONSTRAINT alert_incidents_state_valid CHECK (state IN ('open', 'resolving', 'resolved')),
    CONSTRAINT alert_incidents_resolution_valid
        CHECK (resolution IS NULL OR resolution IN ('person', 'jobfence')),
    CONSTRAINT alert_incidents_resolved_iff CHECK (
        (state = 'resolved') = (resolved_at IS NOT NULL AND resolution IS NOT NULL)),
    CONSTRAINT alert_incidents_resolving_requested CHECK (
        state <> 'resolving' OR resolve_requested_at IS NOT NULL),
    CONSTRAINT alert_incidents_counts_valid CHECK (dead_letters >= 0 AND reported_dead_letters >= 0),
    CONSTRAINT alert_incidents_incident_unique UNIQUE (incident_id)
);
-- The rule: at most one incident per key that is not resolved.
CREATE UNIQUE INDEX alert_incidents_one_unresolved_per_key
    ON jobfence.alert_incidents (queue, consumer, error_class) WHERE state <> 'resolved';
CREATE INDEX alert_incidents_refused_idx
    ON jobfence.alert_incidents (id) WHERE resolve_refused;
