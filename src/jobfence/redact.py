"""What jobfence may show: secrets hidden, control characters escaped. Imports nothing of
jobfence, so that every module (configuration, database, queues, logs, the CLI) can use it.

Secrets. A connection setting may be a URL (``scheme://user:password@host/path?query``), a
list of them (a NATS seed list, ``nats://a:p@h1,nats://b:q@h2``), a libpq ``key=value``
connection string, or something that parses as none of these. :func:`redact_url` shows it with
every secret it holds replaced by ``***``, without trusting any parser (a password written with
``/``, ``?``, ``#`` or ``@`` unescaped makes every URL parser cut it somewhere else):

- the **user information** of each URL runs from its ``://`` to the last ``@`` before the next
  URL of the list (or the end); in ``scheme://a:p@h1,b:q@h2`` each comma-separated server
  that holds an ``@`` has its own. ``user:password`` is shown ``user:***``. Without a ``:`` it is a
  token (``nats://TOKEN@host``) and shown ``***``, except in a ``postgres://`` or
  ``postgresql://`` URL, where it is the user name; so is ``TOKEN:`` with nothing after the
  ``:`` (a client reads it as the token). A user part holding a character no URL
  holds unescaped (``[``, ``\\``, a space...) makes the URL unparseable and the split a guess:
  the whole user information is then shown ``***``. A string without ``://`` that holds an
  ``@`` and does not start as a libpq ``key=value`` string is taken from its start
  (``user:password@host``, the scheme forgotten);
- the value of every ``key=value`` (a query parameter or a libpq keyword, quoted or not) whose
  key looks secret (:func:`is_secret_key`: it contains pass, pwd, secret, token, auth, cred,
  key, sig, jwt, seed or session) runs to the next whitespace and is shown ``***``. User names
  and host names are shown: they locate, they do not authenticate.

:func:`url_secrets` lists the same secrets in every form a client library may echo them in an
error message: as written, percent-decoded, unquoted, and the pieces (of two characters or
more) a parser cuts a password into, as libpq reads ``postgresql://u:Db/Secret2@h/d`` as host
``u``, port ``Db`` and database ``Secret2@h/d``; :func:`redact_text` replaces them in such a
message (one shorter than 4 characters only where it stands alone, not inside a word) and
redacts any URL or secret ``key=value`` the message itself holds. A password that itself holds
``scheme://`` is the one form these rules cannot untangle.

Control characters. :func:`printable` escapes every character that is not printable (newline,
carriage return, ESC and the other C0 and C1 controls, line and paragraph separators...) as
Python writes it in a string literal, so that a value a producer chose can neither start a line
of its own in a log nor send a sequence to a terminal.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote, unquote_plus

__all__ = [
    "REDACTED",
    "Redactor",
    "is_secret_key",
    "printable",
    "redact_text",
    "redact_url",
    "url_secrets",
]

REDACTED = "***"

# A key whose value is a secret: password, passwd, sslpassword, pwd, secret, client_secret,
# token, auth, authorization, credentials, api_key, apikey, sslkey, sig, signature, jwt, nkey,
# seed, session...
_SECRET_KEY = re.compile(r"pass|pwd|secret|token|auth|cred|key|sig|jwt|seed|session", re.I)
# ``key=`` where a key may stand: at the start, after whitespace, a query separator, a quote or
# a dash (``--password=...`` as argparse quotes an argument). A key may be percent-encoded
# (libpq decodes a URL's parameter names). Possessive, so that a long run costs one pass.
_KEY = re.compile(
    r"""(?:^|(?<=[\s?&;,(\[{'"-]))((?:[A-Za-z_]|%[0-9A-Fa-f]{2})(?:[\w.-]|%[0-9A-Fa-f]{2})*+)"""
    r"(\s*+=\s*+)"
)
# A secret key's value: quoted (libpq's ``'...'`` with backslash escapes, or ``"..."``) and
# ending with the string or a space after its closing quote, or running to the next whitespace
# (a password holding ``&`` is hidden whole, and what follows with it). A quote left open, or
# closed in the middle of a word, hides the rest of the string: where such a value ends is
# anyone's guess.
_VALUE = re.compile(
    r"""'(?:[^'\\]|\\.)*+'(?=\s|$)|"(?:[^"\\]|\\.)*+"(?=\s|$)|['"].*|\S*""", re.DOTALL
)
# Where the value of a secret key inside a hidden value ends, as far as it is collected: at the
# next query separator or whitespace (or where the next key starts).
_PARAMETER_END = re.compile(r"[\s&;]")
# How a libpq key=value connection string starts (anything else holding an ``@`` is read as
# ``user:password@host``, whatever ``key=value`` pairs a password may hold).
_CONNINFO = re.compile(r"\s*[A-Za-z_][\w.-]*\s*=")
# The start of a URL's authority: its scheme and ``://``.
# Matched only where a run of scheme characters starts (possessive), so that a long run that is
# not followed by ``://`` costs one pass: the scheme is the run from its first letter.
_SCHEME = re.compile(r"(?<![A-Za-z0-9+.-])[0-9+.-]*+([A-Za-z][A-Za-z0-9+.-]*+)://")
# Where a URL parser (urllib, libpq, a broker client) may cut a password written unescaped.
_CUTS = re.compile(r"[/?#@:,;\s]+")
# A user name as a URL may hold it (RFC 3986 userinfo without ``:``): unreserved characters,
# sub-delimiters and percent escapes. Any other character before the ``:`` means the URL does not
# parse and its user information is hidden whole.
_USER_NAME = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*")
# A secret (or a piece of one) this short is replaced only where it stands alone.
_SHORT = 4


def is_secret_key(key: str) -> bool:
    """Whether a query parameter or a libpq keyword named ``key`` holds a secret."""
    return _SECRET_KEY.search(unquote(key)) is not None


def printable(text: str) -> str:
    """``text`` on one line: each character that is not printable escaped as Python writes it
    in a string literal (``\\n``, ``\\x1b``, ``\\u2028``...), never interpreted by a terminal
    or a log reader."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _unquoted(value: str) -> str:
    """A libpq value as libpq reads it: quotes removed, backslash escapes resolved."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


def _key_values(text: str, found: list[str], spans: list[tuple[int, int]] | None = None) -> str:
    """``text`` with the value of each secret ``key=value`` replaced by ``***`` (and added to
    ``found``). A plain key's value is shown and read on: a secret key after it, whatever
    separates them (``?sslmode=require&sslpassword=...``, ``;``, ``,``, a quote closed in the
    middle of a word) is hidden. A secret key inside a hidden value has its value (to the next
    ``&``, ``;``, whitespace or key) added to ``found`` on its own. Where each hidden value
    starts and ends is added to ``spans``. One pass: linear time."""
    if "=" not in text:
        return text
    out: list[str] = []
    hidden_to = 0  # text[:hidden_to] is in ``out``
    inner = -1  # where the value of a secret key inside a hidden value starts, if any

    def collect(end: int) -> None:
        cut = _PARAMETER_END.search(text, inner, end)
        if (value := text[inner : end if cut is None else cut.start()]) != "":
            found.append(value)

    for match in _KEY.finditer(text):
        if inner >= 0:
            collect(min(match.start(), hidden_to))
            inner = -1
        key, equals = match.groups()
        if not is_secret_key(key):
            continue
        start = match.end()
        if start <= hidden_to:  # inside a value hidden already: only collected
            inner = start
            continue
        value_match = _VALUE.match(text, start)
        value = "" if value_match is None else value_match.group(0)
        if value:
            found.append(value)
            if match.start() >= hidden_to:
                out.append(text[hidden_to : match.start()])
                out.append(f"{key}{equals}{REDACTED}")
            else:  # the key ends a hidden value, its ``=`` and value come after it
                out.append(text[hidden_to:start])
                out.append(REDACTED)
            hidden_to = start + len(value)
            if spans is not None:
                spans.append((start, hidden_to))
    if inner >= 0:
        collect(hidden_to)
    out.append(text[hidden_to:])
    return "".join(out)


def _user_info(userinfo: str, scheme: str, found: list[str]) -> str:
    """The user information of a URL as it may be shown; its secrets added to ``found``."""
    # A query whose value holds an ``@`` is cut into the user information: the value of a
    # secret key=value in it is a secret on its own too.
    _key_values(userinfo, found)
    user, colon, password = userinfo.partition(":")
    if _USER_NAME.fullmatch(user) is None:
        # A character no URL holds unescaped before the ``:`` (``[``, ``\``, a space...): the
        # URL does not parse, and where a user name would end is a guess. All of it is hidden.
        found.append(userinfo)
        return REDACTED
    if password:
        found.append(password)
        return f"{user}:{REDACTED}"
    if scheme.lower() in ("postgres", "postgresql"):
        return userinfo  # the user name
    # A token (nats://TOKEN@host), or one written with an empty password (nats://TOKEN:@host,
    # which a client reads as the token TOKEN).
    found.append(user if colon else userinfo)
    return REDACTED


def _scan(url: str) -> tuple[str, list[str]]:
    """``url`` as it may be shown, and the secrets it holds as written."""
    found: list[str] = []
    starts = list(_SCHEME.finditer(url))
    if not starts:
        # A libpq key=value string, or no URL at all: secret values first, then what is left
        # before an ``@`` (``user:password@host``).
        shown = _key_values(url, found)
        at = shown.rfind("@")
        if at > 0 and _CONNINFO.match(url) is None:
            shown = _user_info(shown[:at], "", found) + shown[at:]
        return shown, found
    parts = [url[: starts[0].start(1)]]
    for index, start in enumerate(starts):
        end = starts[index + 1].start(1) if index + 1 < len(starts) else len(url)
        items = url[start.end() : end].split(",")
        if not all("@" in item for item in items):
            items = [",".join(items)]  # not a list of servers with credentials: one item
        servers: list[str] = []
        for item in items:
            at = item.rfind("@")
            if at >= 0:
                # A secret query value holding an unescaped ``@`` (?password=p@ss): the user
                # information ends at an ``@`` before that value, if any.
                spans: list[tuple[int, int]] = []
                _key_values(item, [], spans)
                value = next((s for s, e in spans if s <= at < e), -1)
                if value >= 0:
                    at = item.rfind("@", 0, value)
            rest = item if at < 0 else _user_info(item[:at], start.group(1), found) + item[at:]
            servers.append(_key_values(rest, found))
        parts.append(url[start.start(1) : start.end()] + ",".join(servers))
    return "".join(parts), found


def _forms(secret: str) -> set[str]:
    """A secret as written and in every form it may be echoed in."""
    forms = {secret, _unquoted(secret)}
    # A query parameter's value as a URL parser reads it: up to the next parameter.
    forms.add(re.split(r"[&#]", secret, maxsplit=1)[0])
    forms.update([unquote(form) for form in forms] + [unquote_plus(form) for form in forms])
    for form in list(forms):
        pieces = _CUTS.split(form)
        if len(pieces) > 1:  # a piece of one character tells nothing: not worth hiding
            forms.update(piece for piece in pieces if len(piece) > 1)
    forms.discard("")
    return forms


def url_secrets(url: str) -> list[str]:
    """The secrets of a URL, a list of URLs or a libpq connection string (see the module's
    docstring), each in every form it may be echoed in, longest first. Empty when it holds
    none."""
    _, found = _scan(url)
    forms: set[str] = set()
    for secret in found:
        forms.update(_forms(secret))
    return sorted(forms, key=lambda s: (-len(s), s))


def _secrets_pattern(secrets: Iterable[str]) -> re.Pattern[str] | None:
    distinct = sorted({s for s in secrets if s}, key=lambda s: (-len(s), s))
    if not distinct:
        return None
    alternatives = [
        re.escape(s) if len(s) >= _SHORT else rf"(?<![A-Za-z0-9]){re.escape(s)}(?![A-Za-z0-9])"
        for s in distinct
    ]
    return re.compile("|".join(alternatives))


class Redactor:
    """:func:`redact_text` with its ``secrets`` compiled once (a log handler's filter)."""

    __slots__ = ("_pattern",)

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._pattern = _secrets_pattern(secrets)

    def __call__(self, text: str) -> str:
        if self._pattern is not None:
            text = self._pattern.sub(REDACTED, text)
        if "=" not in text and "://" not in text:
            return text
        text = _key_values(text, [])
        if "://" not in text:
            return text
        # Each whitespace-delimited word that holds a URL is redacted as one.
        return _WORD.sub(_redact_word, text)


# A whitespace-delimited word (not ``\S*://\S*``, which costs a pass per character of a long
# word without ``://``).
_WORD = re.compile(r"\S+")


def _redact_word(match: re.Match[str]) -> str:
    word = match.group(0)
    return _scan(word)[0] if "://" in word else word


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` (an error message, a log line) with each of ``secrets`` replaced by ``***``
    (one shorter than 4 characters only where it stands alone), then with the secrets of any
    URL or ``key=value`` it holds hidden as :func:`redact_url` hides them."""
    return Redactor(secrets)(text)


def redact_url(url: str, text: str | None = None) -> str:
    """``url`` (a URL, a list of URLs, a libpq connection string, or a string that parses as
    none of them) with every secret it holds replaced by ``***``. With ``text`` (an error
    message a client library wrote about ``url``, which may quote it whole or in pieces):
    ``text`` with the secrets of ``url`` redacted (:func:`redact_text`)."""
    if text is None:
        return _scan(url)[0]
    return redact_text(text, url_secrets(url))
