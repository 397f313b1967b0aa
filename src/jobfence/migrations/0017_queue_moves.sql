-- jobfence 0017: what a move of this database's queue checks first.
--
-- A move away from a broker is refused while that broker still holds messages. NATS and Redis
-- can list the queues of their stream or prefix; RabbitMQ cannot (AMQP has no such request), so
-- the outbox relay writes down each queue it publishes to, and a move counts those.
-- jobfence.note_broker_queues runs with its owner's rights: a relay needs no grant on the table.
CREATE TABLE jobfence.broker_queues (
    queue      text        PRIMARY KEY,
    first_seen timestamptz NOT NULL DEFAULT now()
);

-- The queues this database published to so far (the outbox's rows not yet published, and its
-- dead letters), when its queue is already a broker.
INSERT INTO jobfence.broker_queues (queue)
SELECT o.queue FROM jobfence.outbox o
UNION
SELECT d.queue FROM core.dead_letters d
WHERE EXISTS (SELECT 1 FROM jobfence.settings s WHERE s.queue_kind <> 'postgresql');

CREATE FUNCTION jobfence.note_broker_queues(queues text[]) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO jobfence.broker_queues (queue)
    SELECT DISTINCT q FROM unnest(queues) AS q
    WHERE q IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM jobfence.broker_queues b WHERE b.queue = q)
    ON CONFLICT DO NOTHING;
$$;

-- jobfence.set_queue as in 0013, refusing memory://: that queue lives inside one process, and a
-- database recorded on it would send every job where no other process can read it.
CREATE OR REPLACE FUNCTION jobfence.set_queue(kind text, location text) RETURNS text
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    previous_kind text;
    previous_location text;
    waiting bigint;
BEGIN
    IF kind IS NULL OR kind !~ '^[a-z_]{1,40}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('jobfence.set_queue: kind %s is not a queue kind',
                             quote_nullable(kind));
    END IF;
    IF kind = 'memory' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'jobfence.set_queue: memory:// lives inside one process and is never'
                      ' recorded in a database';
    END IF;
    SELECT s.queue_kind, s.queue_location INTO previous_kind, previous_location
    FROM jobfence.settings s FOR UPDATE;
    IF previous_kind = 'postgresql' AND kind <> 'postgresql' THEN
        LOCK TABLE jobfence_queue.messages IN EXCLUSIVE MODE;
        SELECT count(*) INTO waiting FROM jobfence_queue.messages;
        IF waiting > 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'object_not_in_prerequisite_state',
                MESSAGE = format('the PostgreSQL queue still holds %s message(s): run the'
                                 ' workers on it until it is empty (jobfence worker APP'
                                 ' --until empty), then switch to %s', waiting, kind);
        END IF;
    ELSIF previous_kind <> 'postgresql' AND kind = 'postgresql' THEN
        LOCK TABLE jobfence.outbox IN EXCLUSIVE MODE;
        SELECT count(*) INTO waiting FROM jobfence.outbox;
        IF waiting > 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'object_not_in_prerequisite_state',
                MESSAGE = format('the outbox still holds %s message(s) for %s: run the outbox'
                                 ' relay until it is empty (jobfence outbox-relay), then'
                                 ' switch to postgresql', waiting, previous_kind);
        END IF;
    END IF;
    UPDATE jobfence.settings
    SET queue_kind = kind, queue_location = location, updated_at = now();
    -- The queues written down belong to the queue left behind.
    IF previous_kind <> kind OR previous_location IS DISTINCT FROM location THEN
        DELETE FROM jobfence.broker_queues;
    END IF;
    RETURN previous_kind;
END
$$;
