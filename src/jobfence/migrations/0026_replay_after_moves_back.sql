-- jobfence 0026: a replay also waits for a move back to the PostgreSQL queue.
--
-- A move away from a broker (`jobfence migrate --queue-url postgresql`) locks jobfence.outbox
-- while it checks that the outbox is empty and changes the record. A replay from a process on
-- the broker waited for that lock and then wrote its outbox row all the same, where no relay
-- publishes any more. jobfence.queue_kind_after_moves() now takes ROW EXCLUSIVE (what every
-- insert takes) on both tables a move may lock, the queue table first, so it returns the
-- record as any move in progress leaves it, and no move starts before the caller commits.
CREATE OR REPLACE FUNCTION jobfence.queue_kind_after_moves() RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    kind text;
BEGIN
    LOCK TABLE jobfence_queue.messages IN ROW EXCLUSIVE MODE;
    LOCK TABLE jobfence.outbox IN ROW EXCLUSIVE MODE;
    SELECT s.queue_kind INTO kind FROM jobfence.settings s;
    RETURN kind;
END
$$;

REVOKE EXECUTE ON FUNCTION jobfence.queue_kind_after_moves() FROM PUBLIC;
