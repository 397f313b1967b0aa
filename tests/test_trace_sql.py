"""The trace context on the SQL side: the column defaults that take it from the session cost an
insert nothing it can avoid (PostgreSQL inlines them), and the SQL checks keep exactly what the
Python checks keep."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobfence import tracing

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def plan_output(conn: psycopg.Connection[Any], table: str, columns: str, values: str) -> str:
    """The expressions the insert's plan computes (its Output lines)."""
    rows = conn.execute(
        f"EXPLAIN (VERBOSE, COSTS OFF) INSERT INTO {table} ({columns}) VALUES ({values})"  # type: ignore[arg-type]
    ).fetchall()
    return "\n".join(str(r[0]) for r in rows if "Output:" in str(r[0]))


@pytest.mark.parametrize(
    ("table", "due"),
    [("jobfence_queue.messages", "run_at"), ("jobfence.outbox", "due_at")],
)
@pytest.mark.parametrize("session_context", [False, True], ids=["no-context", "session-context"])
def test_the_trace_context_defaults_are_inlined_into_every_insert(
    autocommit_conn: psycopg.Connection[Any], table: str, due: str, session_context: bool
) -> None:
    """Every producer path writes its row with the trace columns left to their defaults (the
    session's context). Were a default a call of a jobfence function, PostgreSQL would plan that
    function's body again in every insert: about 150 us of server CPU per enqueue, as much as
    the insert itself. Inlined, the plan holds only built-in expressions."""
    with autocommit_conn.transaction():
        if session_context:
            autocommit_conn.execute("SELECT set_config('jobfence.traceparent', %s, true)", (TP,))
            autocommit_conn.execute("SET LOCAL jobfence.tracestate = 'rojo=00f067aa0ba902b7'")
        plan = plan_output(
            autocommit_conn,
            table,
            f"queue, consumer, job_id, body, {due}",
            "'q', 'c', 'j', '\\x7b7d', now()",
        )
    assert "current_setting('jobfence.traceparent'" in plan  # the defaults are in the plan...
    assert "jobfence." not in plan.replace("'jobfence.", "'"), plan  # ...as no function call


def test_a_session_trace_context_is_written_by_the_inlined_defaults(
    autocommit_conn: psycopg.Connection[Any],
) -> None:
    long_state = ",".join(f"k{i}=" + "v" * 20 for i in range(12))  # over 241 characters
    with autocommit_conn.transaction():
        autocommit_conn.execute("SELECT set_config('jobfence.traceparent', %s, true)", (TP,))
        autocommit_conn.execute("SELECT set_config('jobfence.tracestate', %s, true)", (long_state,))
        autocommit_conn.execute(
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)"
            " VALUES ('q', 'c', 'long', '\\x7b7d')"
        )
        autocommit_conn.execute("SET LOCAL jobfence.tracestate = 'a=1,,b@sys=2 '")
        autocommit_conn.execute(
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)"
            " VALUES ('q', 'c', 'short', '\\x7b7d')"
        )
        autocommit_conn.execute("SET LOCAL jobfence.tracestate = 'a=1,b@sys-too-long-by-far=2'")
        autocommit_conn.execute(
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)"
            " VALUES ('q', 'c', 'bad-state', '\\x7b7d')"
        )
        autocommit_conn.execute("SET LOCAL jobfence.traceparent = ''")
        autocommit_conn.execute(
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)"
            " VALUES ('q', 'c', 'none', '\\x7b7d')"
        )
    rows = autocommit_conn.execute(
        "SELECT job_id, traceparent, tracestate FROM jobfence_queue.messages ORDER BY id"
    ).fetchall()
    assert rows == [
        ("long", TP, long_state),
        ("short", TP, "a=1,,b@sys=2 "),
        ("bad-state", TP, None),  # a system name over 14 characters: the state is dropped
        ("none", None, None),  # no traceparent: no tracestate either
    ]


# Strings near the W3C grammar: keys, multi-tenant keys, values, optional white space, empty
# members, and every length around the limits (256 for a key or a value, 241 + 14 for a tenant
# and its system, 512 in all, 32 members), with a character from outside the grammar now and
# then.
_KEY_CHARS = "abz09_-*/"
_VALUE_CHARS = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in ",=")
_ODD = st.sampled_from(["A", "=", ",", "\t", " ", "@", "é", "\n", "~", "0", "a"])


def _run(chars: str, longest: int) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(alphabet=chars, min_size=0, max_size=8),
        st.integers(min_value=max(0, longest - 3), max_value=longest + 2).map(
            lambda n: (chars * (n // len(chars) + 1))[:n]
        ),
    )


_KEY = st.builds(
    lambda first, rest, tenant: first + rest + tenant,
    st.sampled_from(["a", "z", "0", "9", "_", "A", ""]),
    _run(_KEY_CHARS, 255),
    st.one_of(
        st.just(""),
        st.builds(lambda s: "@" + s, _run("a" + _KEY_CHARS, 14)),
        st.builds(lambda s: "@" + s, st.text(alphabet=_KEY_CHARS + "@", max_size=4)),
    ),
)
_MEMBER = st.one_of(
    st.builds(
        lambda ows1, key, value, ows2: f"{ows1}{key}={value}{ows2}",
        st.sampled_from(["", " ", "\t ", "  "]),
        _KEY,
        _run(_VALUE_CHARS, 256),
        st.sampled_from(["", " ", " \t"]),
    ),
    st.sampled_from(["", " ", "\t"]),
    st.builds(lambda a, b: a + b, st.text(alphabet=_KEY_CHARS + "= ", max_size=6), _ODD),
)
TRACESTATES = st.one_of(
    st.lists(_MEMBER, min_size=1, max_size=34).map(",".join),
    st.text(max_size=40).filter(lambda s: "\x00" not in s),
)
_HEX = "0123456789abcdef"
TRACEPARENTS = st.one_of(
    st.builds(
        lambda version, trace, span, flags: f"{version}-{trace}-{span}-{flags}",
        st.sampled_from(["00", "01", "0", "ff"]),
        st.one_of(st.text(alphabet=_HEX, min_size=31, max_size=33), st.just("0" * 32)),
        st.one_of(st.text(alphabet=_HEX, min_size=15, max_size=17), st.just("0" * 16)),
        st.text(alphabet=_HEX + "G", min_size=1, max_size=3),
    ),
    st.text(max_size=60).filter(lambda s: "\x00" not in s),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    states=st.lists(TRACESTATES, min_size=1, max_size=20),
    parents=st.lists(TRACEPARENTS, max_size=10),
)
def test_the_sql_trace_checks_keep_exactly_what_the_python_checks_keep(
    autocommit_conn: psycopg.Connection[Any], states: list[str], parents: list[str]
) -> None:
    """The SQL checks guard what SQL producers write; the Python checks what every worker
    reads. They must agree, value for value, over values near and across every limit."""
    kept_states = autocommit_conn.execute(
        "SELECT jobfence.valid_tracestate(v) FROM unnest(%s::text[]) WITH ORDINALITY AS u(v, i)"
        " ORDER BY i",
        (states,),
    ).fetchall()
    assert [r[0] for r in kept_states] == [tracing.valid_tracestate(s) for s in states]
    kept_parents = autocommit_conn.execute(
        "SELECT jobfence.valid_traceparent(v) FROM unnest(%s::text[]) WITH ORDINALITY AS u(v, i)"
        " ORDER BY i",
        (parents,),
    ).fetchall()
    assert [r[0] for r in kept_parents] == [tracing.valid_traceparent(p) for p in parents]
