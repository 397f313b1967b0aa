-- jobfence 0018: the outbox relay claims rows instead of holding them locked.
--
-- The relay keeps no transaction open while it waits for the broker: a short transaction
-- claims a batch of due rows (claimed_until: the end of the claim), commits, the relay
-- publishes them, and another short transaction deletes the confirmed ones. A claimed row is
-- not taken again until its claim ends, so a relay that died mid-batch leaves its rows to the
-- next one: at once when a relay takes over (one relay is active per database, and it clears
-- the claims left by the one before), after the claim at the latest. NULL: not claimed.
ALTER TABLE jobfence.outbox ADD COLUMN claimed_until timestamptz;

-- The largest message body the external queue's broker accepts, in bytes, when it says so
-- (NATS: the max_payload its server sends at connect), recorded by the outbox relay once it
-- is connected; NULL when unknown or unlimited. Producers refuse a job whose body is over it
-- (the produce query), instead of writing an outbox row the broker would refuse.
ALTER TABLE jobfence.settings
    ADD COLUMN queue_max_message_bytes integer
        CONSTRAINT settings_queue_max_message_bytes_check CHECK (queue_max_message_bytes > 0);
