-- jobfence 0015: an outbox row remembers when it first fell due.
--
-- jobfence_outbox_oldest_age_seconds measures how long the longest-waiting publishable row has
-- waited since it fell due, so that a retry waiting out its delay (RabbitMQ, Redis) or a message
-- scheduled for later never looks like a stuck relay. A failed publish moves due_at forward (the
-- relay's backoff) and keeps the first due time here, so a row the broker keeps refusing goes on
-- ageing. NULL until the first failed publish: until then due_at is that time.
ALTER TABLE jobfence.outbox ADD COLUMN fell_due_at timestamptz;
