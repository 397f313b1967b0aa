"""The AMQP 0-9-1 frames jobfence writes and reads itself, around pamqp.

**Reading** (:func:`tolerant_headers`): RabbitMQ passes on a content header that pamqp cannot
decode (a header name or a short-string property such as ``message-id`` that is not UTF-8, a
timestamp of 2^64-1); pamqp's error stops aiormq's reader, which kills the whole connection at
every delivery of that message. On a connection opened under :func:`tolerant_headers`, such a
header is read as an :class:`UnreadableHeader` instead: the body size (so the message is still
delivered, its body whole), no properties, and what could not be read (never a value). The
same holds for the ``basic.deliver`` (``basic.get-ok``, ``basic.return``) before it: a message
routed from another exchange bound to the queue can carry a routing key or an exchange name
that is not UTF-8 (RabbitMQ routes bytes); on these connections such a name is read with U+FFFD
in place of the bytes that are not UTF-8, and the message is delivered as any other (jobfence
reads neither name: a delivery's queue is its consumer's).

**Writing**: the frames of one ``basic.publish``, as pamqp marshals them, made faster for the
outbox relay's batches: pamqp encodes each property and header through a generic dispatch,
which was about 40% of the relay's CPU per message on RabbitMQ. These functions write the same bytes
(``tests/test_amqp_frames.py`` compares them with pamqp's for any message) for the one shape
jobfence publishes: a ``headers`` table of text and integers, ``delivery_mode``, and the
optional ``correlation_id`` and ``message_id``. The ``basic.publish`` method frame itself is
marshalled by pamqp, once per queue.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar

import pamqp.frame
from pamqp import base, commands, decode, encode
from pamqp.exceptions import UnmarshalingException
from pamqp.header import ContentHeader

_FRAME = struct.Struct(">BHI")  # type, channel, payload size
_CONTENT_HEADER = struct.Struct(">HHQH")  # class 60, weight 0, body size, property flags
_LONG = struct.Struct(">I")
_FRAME_END = b"\xce"
_HEADER_FRAME = 2
_BODY_FRAME = 3
_BASIC = 60
# Basic.Properties' flags (AMQP 0-9-1), of the properties jobfence sets.
_HEADERS = 0x2000
_DELIVERY_MODE = 0x1000
_CORRELATION_ID = 0x0400
_MESSAGE_ID = 0x0080


def _short_string(text: str) -> bytes:
    data = text.encode()
    if len(data) > 255:
        raise ValueError(f"an AMQP short string holds at most 255 bytes, got {len(data)}")
    return bytes((len(data),)) + data


def _table(headers: Mapping[str, str | int]) -> bytes:
    """A field table as pamqp writes it: keys sorted, text as long strings (``S``), integers
    in the smallest type that holds them."""
    parts: list[bytes] = []
    for key, value in sorted(headers.items()):
        parts.append(_short_string(key))
        if isinstance(value, str):
            data = value.encode()
            parts += (b"S", _LONG.pack(len(data)), data)
        elif isinstance(value, int) and not isinstance(value, bool):
            parts.append(encode.table_integer(value))
        else:
            raise TypeError(f"header {key}: text or an integer, got {type(value).__name__}")
    table = b"".join(parts)
    return _LONG.pack(len(table)) + table


def content_frames(
    channel: int,
    max_content: int,
    body: bytes,
    *,
    headers: Mapping[str, str | int],
    delivery_mode: int,
    correlation_id: str | None,
    message_id: str | None,
) -> bytes:
    """The content header frame and the body frames (of at most ``max_content`` bytes each)
    of a message on ``channel``. An empty ``correlation_id`` or ``message_id`` is left out, as
    pamqp leaves it out."""
    flags = _HEADERS | _DELIVERY_MODE
    properties = [_table(headers), bytes((delivery_mode,))]
    if correlation_id:
        flags |= _CORRELATION_ID
        properties.append(_short_string(correlation_id))
    if message_id:
        flags |= _MESSAGE_ID
        properties.append(_short_string(message_id))
    header = _CONTENT_HEADER.pack(_BASIC, 0, len(body), flags) + b"".join(properties)
    parts = [_FRAME.pack(_HEADER_FRAME, channel, len(header)), header, _FRAME_END]
    for start in range(0, len(body), max_content):
        chunk = body[start : start + max_content]
        parts += (_FRAME.pack(_BODY_FRAME, channel, len(chunk)), chunk, _FRAME_END)
    return b"".join(parts)


# -- reading ------------------------------------------------------------------------------

# Set while a connection is opened: the reader task it starts copies the context, so only the
# connections jobfence opens read frames tolerantly (any other pamqp user is unchanged).
_TOLERANT: ContextVar[bool] = ContextVar("jobfence_tolerant_amqp_frames", default=False)
_HEADER_START = struct.Struct(">HHQ")  # class, weight, body size
_UNDECODABLE = (UnmarshalingException, ValueError, OverflowError, OSError, struct.error)


class UnreadableHeader(ContentHeader):
    """A content header whose properties pamqp cannot decode: the message's body size, no
    properties, and ``unreadable``, what could not be read."""

    def __init__(self, weight: int, body_size: int, unreadable: str) -> None:
        super().__init__(weight, body_size)
        self.class_id = commands.Basic.frame_id  # type: ignore[assignment]  # pamqp: None
        self.unreadable = unreadable


def _header_value(data: bytes) -> tuple[int, str | None]:
    """The bytes of one field-table value at the start of ``data``, or what is wrong with it."""
    kind = data[:1]
    try:
        used, _ = decode.embedded_value(data)
    except _UNDECODABLE as exc:
        if kind not in decode.TABLE_MAPPING:
            return 0, "a header value is of a type AMQP 0-9-1 does not define"
        if kind == b"T":
            return 0, "a header value is a timestamp out of range"
        if isinstance(exc, UnicodeDecodeError):
            return 0, "a header value holds text that is not valid UTF-8"
        return 0, "a header value cannot be decoded"
    return used, None


def _table_problem(data: bytes) -> str:
    """What in the field table at the start of ``data`` pamqp cannot decode."""
    try:
        (size,) = struct.unpack_from(">I", data)
        table = data[4 : 4 + size]
        while table:
            length = table[0]
            try:
                table[1 : 1 + length].decode()
            except UnicodeDecodeError:
                return "a header name is not valid UTF-8"
            used, problem = _header_value(table[1 + length :])
            if problem is not None:
                return problem
            if used == 0:
                break
            table = table[1 + length + used :]
    except _UNDECODABLE:
        pass
    return "the table cannot be decoded"


def _what_cannot_be_read(frame_data: bytes) -> str:
    """Which property of a content header pamqp cannot decode (its name, never its value)."""
    flags, offset = 0, 12
    try:
        for word in range(16):  # a set lowest bit says another flags word follows
            (part,) = struct.unpack_from(">H", frame_data, offset)
            flags |= part << (16 * word)
            offset += 2
            if not part & 1:
                break
        data = frame_data[offset:]
        properties = commands.Basic.Properties
        for name in properties.__slots__:
            if not flags & properties.flags[name]:
                continue
            shown = name.replace("_", "-")
            kind = getattr(properties, "_" + name)
            try:
                used, _ = decode.by_type(data, kind)
            except _UNDECODABLE as exc:
                if kind == "table":
                    return f"property {shown}: {_table_problem(data)}"
                if kind == "timestamp":
                    return f"property {shown} is out of range"
                if isinstance(exc, UnicodeDecodeError):
                    return f"property {shown} is not valid UTF-8"
                return f"property {shown} cannot be decoded"
            data = data[used:]
    except _UNDECODABLE:
        pass
    return "the property flags cannot be decoded"


def _tolerant(
    unmarshal: Callable[[bytes], ContentHeader],
) -> Callable[[bytes], ContentHeader]:
    def unmarshal_header_frame(frame_data: bytes) -> ContentHeader:
        try:
            return unmarshal(frame_data)
        except _UNDECODABLE:
            if not _TOLERANT.get() or len(frame_data) < _HEADER_START.size + 2:
                raise  # not one of jobfence's connections, or not even a body size
            _, weight, body_size = _HEADER_START.unpack_from(frame_data)
            reason = (
                f"its AMQP content header cannot be decoded ({_what_cannot_be_read(frame_data)}):"
                " its properties and headers were dropped"
            )
            return UnreadableHeader(weight, body_size, reason)

    unmarshal_header_frame.jobfence_tolerant = True  # type: ignore[attr-defined]
    return unmarshal_header_frame


# The methods that carry a message: their exchange and routing key are what its producer
# chose, and RabbitMQ routes any bytes (a topic exchange bound with ``#``); Basic.Return's reply
# text may quote them.
_MESSAGE_METHODS = frozenset(
    method.index for method in (commands.Basic.Deliver, commands.Basic.GetOk, commands.Basic.Return)
)
_METHOD_INDEX = struct.Struct(">I")
_BYTE = struct.Struct(">B")


def _short_str_replaced(data: bytes) -> tuple[int, str]:
    """``decode.short_str``, with what is not UTF-8 read as U+FFFD (never the bytes)."""
    (length,) = _BYTE.unpack_from(data)
    return length + 1, data[1 : length + 1].decode("utf-8", errors="replace")


def _message_method(frame_data: bytes) -> base.Frame:
    """A ``basic.deliver``, ``basic.get-ok`` or ``basic.return`` decoded as pamqp's
    ``Frame.unmarshal`` decodes it, its short strings that are not UTF-8 read with U+FFFD in
    place of what cannot be decoded."""
    (index,) = _METHOD_INDEX.unpack_from(frame_data)
    method: base.Frame = commands.INDEX_MAPPING[index]()
    data, bit, in_bits = frame_data[_METHOD_INDEX.size :], 0, False
    for argument in method.__slots__:
        kind = method.amqp_type(argument)
        if in_bits and (kind != "bit" or bit == 8):
            data, bit, in_bits = data[1:], 0, False
        value: object
        if kind == "bit":
            _, value = decode.bit(data, bit)
            bit, in_bits, used = bit + 1, True, 0
        elif kind == "shortstr":
            used, value = _short_str_replaced(data)
        else:
            used, value = decode.by_type(data, kind)
        setattr(method, argument, value)
        data = data[used:]
    return method


def _tolerant_method(
    unmarshal: Callable[[bytes], base.Frame],
) -> Callable[[bytes], base.Frame]:
    def unmarshal_method_frame(frame_data: bytes) -> base.Frame:
        try:
            return unmarshal(frame_data)
        except UnmarshalingException as exc:
            if (
                not _TOLERANT.get()  # not one of jobfence's connections
                or not isinstance(exc.__cause__, UnicodeDecodeError)
                or _METHOD_INDEX.unpack_from(frame_data)[0] not in _MESSAGE_METHODS
            ):
                raise
            try:
                return _message_method(frame_data)
            except _UNDECODABLE:
                pass  # something else in it cannot be decoded either: pamqp's error stands
            raise

    unmarshal_method_frame.jobfence_tolerant = True  # type: ignore[attr-defined]
    return unmarshal_method_frame


@contextlib.contextmanager
def tolerant_headers() -> Iterator[None]:
    """Open a connection inside this block (``aio_pika.connect``) and its reader reads a
    content header pamqp cannot decode as an :class:`UnreadableHeader`, and a message's
    ``basic.deliver``, ``basic.get-ok`` or ``basic.return`` whose exchange or routing key is
    not UTF-8 with U+FFFD in place of the undecodable bytes, instead of dying. pamqp's
    ``frame._unmarshal_header_frame`` and ``frame._unmarshal_method_frame`` are wrapped once
    (aiormq calls ``pamqp.frame.unmarshal``, which looks them up at each frame); outside these
    connections the wrappers call them and raise as before."""
    current = pamqp.frame._unmarshal_header_frame
    if not getattr(current, "jobfence_tolerant", False):
        setattr(pamqp.frame, "_unmarshal_header_frame", _tolerant(current))  # noqa: B010
    method = pamqp.frame._unmarshal_method_frame
    if not getattr(method, "jobfence_tolerant", False):
        setattr(pamqp.frame, "_unmarshal_method_frame", _tolerant_method(method))  # noqa: B010
    token = _TOLERANT.set(True)
    try:
        yield
    finally:
        _TOLERANT.reset(token)
