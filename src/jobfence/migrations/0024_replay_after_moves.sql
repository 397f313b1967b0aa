-- jobfence 0024: a replay reads where jobs go once a move away from the PostgreSQL queue is over.
--
-- jobfence.set_queue (a move, `jobfence migrate --queue-url`) locks jobfence_queue.messages
-- while it checks that the table is empty and changes the record. A producer's statement waits
-- for that lock and then reads the record the move left (jobfence.produce), so it writes the
-- outbox of the new queue. A replay from a process on the PostgreSQL queue wrote the table
-- itself, after the same wait, where no worker reads any more. This function takes the same
-- lock (ROW EXCLUSIVE, which every insert into the table takes, held to the caller's commit so
-- no move starts before then) and returns the record's queue kind. SECURITY DEFINER: the ops
-- role has INSERT on a few columns only, and LOCK TABLE wants a table privilege.
CREATE FUNCTION jobfence.queue_kind_after_moves() RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    kind text;
BEGIN
    LOCK TABLE jobfence_queue.messages IN ROW EXCLUSIVE MODE;
    SELECT s.queue_kind INTO kind FROM jobfence.settings s;
    RETURN kind;
END
$$;

REVOKE EXECUTE ON FUNCTION jobfence.queue_kind_after_moves() FROM PUBLIC;
