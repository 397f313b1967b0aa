"""The redaction of ``key=value`` pairs against the one before it, over generated inputs; its
time on long inputs; and the lines of the transport, pooler and migrate messages with hostile
values in them.

``_key_values`` was rewritten to read a URL's query parameter by parameter (a secret after a
shown parameter, ``?sslmode=require&sslpassword=...``, is hidden). The one before it is copied
here as the reference: every secret it hid is hidden still, no secret in a form the redaction
claims to handle is shown at all, and a long input costs linear time.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobfence import redact, transport
from jobfence.adapters.nats import TlsNotOffered, tls_context
from jobfence.errors import ConfigError
from jobfence.observability import configure_logging
from jobfence.queues import QueueTarget, parse_queue_url
from jobfence.redact import REDACTED, is_secret_key, redact_text, redact_url, url_secrets

# ------------------------------------------------------------------------------------------
# The reference: _key_values as it was before eca6303
# ------------------------------------------------------------------------------------------

_OLD_KEY_VALUE = re.compile(
    r"""(?:^|(?<=[\s?&;,(\[{]))([A-Za-z_][\w.-]*)(\s*=\s*)"""
    r"""('(?:[^'\\]|\\.)*'(?=\s|$)|"(?:[^"\\]|\\.)*"(?=\s|$)|['"].*|[^\s'"]\S*)""",
    re.DOTALL,
)


def _old_key_values(text: str, found: list[str], spans: object = None) -> str:
    """``text`` with the value of each secret ``key=value`` replaced by ``***`` (and added to
    ``found``). (``spans``, which the new one fills, is left alone.)"""

    def hide(match: re.Match[str]) -> str:
        key, equals, value = match.groups()
        if not is_secret_key(key):
            return match.group(0)
        found.append(value)
        return f"{key}{equals}{REDACTED}"

    return _OLD_KEY_VALUE.sub(hide, text) if "=" in text else text


def old_outputs(text: str) -> tuple[str, str]:
    """What ``redact_text`` and ``redact_url`` showed of ``text`` with the old ``_key_values``
    (the rest of the module as it is now)."""
    with mock.patch.object(redact, "_key_values", _old_key_values):
        return redact.redact_text(text), redact.redact_url(text)


# ------------------------------------------------------------------------------------------
# Generated inputs
# ------------------------------------------------------------------------------------------

SECRET_KEYS = [
    "password",
    "sslpassword",
    "token",
    "secret",
    "client_secret",
    "api_key",
    "access_key",
    "apikey",
    "auth_token",
    "sasl_password",
    "pwd",
    "passwd",
    "jwt",
    "nkey",
    "seed",
    "signature",
    "credentials",
]
PLAIN_KEYS = ["host", "port", "sslmode", "application_name", "dbname", "user", "db", "options"]
# Values of plain keys that a careless scanner lets swallow what follows them: quotes closed
# in the middle of a word or left open, separators, an ``=``, nothing at all.
PLAIN_VALUES = [
    "require",
    "'require'",
    '"require"',
    "'open",
    '"open',
    "'",
    "",
    "a=b",
    "x&",
    "v;",
    "1,2",
    "a%26b",
    "'two words'",
    "'it''s'",
    "(",
    "{",
    "verify-full",
]
SEPARATORS = ["&", ";", " ", "\t", "\n", "&&", ", ", ",", "&amp;", " & "]
EQUALS = ["=", " = ", "= ", " ="]
PREFIXES = [
    "",
    "postgresql://app@db.internal:5432/app?",
    "redis://redis.internal:6379/0?",
    "amqp://guest:{pw}@rabbit.internal/?",
    "nats://{pw}@n1:4222,nats://u:{pw}@n2:4222?",
    "{pw}",  # replaced by "user:PW@host/db?" below
    "error: ",
    "cannot connect (",
    "unrecognized arguments: --",
    "invalid choice: '",
    'invalid value "',
]
VALUE_SPECIALS = "/:@#%+!$*()~.-_,&?="


@dataclass
class Case:
    text: str
    claimed: list[str] = field(default_factory=list)  # markers of secrets that must not show
    other: list[str] = field(default_factory=list)  # markers of secrets outside the claims
    echoes: list[str] = field(default_factory=list)  # a secret as a client may echo it
    # In JSON-ish text, which no version claims: the old one hid such a value only when an
    # ``@`` followed it somewhere (a scheme-less user:password@host guess), so it is no part
    # of the comparison.
    json: list[str] = field(default_factory=list)


class Markers:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> str:
        self.count += 1
        return f"Zq{self.count:03d}k"


def _secret_pair(draw: st.DrawFn, marker: Markers, case: Case) -> str:
    """A secret key=value in one of the forms the redaction claims to hide (its marker in
    ``case.claimed``), with the key in any case or percent-encoded."""
    key = draw(st.sampled_from(SECRET_KEYS))
    key = draw(st.sampled_from([key, key.upper(), key.title(), key.swapcase()]))
    if draw(st.integers(0, 4)) == 0:  # a percent-encoded letter (libpq decodes keys)
        index = draw(st.integers(0, len(key) - 1))
        key = key[:index] + f"%{ord(key[index]):02X}" + key[index + 1 :]
    secret = marker()
    form = draw(st.integers(0, 6))
    # (A secret holding scheme:// is the one form the redaction says it cannot untangle.)
    tail = draw(st.text(alphabet=VALUE_SPECIALS, max_size=4)).replace("://", ":/")
    if form == 0:
        value = secret + tail
    elif form == 1:
        value = quote(secret + tail, safe="")
    elif form == 2:
        value = "'" + secret + " \\'" + tail.replace("'", "") + "'"
    elif form == 3:
        value = '"' + secret + ' \\"' + tail.replace('"', "") + '"'
    elif form == 4:
        value = "'" + secret + tail  # a quote left open: hides what follows
    elif form == 5:
        # Unquoted, with a space: only the first word is the value.
        other = marker()
        value = secret + tail + " " + other
        case.other.append(other)
    else:
        value = tail.replace("'", "").replace('"', "") + secret
        if value[:1] in ("'", '"'):
            value = secret
    case.claimed.append(secret)
    if form in (0, 1):
        case.echoes.append(secret + tail)
    return key + draw(st.sampled_from(EQUALS)) + value


@st.composite
def cases(draw: st.DrawFn) -> Case:
    marker = Markers()
    case = Case("")

    def password() -> str:
        secret = marker() + draw(st.text(alphabet="-_.~!$*+", max_size=3))
        case.claimed.append(secret[:6])
        case.echoes.append(secret)
        return secret

    prefix = draw(st.sampled_from(PREFIXES))
    if prefix == "{pw}":
        scheme = draw(st.sampled_from(["", "postgresql://", "amqp://"]))
        if not scheme:  # user:password@host without a scheme: redact_url's, not redact_text's
            other = marker()
            case.other.append(other)
            prefix = f"app:{other}@db/app?"
        else:
            prefix = f"{scheme}app:{{pw}}@db/app?"
    while "{pw}" in prefix:
        prefix = prefix.replace("{pw}", password(), 1)
    parts: list[str] = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            parts.append(_secret_pair(draw, marker, case))
        elif draw(st.integers(0, 5)) == 0:
            # JSON-ish text: not a key=value, outside what the redaction claims
            other = marker()
            parts.append(f'"password": "{other}"')
            case.json.append(other)
        else:
            key = draw(st.sampled_from(PLAIN_KEYS))
            parts.append(key + draw(st.sampled_from(EQUALS)) + draw(st.sampled_from(PLAIN_VALUES)))
        parts.append(draw(st.sampled_from(SEPARATORS)))
    case.text = prefix + "".join(parts[:-1]) + draw(st.sampled_from(["", " done", "\n", " )"]))
    return case


def shown(text: str) -> str:
    """``text`` with the stars set aside (a marker cannot be made of them, but be sure)."""
    return text.replace(REDACTED, "\x00")


def markers_in(text: str, case: Case) -> set[str]:
    seen = shown(text)
    return {m for m in case.claimed + case.other if m in seen}


@settings(
    max_examples=1500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(case=cases())
def test_the_new_redaction_hides_every_secret_the_old_one_hid(case: Case) -> None:
    old_text, old_url = old_outputs(case.text)
    new_text, new_url = redact_text(case.text), redact_url(case.text)
    assert markers_in(new_text, case) <= markers_in(old_text, case), (case.text, new_text)
    # redact_url, which takes everything to a URL's last "@" for its user information, hid
    # words outside any value when a secret value held an "@" (?password=p@ss, shown as
    # "***@ss"): the new one ends the user information before that value. Secret values only.
    secrets = set(case.claimed)
    assert markers_in(new_url, case) & secrets <= markers_in(old_url, case), (case.text, new_url)


@settings(
    max_examples=1500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(case=cases())
def test_no_secret_in_a_form_the_redaction_handles_is_shown(case: Case) -> None:
    for output in (redact_text(case.text), redact_url(case.text)):
        leaked = [m for m in case.claimed if m in shown(output)]
        assert not leaked, (case.text, output)
    # What a client library says of the string, quoting a secret as it read it, is hidden too.
    secrets = url_secrets(case.text)
    for echo in case.echoes:
        said = redact_url(case.text, f"bad value: {echo}")
        assert echo[:6] not in shown(said), (case.text, echo, secrets)


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        # A parameter's value that holds a quote closed in the middle of a word, or left open
        ("postgresql://h/d?sslmode='require'&sslpassword=Zq1secret", "Zq1secret"),
        ('application_name="open password=Zq2secret', "Zq2secret"),
        # A query separated by ; or ,
        ("postgresql://h/d?sslmode=require;sslpassword=Zq3secret", "Zq3secret"),
        ("redis://h/0?db=1,password=Zq4secret", "Zq4secret"),
        # A percent-encoded key, which libpq decodes
        ("postgresql://h/d?ssl%70assword=Zq5secret", "Zq5secret"),
        ("postgresql://h/d?sslmode=require&%70assword=Zq6secret", "Zq6secret"),
        # A value left empty before a space
        ("host=h user= password=Zq7secret", "Zq7secret"),
        # An argument typed in the wrong place, as argparse quotes it
        ("unrecognized arguments: --password=Zq8secret", "Zq8secret"),
        ("argument --queue-url: invalid choice: 'token=Zq9secret'", "Zq9secret"),
        ('invalid value "api_key=Zq10secret"', "Zq10secret"),
    ],
)
def test_a_secret_pair_is_hidden_whatever_stands_before_it(text: str, secret: str) -> None:
    assert secret not in redact_text(text)
    assert secret not in redact_url(text)
    assert secret in url_secrets(text) or any(secret in s for s in url_secrets(text))


def test_what_the_redaction_shows_of_plain_pairs_is_unchanged() -> None:
    text = "postgresql://app@db:5432/app?sslmode=verify-full&application_name=w1&password=Zq"
    assert redact_text(text) == (
        "postgresql://app@db:5432/app?sslmode=verify-full&application_name=w1&password=***"
    )
    assert redact_text("host=db port=5432 sslmode='require' user=app") == (
        "host=db port=5432 sslmode='require' user=app"
    )


# ------------------------------------------------------------------------------------------
# Long inputs: no RecursionError, linear time
# ------------------------------------------------------------------------------------------

LONG_INPUTS: dict[str, str] = {
    "plain-parameters": "a=1&" * 25_000,
    "secret-parameters": "password=a&" * 9_000,
    "mixed-parameters": "sslmode=require&token=t0k3n;" * 3_500,
    "open-quotes": "a='&" * 25_000,
    "closed-quotes": 'a="x"&' * 16_000,
    "libpq-words": "host=h password=p " * 5_500,
    "commas": "password=a,token=b," * 5_000,
    "long-word-then-url": "a" * 100_000 + " x://y",
    "scheme-characters": "a." * 50_000 + " x://y",
    "url-then-scheme-characters": "x://" + "a-" * 50_000,
    "url-with-query": "postgresql://u:p@h/d?" + "sslmode=require&password=pw&" * 3_500,
    "equals": "=" * 100_000,
    "at-signs": "x://" + "@" * 100_000,
    "seed-list": "nats://" + "a@b," * 25_000,
    "spaces-and-keys": "a " * 50_000 + "=",
    "percent-keys": "%41=1&" * 16_000,
}


@pytest.mark.parametrize("text", LONG_INPUTS.values(), ids=LONG_INPUTS.keys())
def test_a_long_input_is_redacted_in_linear_time(text: str) -> None:
    for function in (redact_text, redact_url, url_secrets):
        started = time.perf_counter()
        function(text)
        elapsed = time.perf_counter() - started
        assert elapsed < 0.5, (function.__name__, len(text), elapsed)


def test_ten_thousand_parameters_hide_each_secret() -> None:
    secrets = [f"Zq{i:05d}k" for i in range(10_000)]
    query = "&".join(
        f"p{i}=v&token={s}" if i % 2 else f"sslpassword={s}" for i, s in enumerate(secrets)
    )
    for text in (f"postgresql://h/d?{query}", query.replace("&", " ")):
        out = redact_text(text)
        assert not [s for s in secrets if s in out]


# ------------------------------------------------------------------------------------------
# The lines of the new messages, with hostile values
# ------------------------------------------------------------------------------------------

HOSTILE_SECRETS = ["Zq/Pw1@x", "Zq?Pw2#y", "ZqPw3:4222", "Zq%2FPw4", "ZqPw5&token=Zq6"]


def _forms(secret: str) -> set[str]:
    pieces = {p for p in re.split(r"[/?#@:&=%]+", secret) if len(p) >= 3}
    return {secret, quote(secret, safe="")} | pieces


def queue_urls(secret: str) -> Iterator[str]:
    encoded = quote(secret, safe="")
    for scheme in ("amqp", "amqps", "redis", "rediss", "nats", "tls"):
        yield f"{scheme}://user:{encoded}@broker.example.com/"
        yield f"{scheme}://user:{secret}@broker.example.com/"
        if scheme in ("nats", "tls"):
            yield f"{scheme}://{encoded}@n1.example.com:4222,{scheme}://u:{encoded}@n2.example.com"
    yield f"amqps://user:{encoded}@rabbit.example.com/?no_verify_ssl=1"
    yield f"rediss://:{encoded}@redis.example.com/0?ssl_cert_reqs=none&ssl_check_hostname=no"


@pytest.mark.parametrize("secret", HOSTILE_SECRETS)
def test_no_transport_warning_about_a_queue_holds_its_credentials(secret: str) -> None:
    for url in queue_urls(secret):
        try:
            target = parse_queue_url(url)
        except ConfigError as exc:
            lines = [str(exc)]
        else:
            lines = transport.queue_transport_warnings(target)
        for line in lines:
            assert not [f for f in _forms(secret) if f in line], (url, line)


def test_a_hand_made_target_with_credentials_in_its_location_or_hosts_is_warned_without_them() -> (
    None
):
    target = QueueTarget(
        kind="rabbitmq",
        location="amqp://guest:Zq-Pw-7@rabbit.example.com:5672/",
        backend=None,
        url="amqp://guest:Zq-Pw-7@rabbit.example.com:5672/",
        client_url="amqp://guest:Zq-Pw-7@rabbit.example.com:5672/",
        hosts=("guest:Zq-Pw-7@rabbit.example.com:5672",),
    )
    lines = transport.queue_transport_warnings(target)
    assert lines
    for line in lines:
        assert "Zq-Pw-7" not in line, line
        assert "rabbit.example.com" in line


def test_the_database_warning_names_host_port_and_sslmode_only() -> None:
    params = {"host": "db.example.com", "port": "5432", "sslmode": "require"}
    line = transport.database_transport_warning(params, ssl_in_use=True)
    assert line is not None and "db.example.com:5432" in line and "sslmode=require" in line
    # libpq reads postgresql://u:6543/Zq-rest@db.example.com/d as host u, port 6543: the port is
    # a piece of the password, which the log filter's configured secrets hide.
    url = "postgresql://u:6543/Zq-rest@db.example.com/d"
    line = transport.database_transport_warning({"host": "u", "port": "6543"}, ssl_in_use=False)
    assert line is not None
    assert "6543" not in redact_text(line, url_secrets(url))


@pytest.mark.usefixtures("restore_logging")
def test_a_warning_line_is_escaped_and_redacted_by_the_log_filter() -> None:
    import io

    stream = io.StringIO()
    configure_logging("text", secrets=[], stream=stream)
    # What the migrate WARNING quotes of another client's session: its application_name.
    logging.getLogger("jobfence.schema").warning(
        "migration %s waited: %s", "0007_x", "pid 42 (evil\nFAKE LINE\x1b[2J password=Zq10, idle)"
    )
    output = stream.getvalue()
    assert output.count("\n") == 1, output
    assert "\x1b" not in output and "Zq10" not in output


def test_a_ca_path_that_is_a_url_with_credentials_is_not_shown_by_the_cli() -> None:
    from jobfence.cli_dead_letters import _shown_error

    with pytest.raises(ConfigError) as caught:
        tls_context(ca="https://user:Zq-Pw-11@ca.example.com/ca.pem?token=Zq12")
    assert "Zq-Pw-11" not in _shown_error(str(caught.value))
    assert "Zq12" not in _shown_error(str(caught.value))
    assert str(TlsNotOffered("why")) == "why"


HolderRow = tuple[int, str, str, str, int | None]


def test_the_lock_holders_phrase_reaches_a_log_line_or_an_error_line_escaped(
    restore_logging: None,
) -> None:
    """PostgreSQL turns an application_name's non-ASCII bytes into ``?`` or escapes, but a
    table's name (``regclass``) may hold any character: the phrase is escaped by its sinks."""
    import asyncio
    import io

    from jobfence import schema
    from jobfence.cli_dead_letters import _shown_error

    rows: list[HolderRow] = [
        (42, 'jobfence."a\nb"', "evil\nFAKE\x1b[2J\u2028 password=Zq13", "idle", 10),
    ]

    class Cursor:
        async def fetchall(self) -> list[HolderRow]:
            return rows

    class Conn:
        async def execute(self, *args: object) -> Cursor:
            return Cursor()

    phrase = asyncio.run(schema._holders(Conn(), 2.0))  # type: ignore[arg-type]
    assert "pid 42" in phrase
    error = _shown_error(f"migration 0007_x could not get a table lock: {phrase}")
    assert error.isprintable() and "Zq13" not in error, error
    stream = io.StringIO()
    configure_logging("text", secrets=[], stream=stream)
    logging.getLogger("jobfence.schema").warning("migration %s waited: %s", "0007_x", phrase)
    output = stream.getvalue()
    assert output.count("\n") == 1 and "\x1b" not in output and "Zq13" not in output, output
