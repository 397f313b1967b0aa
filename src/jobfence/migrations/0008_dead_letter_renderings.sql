-- jobfence 0008: each dead letter's immutable fields, rendered once as the API's JSON.
--
-- A 500-row list page used to render every field of every row on every request: about 5.5 us
-- of PostgreSQL CPU per row (jsonb to text, to_json, to_char), 2.8 ms per page, which 32
-- concurrent clients on two cores queue behind. The fields D5 makes immutable are now rendered
-- once, when the dead letter is inserted, into jobfence.dead_letter_renderings; a list page
-- joins them and renders only the fields that can change (status, discard_reason,
-- resolved_at, resolved_by) at read time, so a rendering can never be stale.
--
-- The rendering follows jobfence.api.schemas.DeadLetterItemOut (the tests hold the two to each
-- other): compact JSON, strings through to_json, the payload as jsonb's own text when it is at
-- most 4096 bytes (jobfence.ops.PAYLOAD_INLINE_LIMIT), else null with its first 512 characters
-- (PAYLOAD_SUMMARY_CHARS) as the summary; timestamps in UTC with "Z", microseconds only when
-- there are any. Changing any of these means a migration that renders every row again.
--
-- Applying this to an existing table renders every dead letter (about 20 s per million rows
-- on two cores); new dead letters wait for it (the trigger is created first).

CREATE FUNCTION jobfence.render_timestamp(ts timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT to_json(to_char(ts AT TIME ZONE 'UTC',
                           CASE WHEN date_trunc('second', ts) = ts
                                THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"'
                                ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END))::text
$$;

-- The item from its first field up to correlation_id, without the closing brace.
CREATE FUNCTION jobfence.render_dead_letter_head(d core.dead_letters) RETURNS text
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
    payload_text text := d.payload::text;
    payload_size integer := octet_length(payload_text);
BEGIN
    RETURN '{"id":' || d.id
        || ',"job_id":' || to_json(d.job_id)
        || ',"queue":' || to_json(d.queue)
        || ',"consumer":' || to_json(d.consumer)
        || ',"tenant_id":' || coalesce(to_json(d.tenant_id)::text, 'null')
        || ',"payload":' || CASE WHEN payload_size <= 4096 THEN payload_text ELSE 'null' END
        || ',"payload_encoding":' || to_json(d.payload_encoding)
        || ',"payload_truncated":' || (payload_size > 4096)
        || ',"payload_summary":' || CASE WHEN payload_size > 4096
                                         THEN to_json(left(payload_text, 512))::text
                                         ELSE 'null' END
        || ',"payload_size":' || payload_size
        || ',"attempts":' || d.attempts
        || ',"last_error":' || to_json(d.last_error)
        || ',"error_class":' || to_json(d.error_class)
        || ',"correlation_id":' || coalesce(to_json(d.correlation_id)::text, 'null');
END;
$$;

-- No foreign key: a dead letter is never deleted (D5), and a key would answer a TRUNCATE of
-- core.dead_letters before the D5 guard does, with a message about this table instead.
CREATE TABLE jobfence.dead_letter_renderings (
    dead_letter_id  bigint PRIMARY KEY,
    head            text   NOT NULL,
    created_at_json text   NOT NULL
);

-- SECURITY DEFINER: a role that may insert dead letters needs no grant on the renderings (the
-- API's role reads them: docs/operations.md, "Database roles").
CREATE FUNCTION jobfence.render_new_dead_letters() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO jobfence.dead_letter_renderings (dead_letter_id, head, created_at_json)
    SELECT n.id, jobfence.render_dead_letter_head(n), jobfence.render_timestamp(n.created_at)
    FROM new_rows n;
    RETURN NULL;
END;
$$;

CREATE TRIGGER dead_letters_render
    AFTER INSERT ON core.dead_letters
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION jobfence.render_new_dead_letters();

INSERT INTO jobfence.dead_letter_renderings (dead_letter_id, head, created_at_json)
SELECT d.id, jobfence.render_dead_letter_head(d), jobfence.render_timestamp(d.created_at)
FROM core.dead_letters d;
