"""Publish AMQP 0-9-1 messages whose frames are written byte by byte, as a producer in another
language (or a hostile one) may write them: RabbitMQ passes on content headers and routing keys
that a Python client (pamqp) cannot decode."""

from __future__ import annotations

import struct

import aiormq
from aiormq.abc import ChannelFrame

_FRAME = struct.Struct(">BHI")  # type, channel, payload size
_FRAME_END = b"\xce"
_BASIC = 60
_PUBLISH = 40
# Basic.Properties' flags (AMQP 0-9-1).
_HEADERS = 0x2000
_DELIVERY_MODE = 0x1000
_MESSAGE_ID = 0x0080
_TIMESTAMP = 0x0040


def short_string(data: bytes) -> bytes:
    return bytes((len(data),)) + data


def long_string(data: bytes) -> bytes:
    """A header value of type ``S``."""
    return b"S" + struct.pack(">I", len(data)) + data


def timestamp(seconds: int) -> bytes:
    """A header value of type ``T`` (any 64-bit value, as the wire allows)."""
    return b"T" + struct.pack(">Q", seconds)


def table(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A field table of (key, typed value) pairs, the key written as given."""
    data = b"".join(short_string(key) + value for key, value in entries)
    return struct.pack(">I", len(data)) + data


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return _FRAME.pack(kind, channel, len(payload)) + payload + _FRAME_END


async def publish_raw(
    url: str,
    body: bytes,
    *,
    routing_key: bytes,
    exchange: bytes = b"",
    headers: bytes | None = None,
    message_id: bytes | None = None,
    timestamp_property: int | None = None,
) -> None:
    """Publish one persistent message, every field written as given (``headers`` a
    :func:`table`), and wait for the broker's publisher confirm."""
    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        flags = _DELIVERY_MODE
        properties = b""
        if headers is not None:
            flags |= _HEADERS
            properties += headers
        properties += bytes((2,))  # delivery mode: persistent
        if message_id is not None:
            flags |= _MESSAGE_ID
            properties += short_string(message_id)
        if timestamp_property is not None:
            flags |= _TIMESTAMP
            properties += struct.pack(">Q", timestamp_property)
        publish = (
            struct.pack(">HHH", _BASIC, _PUBLISH, 0)  # class, method, reserved
            + short_string(exchange)
            + short_string(routing_key)
            + b"\x00"  # neither mandatory nor immediate
        )
        header = struct.pack(">HHQH", _BASIC, 0, len(body), flags) + properties
        frames = (
            _frame(1, channel.number, publish)
            + _frame(2, channel.number, header)
            + _frame(3, channel.number, body)
        )
        async with channel.lock:  # as aiormq's basic_publish takes a tag and its confirm
            channel.delivery_tag += 1
            confirmed = channel.create_future()
            channel.confirmations[channel.delivery_tag] = confirmed
            await channel.write_queue.put(ChannelFrame(payload=frames, should_close=False))
        assert isinstance(await confirmed, aiormq.spec.Basic.Ack)
    finally:
        await connection.close()
