-- jobfence 0010: a dead letter may keep its whole message (payload_encoding 'message').
--
-- A delivery whose identifiers cannot be fenced or stored as they are (over jobfence.limits, a
-- NUL character, a lone surrogate: error_class 'UnfenceableMessage'), or a job whose handling
-- failed inside jobfence on delivery after delivery (error_class 'InternalFailure'), is
-- dead-lettered with every identifier and the body kept losslessly in the payload:
-- {"encoding": "message", "note": ..., "message": {"queue": base64, "consumer": base64,
-- "job_id": base64, "tenant_id": base64 | null, "correlation_id": base64 | null},
-- "data": base64 of the body}. The identifier columns then hold bounded stand-ins (the first
-- characters, the size and a SHA-256 prefix) that every index can hold.
--
-- Applying it checks every existing dead letter once (one sequential scan, under the table's
-- lock: new dead letters wait for it).
ALTER TABLE core.dead_letters
    DROP CONSTRAINT dead_letters_payload_encoding_valid,
    ADD CONSTRAINT dead_letters_payload_encoding_valid
        CHECK (payload_encoding IN ('json', 'base64', 'message'));
