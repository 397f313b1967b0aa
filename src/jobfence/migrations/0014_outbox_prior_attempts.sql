-- jobfence 0014: an outbox row carries the deliveries its job already had.
--
-- On a broker without native delayed delivery (RabbitMQ, Redis Streams) the worker writes a
-- retry with a delay to the outbox: prior_attempts is the deliveries made so far, so the copy
-- the relay publishes is delivered with attempt prior_attempts + 1 and the retry policy (D1)
-- counts on. 0 for everything producers and replays write (a first delivery).
ALTER TABLE jobfence.outbox
    ADD COLUMN prior_attempts integer NOT NULL DEFAULT 0
        CONSTRAINT outbox_prior_attempts_check CHECK (prior_attempts >= 0);
