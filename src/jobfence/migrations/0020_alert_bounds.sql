-- jobfence 0020: no producer can page on-call at will. Whatever a producer controls (consumer
-- names, and through handlers the error classes) cannot multiply incidents:
--
-- * the relay files each outbox row under an alert key before grouping it (scope):
--   'error_class'         (queue, consumer, error_class), as before, for at most
--                         max_error_classes classes of a consumer at a time;
--   'other_error_classes' (queue, consumer, '*'): the classes of a consumer beyond those;
--   'unknown_consumers'   (queue, '*', '*'): every dead letter for a consumer that is not
--                         registered (UnknownConsumer) or cannot be stored as named
--                         (UnfenceableMessage), whatever its name: one key per queue;
-- * at most max_new_incidents new incidents open per incident_period; beyond that, one 'storm'
--   incident counts every alert that would have opened one, until a whole period passes
--   without any.
--
-- Nothing is lost: every dead letter keeps its row and its outbox row, and each outbox row is
-- counted on exactly one incident (its key's, or the storm's).

ALTER TABLE jobfence.alert_outbox
    ADD COLUMN scope text,
    ADD COLUMN key_consumer text,
    ADD COLUMN key_error_class text,
    ADD CONSTRAINT alert_outbox_scope_valid CHECK (
        scope IS NULL OR scope IN ('error_class', 'other_error_classes', 'unknown_consumers')),
    ADD CONSTRAINT alert_outbox_key_iff_scope CHECK (
        (scope IS NULL) = (key_consumer IS NULL) AND (scope IS NULL) = (key_error_class IS NULL));

-- Rows grouped before this migration keep their key as it was.
UPDATE jobfence.alert_outbox
SET scope = 'error_class', key_consumer = consumer, key_error_class = error_class
WHERE group_id IS NOT NULL;

-- The relay classifies rows in id order; then groups them by key.
CREATE INDEX alert_outbox_unclassified_idx
    ON jobfence.alert_outbox (dead_letter_id) WHERE scope IS NULL;
DROP INDEX jobfence.alert_outbox_ungrouped_idx;
CREATE INDEX alert_outbox_ungrouped_idx
    ON jobfence.alert_outbox (queue, key_consumer, key_error_class, scope, created_at)
    WHERE group_id IS NULL AND scope IS NOT NULL;
-- A key's pending dead letters are found through core.dead_letters' indexes on pending rows
-- (the review backlog), then their outbox rows by primary key: no scan of the history.

ALTER TABLE jobfence.alert_groups
    ADD COLUMN scope text NOT NULL DEFAULT 'error_class',
    ADD CONSTRAINT alert_groups_scope_valid CHECK (
        scope IN ('error_class', 'other_error_classes', 'unknown_consumers'));
DROP INDEX jobfence.alert_groups_one_open_per_key;
CREATE UNIQUE INDEX alert_groups_one_open_per_key
    ON jobfence.alert_groups (queue, consumer, error_class, scope) WHERE closed_at IS NULL;

ALTER TABLE jobfence.alert_incidents
    ADD COLUMN scope text NOT NULL DEFAULT 'error_class',
    -- When an alert was last counted on it (opened or merged): a storm lasts until a whole
    -- period passes without one.
    ADD COLUMN last_counted_at timestamptz,
    ADD CONSTRAINT alert_incidents_scope_valid CHECK (
        scope IN ('error_class', 'other_error_classes', 'unknown_consumers', 'storm'));
UPDATE jobfence.alert_incidents SET last_counted_at = coalesce(last_update_at, opened_at);
DROP INDEX jobfence.alert_incidents_one_unresolved_per_key;
CREATE UNIQUE INDEX alert_incidents_one_unresolved_per_key
    ON jobfence.alert_incidents (queue, consumer, error_class, scope) WHERE state <> 'resolved';
CREATE INDEX alert_incidents_opened_idx ON jobfence.alert_incidents (opened_at);

-- An alert that opened (or is opening) the storm incident: decided and committed before its
-- request goes out, so a retry after a lost answer registers what it finds as the storm.
ALTER TABLE jobfence.alerts ADD COLUMN storm boolean NOT NULL DEFAULT false;
-- The alerts counted on an incident (the storm's dead letters are theirs).
CREATE INDEX alerts_incident_idx ON jobfence.alerts (incident_id) WHERE incident_id IS NOT NULL;
