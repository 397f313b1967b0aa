-- jobfence 0028: a tracestate key without a tenant starts with a letter.
--
-- jobfence.valid_tracestate accepted a simple key that starts with a digit (`1abc=v`, allowed
-- by the draft Level 2 of W3C Trace Context, not by the Recommendation). OpenTelemetry's
-- TraceState.from_header refuses it: it drops the whole tracestate and logs a WARNING quoting
-- the member, a producer's value, on every span of the job. A digit may now start a key only in
-- its multi-tenant form (`1tenant@system`), as jobfence.tracing checks what a worker reads.
-- The same one expression as 0022 (inlined into every insert's column defaults), with that
-- key rule; about 1.5 us more for a value that is set.
CREATE OR REPLACE FUNCTION jobfence.valid_tracestate(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN length(value) BETWEEN 1 AND 512
                     AND array_length(string_to_array(value, ','), 1) <= 32
                     AND CASE WHEN length(value) <= 241
                         THEN value ~ ('^[ \t]*(([a-z][a-z0-9_*/-]*(@[a-z][a-z0-9_*/-]{0,13})?'
                                       '|[0-9][a-z0-9_*/-]*@[a-z][a-z0-9_*/-]{0,13})'
                                       '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)?'
                                       '(,[ \t]*(([a-z][a-z0-9_*/-]*(@[a-z][a-z0-9_*/-]{0,13})?'
                                       '|[0-9][a-z0-9_*/-]*@[a-z][a-z0-9_*/-]{0,13})'
                                       '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)?)*$')
                         ELSE value ~ ('^[ \t]*(([a-z][a-z0-9_*/-]{0,255}'
                                       '|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})'
                                       '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)?'
                                       '(,[ \t]*(([a-z][a-z0-9_*/-]{0,255}'
                                       '|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})'
                                       '=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)?)*$')
                         END
                THEN value END
$$;
