-- jobfence 0023: a claim of outbox rows costs the same whatever the outbox holds.
--
-- The relay claims a batch by setting claimed_until, a column no index holds. With room left on
-- each page, PostgreSQL updates such a row in place (a heap-only update: no new entry in the
-- outbox's two indexes). Pages filled to the brim by producers left no room, so every claim
-- wrote a new row version and an entry in each index, and the deletes after the broker's
-- confirms left twice the dead index entries for the next claim to step over. A little over half
-- of each new page is now left free, room for a second version of every row on it (a version
-- takes the row's size and a line pointer); the rows are short-lived, so the table stays small.
ALTER TABLE jobfence.outbox SET (fillfactor = 45);
