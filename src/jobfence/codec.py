"""Turning a message body into a payload, and keeping bodies that are not JSON intact (D6)."""

from __future__ import annotations

import base64
import functools
import json
import re
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from jobfence.errors import PoisonMessage
from jobfence.limits import (
    MAX_CORRELATION_ID_BYTES,
    MAX_JOB_ID_BYTES,
    MAX_NAME_CHARS,
    MAX_TENANT_ID_BYTES,
    identifiers_problem,
    storable,
    storable_text,
)
from jobfence.model import Message
from jobfence.redact import printable

PAYLOAD_JSON = "json"
PAYLOAD_BASE64 = "base64"
# The whole message, identifiers included, kept as base64 of their UTF-8 bytes: for a dead
# letter whose identifiers could not be stored as they were (an ``UnfenceableMessage``) or that
# was written by the fallback of a job failing inside jobfence (``InternalFailure``).
PAYLOAD_MESSAGE = "message"
MESSAGE_FIELDS = ("queue", "consumer", "job_id", "tenant_id", "correlation_id")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _UnstorableNumber(ValueError):
    pass


# PostgreSQL's numeric, which jsonb stores numbers as: at most 131,072 digits before the
# decimal point and 16,383 after it ("value overflows numeric format" beyond).
_NUMERIC_MAX_WHOLE_DIGITS = 131_072
_NUMERIC_MAX_SCALE = 16_383


def _storable_float(text: str) -> float:
    """A JSON number with a fraction or an exponent, as Python reads it, when jsonb can hold it
    too; a short plain one (nearly all of them) is not looked at."""
    if len(text) > 24 or "e" in text or "E" in text:
        mantissa, _, exponent = text.lower().partition("e")
        whole, _, fraction = mantissa.lstrip("-").partition(".")
        power = int(exponent or 0)
        if (
            len(whole) + power > _NUMERIC_MAX_WHOLE_DIGITS
            or len(fraction) - power > _NUMERIC_MAX_SCALE
        ):
            raise _UnstorableNumber
    return float(text)


# One decoder for every body (json.loads with an option builds a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_storable_float)


def _unstorable_reason(value: object) -> str | None:
    """Why PostgreSQL's jsonb could not hold ``value`` (NUL characters, lone surrogates)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return "payload contains \\u0000, which PostgreSQL text and jsonb cannot hold"
            if any(0xD800 <= ord(ch) <= 0xDFFF for ch in item):
                return "payload contains a lone UTF-16 surrogate escape, which is not valid Unicode"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def payload_problem(body: bytes) -> str | None:
    """Why PostgreSQL could not store ``body``, a JSON document this library encoded (valid
    JSON, valid UTF-8); None when it can. Cheap when the body has no escape sequence."""
    if b"\\u" not in body:  # escapes are the only way NULs and lone surrogates get in
        return None
    return _unstorable_reason(_DECODER.decode(body.decode("utf-8")))


def decode_body(body: bytes) -> Any:
    """Parse a body as UTF-8 JSON that PostgreSQL can store, or raise :class:`PoisonMessage`."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PoisonMessage(
            f"payload is not valid UTF-8 ({exc.reason} at byte {exc.start})",
            error_class="InvalidUtf8",
        ) from None
    try:
        value = _DECODER.decode(text)
    except _UnstorableNumber:
        raise PoisonMessage(
            "payload holds a number beyond what PostgreSQL's jsonb can hold (131,072 digits"
            " before the decimal point, 16,383 after it)",
            error_class="UnstorablePayload",
        ) from None
    except (ValueError, RecursionError) as exc:  # RecursionError: nested ~1000 levels deep
        raise PoisonMessage(
            f"payload is not valid JSON: {exc}", error_class="InvalidJson"
        ) from None
    if "\\u" in text:  # escapes are the only way NULs and lone surrogates get in
        reason = _unstorable_reason(value)
        if reason is not None:
            raise PoisonMessage(reason, error_class="UnstorablePayload")
    return value


def stored_payload(body: bytes) -> tuple[str, str]:
    """The ``(jsonb text, payload_encoding)`` that stores ``body`` in a dead letter losslessly.

    A body that is storable JSON is kept as that JSON document; any other body is wrapped as
    ``{"encoding": "base64", "data": ..., "note": ...}`` with ``payload_encoding = 'base64'``.
    """
    try:
        decode_body(body)
    except PoisonMessage as exc:
        wrapper = {
            "encoding": PAYLOAD_BASE64,
            "data": base64.b64encode(body).decode("ascii"),
            "note": f"original bytes kept as base64: {exc.reason}",
        }
        return json.dumps(wrapper), PAYLOAD_BASE64
    return body.decode("utf-8"), PAYLOAD_JSON


def _b64(value: str | bytes | None) -> str | None:
    if value is None:
        return None
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    return base64.b64encode(raw).decode("ascii")


def message_payload(message: Message, note: str) -> tuple[str, str]:
    """The ``(jsonb text, payload_encoding)`` that keeps a whole message losslessly: its
    identifiers (whatever they hold) and its body, each as base64 of its bytes, with ``note``
    saying why. The inverse is :func:`original_message`."""
    wrapper = {
        "encoding": PAYLOAD_MESSAGE,
        "note": note,
        "message": {field: _b64(getattr(message, field)) for field in MESSAGE_FIELDS},
        "data": _b64(message.body),
    }
    return json.dumps(wrapper), PAYLOAD_MESSAGE


def identifier_problem(message: Message) -> str | None:
    """The first of ``message``'s identifiers that breaks a limit, and why
    (:func:`jobfence.limits.identifiers_problem`); None when they all fit."""
    found = identifiers_problem(
        queue=message.queue,
        consumer=message.consumer,
        job_id=message.job_id,
        tenant_id=message.tenant_id,
        correlation_id=message.correlation_id,
    )
    return None if found is None else found[1]


def unfenceable(message: Message) -> str | None:
    """Why ``message`` can never be fenced or stored, its identifiers breaking a limit (the
    reason of an ``UnfenceableMessage`` dead letter); None when it can."""
    problem = identifier_problem(message)
    if problem is None:
        return None
    return f"the message cannot be fenced or stored as it is: {problem}"


def kept_whole(message: Message, note: str) -> tuple[Message, str, str]:
    """A dead letter that keeps ``message`` whole: its identifiers as a dead letter can store
    them (each one that cannot be stored as it is replaced by its bounded stand-in,
    :func:`jobfence.limits.bounded`), and the ``(jsonb text, payload_encoding)`` of
    :func:`message_payload`, ``note`` saying why."""
    payload, encoding = message_payload(message, storable_text(note))
    ids = replace(
        message,
        job_id=storable(message.job_id, MAX_JOB_ID_BYTES, required=True) or "",
        queue=storable(message.queue, MAX_NAME_CHARS, required=True) or "",
        consumer=storable(message.consumer, MAX_NAME_CHARS, required=True) or "",
        tenant_id=storable(message.tenant_id, MAX_TENANT_ID_BYTES),
        correlation_id=storable(message.correlation_id, MAX_CORRELATION_ID_BYTES),
    )
    return ids, payload, encoding


class MalformedPayload(ValueError):
    """A stored payload is not the shape its ``payload_encoding`` says (a dead letter written
    by hand): no message can be made of it."""


def _decoded(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedPayload(f"{what} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:  # binascii.Error
        raise MalformedPayload(f"{what} is not valid base64") from None


def _wrapper(payload_text: str, encoding: str) -> dict[str, Any]:
    wrapper = json.loads(payload_text)
    if not isinstance(wrapper, dict):
        raise MalformedPayload(
            f"a {encoding!r} payload is a JSON object, not {type(wrapper).__name__}"
        )
    return wrapper


def original_message(payload_text: str) -> Message:
    """The message kept by :func:`message_payload`, identifiers and bytes as they were;
    :class:`MalformedPayload` when the payload is not that shape."""
    wrapper = _wrapper(payload_text, PAYLOAD_MESSAGE)
    kept = wrapper.get("message")
    if not isinstance(kept, dict):
        raise MalformedPayload("a 'message' payload has no \"message\" object")

    def field(name: str) -> str | None:
        value = kept.get(name)
        if value is None:
            return None
        return _decoded(value, f"its {name}").decode("utf-8", "surrogatepass")

    try:
        return Message(
            queue=field("queue") or "",
            consumer=field("consumer") or "",
            job_id=field("job_id") or "",
            body=_decoded(wrapper.get("data"), "its data"),
            tenant_id=field("tenant_id"),
            correlation_id=field("correlation_id"),
        )
    except UnicodeDecodeError:
        raise MalformedPayload("an identifier is not UTF-8") from None


def original_body(payload_text: str, encoding: str) -> bytes:
    """The bytes to republish for a stored dead-letter payload (inverse of :func:`stored_payload`).

    ``payload_text`` is the jsonb column as text. A base64 payload gives back the exact original
    bytes; a JSON payload gives back the same JSON document (jsonb keeps neither whitespace nor
    key order, so the bytes may differ while the document is equal).
    """
    if encoding in (PAYLOAD_BASE64, PAYLOAD_MESSAGE):
        return _decoded(_wrapper(payload_text, encoding).get("data"), "its data")
    if encoding == PAYLOAD_JSON:
        return payload_text.encode("utf-8")
    raise ValueError(f"unknown payload encoding {encoding!r}")


def encode_payload(payload: Any) -> bytes:
    """Serialise an application payload (a pydantic model or JSON-able value) to a body.

    A model's field may hold a value its type does not describe (given after validation):
    pydantic would warn on stderr quoting that value, a payload value, so it is told not to.
    ``App.message`` validates the body instead, as the worker will."""
    dump = getattr(payload, "model_dump_json", None)
    if callable(dump):
        return str(dump(warnings=False)).encode("utf-8")
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# The placeholders of pydantic's error messages that come from the schema (a bound, a pattern,
# the expected values), never from the input; any other one ({error}, {tag}, {attribute}...)
# may quote the value that failed. An ``{error}`` of these types is a parser's own description
# ("input is too short"), not the value.
_SCHEMA_PLACEHOLDERS = frozenset(
    [
        "class_name",
        "gt",
        "ge",
        "lt",
        "le",
        "multiple_of",
        "field_type",
        "min_length",
        "max_length",
        "expected_plural",
        "actual_length",
        "pattern",
        "expected",
        "encoding",
        "discriminator",
        "expected_tags",
        "expected_schemes",
        "expected_version",
        "max_digits",
        "decimal_places",
        "whole_digits",
        "class",
        "method_name",
        "tz_expected",
    ]
)
_PARSER_ERRORS = frozenset(
    [
        "date_parsing",
        "date_from_datetime_parsing",
        "time_parsing",
        "datetime_parsing",
        "datetime_from_date_parsing",
        "time_delta_parsing",
        "url_parsing",
        "url_syntax_violation",
        "uuid_parsing",
        "json_invalid",
    ]
)
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_ELIDED = "…"
MAX_SHOWN_ERRORS = 10
_templates: dict[str, str] = {}


def _template(error_type: str) -> str | None:
    """pydantic's message template of a built-in error type; None for a custom one."""
    if not _templates:
        from pydantic_core import _pydantic_core

        for info in _pydantic_core.list_all_errors():
            _templates[info["type"]] = info["message_template_python"]
    return _templates.get(error_type)


# Stands for a part of an error's location that is not a name the schema declares: a key of a
# mapping in the payload (``dict[str, int]``, an unknown key under ``extra="forbid"``) is the
# payload's own value, and may be an account or card number.
KEY_SHOWN = "<key>"
_DECLARED_FIELDS = ("model-fields", "typed-dict")


@functools.cache
def declared_names(schema: type[BaseModel]) -> frozenset[str]:
    """Every field name, alias and model name ``schema`` declares, its nested models and typed
    dicts included: the parts of an error's location that come from the schema, not from the
    payload."""
    names: set[str] = set()
    stack: list[Any] = [schema.__pydantic_core_schema__]
    while stack:
        node = stack.pop()
        if isinstance(node, list | tuple):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind in _DECLARED_FIELDS and isinstance(node.get("fields"), dict):
            names.update(node["fields"])
        elif kind == "dataclass-args":
            names.update(f["name"] for f in node.get("fields", ()) if isinstance(f, dict))
        alias = node.get("validation_alias")
        for part in alias if isinstance(alias, list) else [alias]:
            for piece in part if isinstance(part, list) else [part]:
                if isinstance(piece, str):
                    names.add(piece)
        if isinstance(node.get("model_name"), str):
            names.add(node["model_name"])
        stack.extend(value for value in node.values() if isinstance(value, dict | list))
    return frozenset(names)


def _loc_part(part: object, declared: frozenset[str] | None) -> str:
    """A part of an error's location as shown: an index, pydantic's ``[key]`` marker, or a
    name ``declared`` by the schema (without a schema: a name that is an identifier); any
    other part is a value of the payload, shown as ``<key>``."""
    if isinstance(part, int) or part == "[key]":
        return str(part)
    text = str(part)
    if (text not in declared) if declared is not None else not text.isidentifier():
        return KEY_SHOWN
    text = printable(text)
    return text if len(text) <= 64 else text[:61] + "..."


def _message(error: ErrorDetails) -> str:
    """An error's message without the input: pydantic's own when every placeholder of its
    template comes from the schema, else the template with the others elided."""
    error_type = error["type"]
    template = _template(error_type)
    if template is None:  # a PydanticCustomError: its text is the schema author's
        return _ELIDED
    names = set(_PLACEHOLDER.findall(template))
    safe = _SCHEMA_PLACEHOLDERS | ({"error"} if error_type in _PARSER_ERRORS else set())
    if names <= safe:
        return printable(error["msg"])
    ctx = error.get("ctx") or {}

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        return printable(str(ctx.get(name, _ELIDED))) if name in safe else _ELIDED

    return _PLACEHOLDER.sub(fill, template)


def describe_validation_error(exc: ValidationError, schema: type[BaseModel] | None = None) -> str:
    """A pydantic ValidationError on one line that names the fields and the errors and never
    quotes a value of the input: ``2 validation errors: n: Input should be a valid integer,
    unable to parse string as an integer [int_parsing]; k: Value error, … [value_error]``
    (at most ``MAX_SHOWN_ERRORS``). A key of a mapping in the input is a value too: a part
    of a location that ``schema`` does not declare (without ``schema``: that is not an
    identifier) is shown as ``<key>``."""
    declared = declared_names(schema) if schema is not None else None
    errors = exc.errors(include_url=False, include_input=False)
    parts = [
        f"{'.'.join(_loc_part(p, declared) for p in error['loc']) or '(payload)'}:"
        f" {_message(error)} [{error['type']}]"
        for error in errors[:MAX_SHOWN_ERRORS]
    ]
    more = f"; and {len(errors) - MAX_SHOWN_ERRORS} more" if len(errors) > MAX_SHOWN_ERRORS else ""
    count = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}"
    return f"{count}: {'; '.join(parts)}{more}"
