"""D9: bearer JWTs, verified with a configured key, carrying the caller's permissions.

A token is accepted when its signature verifies with ``JOBFENCE_JWT_SECRET`` (HS256) or
``JOBFENCE_JWT_PUBLIC_KEY`` (RS256 for an RSA key, ES256 for a P-256 key), it has not expired
(``exp`` is required), and its ``iss`` and ``aud`` match ``JOBFENCE_JWT_ISSUER`` and
``JOBFENCE_JWT_AUDIENCE`` when those are set. Its time claims (``exp``, ``nbf``, ``iat``) are
RFC 7519 NumericDates: JSON numbers (integer or not), finite, from 0 to :data:`MAX_NUMERIC_DATE`
(the year 3000); anything else (a string, ``1e300``, ``NaN``) is refused. A token is refused from
its ``exp`` on, and while its ``nbf`` or ``iat`` is more than :data:`NOT_BEFORE_LEEWAY_SECONDS`
ahead of this host's clock (the issuer's clock may run that much ahead). The shared secret must
pass :func:`secret_problem`. ``sub`` names the caller (recorded as
``resolved_by`` and ``requested_by``) and ``permissions`` is a list of strings.

A client sends the same token with every request, so each process remembers the tokens it has
verified (at most ``TOKEN_CACHE_SIZE``, keyed by the token's exact text) with their principal,
until their ``exp``: a cached token is accepted without checking its signature again, and is
refused from its ``exp`` on, as an uncached one is. Nothing else can change the outcome: the
key and the accepted issuer and audience are fixed for the life of the process, and a token
that failed is never remembered.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from jobfence import config, ops
from jobfence.api.problems import ProblemError, forbidden, respond, unauthorized
from jobfence.errors import ConfigError

PERMISSION_READ = "core.dead_letters.read"
PERMISSION_REPLAY = "core.dead_letters.replay"
PERMISSION_DISCARD = "core.dead_letters.discard"
PERMISSIONS = (PERMISSION_READ, PERMISSION_REPLAY, PERMISSION_DISCARD)

MIN_SECRET_BYTES = 32  # RFC 7518 3.2: an HS256 key as long as the hash output at least
#: The least estimated entropy of a shared secret: its length in characters times the Shannon
#: entropy of its characters' frequencies. A random secret of 32 bytes or more, written as hex
#: or base64 (``openssl rand -hex 32``: about 240), is far above it; a run of one character,
#: two characters alternating or a padded word is far below.
MIN_SECRET_BITS = 80
#: The latest time a token's ``exp``, ``nbf`` or ``iat`` may name: 3000-01-01T00:00:00Z.
MAX_NUMERIC_DATE = 32_503_680_000
TIME_CLAIMS = ("exp", "nbf", "iat")
#: How far ahead of this host's clock a token's ``nbf`` or ``iat`` may be: an issuer whose clock
#: runs a little ahead stamps a fresh token with its own now, and the client uses it at once.
NOT_BEFORE_LEEWAY_SECONDS = 60.0
MAX_SUBJECT_CHARS = 500
DEFAULT_ITEM_CACHE_BYTES = 64 * 1024 * 1024  # about 60,000 items of the benchmark's size
_NO_KEY = (
    f"the API needs a key to verify tokens: set {config.ENV_JWT_SECRET} (HS256 shared secret, "
    f"at least {MIN_SECRET_BYTES} bytes) or {config.ENV_JWT_PUBLIC_KEY} (PEM public key, "
    "RS256 or ES256)"
)


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """What the API needs besides its pool and queue. Exactly one of ``jwt_secret`` and
    ``jwt_public_key`` must be set; both are kept out of ``repr``.

    ``bulk_chunk_size`` is how many dead letters a bulk replay handles per transaction;
    ``readiness_timeout_seconds`` bounds ``/readyz``'s wait for a database connection;
    ``item_cache_bytes`` is the size of the list items the API keeps in memory
    (:class:`jobfence.ops.ItemCache`; 0: none).
    """

    jwt_secret: str | None = field(default=None, repr=False)
    jwt_public_key: str | None = field(default=None, repr=False)
    jwt_issuer: str | None = None
    jwt_audience: str | None = None
    bulk_chunk_size: int = ops.BULK_CHUNK
    readiness_timeout_seconds: float = 2.0
    item_cache_bytes: int = DEFAULT_ITEM_CACHE_BYTES

    def __post_init__(self) -> None:
        if self.jwt_secret and self.jwt_public_key:
            raise ConfigError(
                f"set only one of {config.ENV_JWT_SECRET} and {config.ENV_JWT_PUBLIC_KEY}"
            )
        if not self.jwt_secret and not self.jwt_public_key:
            raise ConfigError(_NO_KEY)
        if self.bulk_chunk_size < 1:
            raise ConfigError("bulk_chunk_size must be >= 1")
        if not 0 < self.readiness_timeout_seconds < float("inf"):
            raise ConfigError("readiness_timeout_seconds must be a positive number")
        if self.item_cache_bytes < 0:
            raise ConfigError("item_cache_bytes must be >= 0")
        _verifying_key(self)  # refuse a key that cannot work now, not at the first request

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        bulk_chunk_size: int = ops.BULK_CHUNK,
        item_cache_bytes: int = DEFAULT_ITEM_CACHE_BYTES,
    ) -> ApiSettings:
        """The settings from ``JOBFENCE_JWT_*`` (see the module docstring)."""
        return cls(
            jwt_secret=config.jwt_secret_from_env(environ),
            jwt_public_key=config.jwt_public_key_from_env(environ),
            jwt_issuer=config.jwt_issuer_from_env(environ),
            jwt_audience=config.jwt_audience_from_env(environ),
            bulk_chunk_size=bulk_chunk_size,
            item_cache_bytes=item_cache_bytes,
        )


_Key = str | rsa.RSAPublicKey | ec.EllipticCurvePublicKey


def _estimated_bits(text: str) -> float:
    """``len(text)`` times the Shannon entropy (bits) of its characters' frequencies."""
    size = len(text)
    counts = Counter(text).values()
    return -sum(n * math.log2(n / size) for n in counts)


def _repeated_piece(text: str) -> bool:
    """Whether ``text`` is a shorter piece written twice or more (``abcabcabc``, ``xyxy``)."""
    return any(text[period:] == text[:-period] for period in range(1, len(text) // 2 + 1))


def secret_problem(secret: str) -> str | None:
    """Why ``secret`` cannot be an HS256 key, in words that never quote it; None when it can.

    The rule: at least :data:`MIN_SECRET_BYTES` bytes of UTF-8; not a shorter piece repeated;
    at least :data:`MIN_SECRET_BITS` of estimated entropy (its length times the Shannon entropy
    of its characters' frequencies: 40 spaces are 0 bits, ``ab`` written 20 times 40 bits)."""
    size = len(secret.encode("utf-8", "surrogatepass"))
    hint = "(for example `openssl rand -hex 32`)"
    if size < MIN_SECRET_BYTES:
        return f"is too short for HS256: use at least {MIN_SECRET_BYTES} bytes {hint}"
    if not secret.strip():
        return f"is only whitespace: use {MIN_SECRET_BYTES} random bytes or more {hint}"
    if _repeated_piece(secret):
        return (
            f"is a shorter piece repeated, with no more entropy than the piece: use "
            f"{MIN_SECRET_BYTES} random bytes or more {hint}"
        )
    bits = _estimated_bits(secret)
    if bits < MIN_SECRET_BITS:
        return (
            f"has too little entropy for HS256: about {bits:.0f} bits estimated from its "
            f"{len(set(secret))} distinct characters, under the minimum of {MIN_SECRET_BITS}: "
            f"use {MIN_SECRET_BYTES} random bytes or more {hint}"
        )
    return None


def _verifying_key(settings: ApiSettings) -> tuple[_Key, list[str]]:
    if settings.jwt_secret:
        problem = secret_problem(settings.jwt_secret)
        if problem is not None:
            raise ConfigError(f"{config.ENV_JWT_SECRET} {problem}")
        return settings.jwt_secret, ["HS256"]
    assert settings.jwt_public_key is not None
    try:
        key = load_pem_public_key(settings.jwt_public_key.encode())
    except (ValueError, TypeError):
        raise ConfigError(
            f"{config.ENV_JWT_PUBLIC_KEY} is not a PEM public key "
            "(expected -----BEGIN PUBLIC KEY-----)"
        ) from None
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise ConfigError(f"{config.ENV_JWT_PUBLIC_KEY}: an RSA key needs 2048 bits or more")
        return key, ["RS256"]
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return key, ["ES256"]
    raise ConfigError(
        f"{config.ENV_JWT_PUBLIC_KEY} must be an RSA key (RS256) or a P-256 EC key (ES256)"
    )


@dataclass(frozen=True, slots=True)
class Principal:
    """Who calls, and what they may do."""

    subject: str
    permissions: frozenset[str]


class InvalidToken(Exception):
    """A token that does not authenticate anyone; the message is safe to show."""


def _storable(text: str) -> bool:
    """Whether PostgreSQL can store ``text`` (no NUL, no lone surrogate)."""
    return "\x00" not in text and not any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


TOKEN_CACHE_SIZE = 1024
MAX_CACHED_TOKEN_CHARS = 8192


class TokenVerifier:
    """Verifies tokens (see the module docstring), remembering up to ``cache_size`` verified
    ones until their ``exp`` (0: none). ``clock`` gives the time in seconds since the epoch."""

    def __init__(
        self,
        settings: ApiSettings,
        *,
        cache_size: int = TOKEN_CACHE_SIZE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._cache: dict[str, tuple[Principal, float]] = {}
        self._cache_size = cache_size
        self._clock = clock
        self._key, self._algorithms = _verifying_key(settings)
        self._issuer = settings.jwt_issuer
        self._audience = settings.jwt_audience
        required = ["exp", "sub"]
        if self._issuer is not None:
            required.append("iss")
        if self._audience is not None:
            required.append("aud")
        self._required = required

    def verify(self, token: str) -> Principal:
        """The token's principal, or :class:`InvalidToken` with a fixed, token-free reason."""
        cached = self._cache.get(token)
        if cached is not None:
            principal, expires = cached
            if self._clock() < expires:
                return principal
            del self._cache[token]
        principal, expires = self._verify(token)
        if self._cache_size > 0 and len(token) <= MAX_CACHED_TOKEN_CHARS:
            if len(self._cache) >= self._cache_size:
                del self._cache[next(iter(self._cache))]  # the oldest entry
            self._cache[token] = (principal, expires)
        return principal

    def _verify(self, token: str) -> tuple[Principal, float]:
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=self._algorithms,
                issuer=self._issuer,
                audience=self._audience,
                options={
                    "require": self._required,
                    "verify_aud": self._audience is not None,
                    # Checked below, with their type and range: PyJWT takes int() of them,
                    # which accepts the string "9999999999" and 1e300.
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except jwt.InvalidIssuerError:
            raise InvalidToken("the token's issuer is not accepted") from None
        except jwt.InvalidAudienceError:
            raise InvalidToken("the token's audience is not accepted") from None
        except jwt.MissingRequiredClaimError as exc:
            raise InvalidToken(f"the token has no {exc.claim} claim") from None
        except jwt.InvalidSignatureError:
            raise InvalidToken("the token's signature does not verify") from None
        except jwt.InvalidAlgorithmError:
            raise InvalidToken("the token's algorithm is not accepted") from None
        except jwt.InvalidTokenError:
            raise InvalidToken("the token is malformed or its claims are invalid") from None
        times = {name: _numeric_date(claims, name) for name in TIME_CLAIMS}
        now = time.time()
        exp = times["exp"]
        assert exp is not None  # required
        if now >= exp:
            raise InvalidToken("the token has expired")
        for name in ("nbf", "iat"):
            value = times[name]
            if value is not None and value > now + NOT_BEFORE_LEEWAY_SECONDS:
                raise InvalidToken(f"the token is not valid yet (its {name} is in the future)")
        subject = claims.get("sub")
        if (
            not isinstance(subject, str)
            or not subject.strip()
            or len(subject) > MAX_SUBJECT_CHARS
            or not _storable(subject)
        ):
            raise InvalidToken(
                f"the token's sub claim must be a non-blank string of at most "
                f"{MAX_SUBJECT_CHARS} characters"
            )
        permissions = claims.get("permissions", [])
        if not isinstance(permissions, list) or not all(isinstance(p, str) for p in permissions):
            raise InvalidToken("the token's permissions claim must be a list of strings")
        return Principal(subject=subject, permissions=frozenset(permissions)), exp


def _numeric_date(claims: Mapping[str, object], name: str) -> float | None:
    """The claim as seconds since the epoch (None when absent), or :class:`InvalidToken`
    when it is not an RFC 7519 NumericDate in the accepted range."""
    if name not in claims:
        return None
    value = claims[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "null" if value is None else type(value).__name__
        kind = {"str": "a string", "bool": "a boolean", "list": "a list", "dict": "an object"}.get(
            kind, kind
        )
        raise InvalidToken(
            f"the token's {name} claim must be a JSON number of seconds since 1970 "
            f"(RFC 7519 NumericDate), not {kind}"
        )
    if (isinstance(value, float) and not math.isfinite(value)) or not (
        0 <= value <= MAX_NUMERIC_DATE
    ):
        raise InvalidToken(
            f"the token's {name} claim is out of range: it must be a finite number of seconds "
            f"from 0 to {MAX_NUMERIC_DATE} (3000-01-01T00:00:00Z)"
        )
    return float(value)


def authenticate(verifier: TokenVerifier, authorization: str | None) -> Principal:
    """The principal of an ``Authorization`` header, or a 401 :class:`ProblemError`."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("a bearer token is required", invalid_token=False)
    try:
        return verifier.verify(token)
    except InvalidToken as exc:
        raise unauthorized(str(exc), invalid_token=True) from None


class Authenticate:
    """ASGI middleware: every request under ``prefix`` needs a valid token (401 otherwise),
    checked before routing and before the body is read; the routes then check permissions.
    The principal travels in the request state."""

    def __init__(self, app: ASGIApp, *, verifier: TokenVerifier, prefix: str) -> None:
        self.app = app
        self.verifier = verifier
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:  # names are lower case (ASGI)
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            principal = authenticate(self.verifier, authorization)
        except ProblemError as exc:
            await respond(Request(scope), exc.problem, exc.headers)(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal  # request.state.principal
        await self.app(scope, receive, send)


class _BearerScheme(HTTPBearer):
    """Documents the scheme in OpenAPI and reads nothing: the token is verified by
    :class:`Authenticate` (or by :func:`require`, outside its prefix)."""

    async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
        return None


_bearer = _BearerScheme(
    auto_error=False,
    bearerFormat="JWT",
    description="A JWT with `sub`, `exp` and a `permissions` list.",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def require(
    permission: str,
) -> Callable[[Request, HTTPAuthorizationCredentials | None], Awaitable[Principal]]:
    """A dependency: the caller's :class:`Principal` (authenticated by :class:`Authenticate`,
    or here when the route is outside its prefix) when it carries ``permission`` (else 403)."""

    async def check(request: Request, credentials: Credentials) -> Principal:
        principal = getattr(request.state, "principal", None)
        if not isinstance(principal, Principal):
            verifier: TokenVerifier = request.app.state.jobfence.verifier
            principal = authenticate(verifier, request.headers.get("authorization"))
        if permission not in principal.permissions:
            raise forbidden(permission)
        return principal

    return check
