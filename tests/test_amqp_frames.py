"""The RabbitMQ adapter writes a message's content frames itself: byte for byte what pamqp (and
so aiormq's ``basic_publish``) writes for the same message, for any message jobfence sends."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands
from pamqp.body import ContentBody
from pamqp.frame import marshal
from pamqp.header import ContentHeader

from jobfence.adapters._amqp import content_frames

_text = st.text(max_size=40)
_short = st.one_of(st.none(), st.text(max_size=60).filter(lambda t: len(t.encode()) <= 255))
_headers = st.dictionaries(
    st.text(min_size=1, max_size=30).filter(lambda t: len(t.encode()) <= 128),
    st.one_of(_text, st.integers(min_value=-(2**63), max_value=2**63 - 1)),
    min_size=1,
    max_size=8,
)


def _pamqp(
    *,
    channel: int,
    max_content: int,
    body: bytes,
    headers: dict[str, str | int],
    correlation_id: str | None,
    message_id: str | None,
) -> bytes:
    properties = commands.Basic.Properties(
        headers=headers,  # type: ignore[arg-type]
        message_id=message_id,
        correlation_id=correlation_id,
        delivery_mode=2,
    )
    frames = [marshal(ContentHeader(properties=properties, body_size=len(body)), channel)]
    for start in range(0, len(body), max_content):
        frames.append(marshal(ContentBody(body[start : start + max_content]), channel))
    return b"".join(frames)


_messages = st.fixed_dictionaries(
    {
        "channel": st.integers(min_value=1, max_value=65535),
        "max_content": st.integers(min_value=1, max_value=64),
        "body": st.binary(max_size=300),
        "headers": _headers,
        "correlation_id": _short,
        "message_id": _short,
    }
)


@given(_messages)
def test_the_content_frames_are_the_bytes_pamqp_writes_for_any_message(
    case: dict[str, Any],
) -> None:
    """Headers of text (any Unicode) and integers of every size, ids absent, empty or up to
    255 bytes, bodies empty or split over several frames: the same bytes as pamqp's."""
    ours = content_frames(
        case["channel"],
        case["max_content"],
        case["body"],
        headers=case["headers"],
        delivery_mode=2,
        correlation_id=case["correlation_id"],
        message_id=case["message_id"],
    )
    assert ours == _pamqp(**case)


def test_an_id_over_255_bytes_or_a_header_of_another_type_is_refused() -> None:
    """What AMQP cannot carry is an error before anything is written (the adapter refuses
    that message alone): an id over 255 bytes, a header value that is neither text nor an
    integer."""
    with pytest.raises(ValueError, match="at most 255 bytes, got 256"):
        content_frames(
            1,
            100,
            b"{}",
            headers={"a": "b"},
            delivery_mode=2,
            correlation_id=None,
            message_id="x" * 256,
        )
    with pytest.raises(TypeError, match="header a: text or an integer, got bool"):
        content_frames(
            1,
            100,
            b"{}",
            headers={"a": True},
            delivery_mode=2,
            correlation_id=None,  # type: ignore[dict-item]
            message_id=None,
        )
