"""D9 over real HTTP: the permission matrix of every endpoint, RS256 and ES256 keys, issuer
and audience, malformed tokens, the refusal to start without a key, and no secret in any
response or log line."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from jobfence import ConfigError, ops
from jobfence.api import PERMISSION_DISCARD, PERMISSION_READ, PERMISSION_REPLAY, ApiSettings
from jobfence.api.auth import InvalidToken, TokenVerifier
from support import scalar, wait_until
from test_api_support import (
    ALL_PERMISSIONS,
    PREFIX,
    SECRET,
    Api,
    ApiProcess,
    assert_problem,
    bearer,
    dead_letter_row,
    insert_dead_letter,
    loopback_socket,
    make_token,
    running_api,
)


@dataclass(frozen=True)
class Endpoint:
    name: str
    method: str
    path: str  # {dl}: a pending dead letter; {run}: a bulk replay not run yet
    permission: str
    granted_status: int
    body: dict[str, Any] | None = field(default=None)


ENDPOINTS = [
    Endpoint("list", "GET", PREFIX, PERMISSION_READ, 200),
    Endpoint("show", "GET", PREFIX + "/{dl}", PERMISSION_READ, 200),
    Endpoint("replay", "POST", PREFIX + "/{dl}/replay", PERMISSION_REPLAY, 200),
    Endpoint(
        "discard", "POST", PREFIX + "/{dl}/discard", PERMISSION_DISCARD, 200, {"reason": "dup"}
    ),
    Endpoint(
        "bulk-start", "POST", PREFIX + "/replay-bulk", PERMISSION_REPLAY, 202, {"queue": "q-dl"}
    ),
    Endpoint(
        "bulk-dry-run",
        "POST",
        PREFIX + "/replay-bulk",
        PERMISSION_REPLAY,
        200,
        {"dry_run": True, "all": True},
    ),
    Endpoint("bulk-progress", "GET", PREFIX + "/replay-bulk/{run}", PERMISSION_READ, 200),
    Endpoint("bulk-items", "GET", PREFIX + "/replay-bulk/{run}/items", PERMISSION_READ, 200),
    Endpoint("bulk-resume", "POST", PREFIX + "/replay-bulk/{run}/resume", PERMISSION_REPLAY, 202),
]
CASES = ["no-token", "expired", "wrong-signature", "lacking-permission", "granted"]


def case_headers(case: str, permission: str) -> dict[str, str]:
    if case == "no-token":
        return {}
    if case == "expired":
        return bearer(make_token(expires_in=-60))
    if case == "wrong-signature":
        return bearer(make_token(key=SECRET[::-1]))
    if case == "lacking-permission":
        return bearer(make_token(permissions=[p for p in ALL_PERMISSIONS if p != permission]))
    return bearer(make_token(permissions=[permission], sub="matrix-user"))


@pytest.fixture
async def api(pool: AsyncConnectionPool[Any]) -> AsyncIterator[Api]:
    async with running_api(pool) as running:
        yield running


async def state(conn: AsyncConnection[Any]) -> tuple[Any, ...]:
    """Everything a refused request must leave alone."""
    cur = await conn.execute(
        "SELECT (SELECT count(*) FROM jobfence_queue.messages),"
        " (SELECT count(*) FROM jobfence.bulk_replays),"
        " (SELECT count(*) FROM jobfence.bulk_replay_items WHERE result IS NOT NULL),"
        " (SELECT string_agg(id || ':' || status, ',' ORDER BY id) FROM core.dead_letters)"
    )
    row = await cur.fetchone()
    assert row is not None
    return tuple(row)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.name)
async def test_permission_matrix(
    api: Api, conn: AsyncConnection[Any], endpoint: Endpoint, case: str
) -> None:
    """Every endpoint: no token, an expired token and a wrong signature are 401 with a
    Bearer challenge; a valid token without the endpoint's permission (but with every other
    one) is 403; the permission alone is enough. Refused requests change nothing."""
    dl_id = await insert_dead_letter(conn, job_id="m-dl", queue="q-dl")
    await insert_dead_letter(conn, job_id="m-run", queue="q-run")
    run = await ops.start_bulk_replay(
        api.pool, ops.DeadLetterFilter(queue="q-run"), requested_by="seed"
    )
    assert isinstance(run, ops.BulkReplay)
    path = endpoint.path.format(dl=dl_id, run=run.id)
    before = await state(conn)

    response = await api.client.request(
        endpoint.method, path, json=endpoint.body, headers=case_headers(case, endpoint.permission)
    )

    if case == "granted":
        assert response.status_code == endpoint.granted_status, response.text
        if endpoint.name in ("replay", "discard"):
            assert (await dead_letter_row(conn, dl_id))["resolved_by"] == "matrix-user"
        if endpoint.name == "bulk-start":
            assert response.json()["requested_by"] == "matrix-user"
        return
    if case == "lacking-permission":
        problem = assert_problem(response, 403, type="urn:jobfence:problem:forbidden")
        assert endpoint.permission in problem["detail"]
    else:
        problem = assert_problem(response, 401, type="urn:jobfence:problem:unauthorized")
        challenge = response.headers["www-authenticate"]
        assert challenge.startswith('Bearer realm="jobfence"')
        assert ('error="invalid_token"' in challenge) == (case != "no-token")
    assert await state(conn) == before


@pytest.mark.parametrize("reader", [False, True], ids=["discard-only", "discard-and-read"])
async def test_a_discard_answers_the_payload_only_to_a_token_that_may_read_it(
    api: Api, conn: AsyncConnection[Any], *, reader: bool
) -> None:
    """Least privilege: a token that may discard but not read dead letters learns what its
    discard did and the dead letter's identifiers, never its payload or error; a token that
    may also read gets the dead letter whole, as ``GET`` would show it."""
    dl_id = await insert_dead_letter(
        conn, job_id="lp-1", queue="q-lp", payload={"card": "4111-secret"}, correlation_id="c-1"
    )
    granted = [PERMISSION_DISCARD, PERMISSION_READ] if reader else [PERMISSION_DISCARD]
    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard",
        json={"reason": "a duplicate"},
        headers=bearer(make_token(permissions=granted, sub="discarder")),
    )
    assert response.status_code == 200, response.text
    body = response.json()
    row = await dead_letter_row(conn, dl_id)
    assert (row["status"], row["resolved_by"]) == ("discarded", "discarder")
    if reader:
        assert body["payload"] == {"card": "4111-secret"}
        assert body["last_error"] == "Flaky: it failed"
        return
    assert "4111-secret" not in response.text and "it failed" not in response.text
    resolved_at = body.pop("resolved_at")
    assert resolved_at.startswith(str(row["resolved_at"].year))
    assert body == {
        "dead_letter_id": dl_id,
        "status": "discarded",
        "discard_reason": "a duplicate",
        "resolved_by": "discarder",
        "job_id": "lp-1",
        "queue": "q-lp",
        "consumer": "award_points",
        "tenant_id": "t1",
        "correlation_id": "c-1",
    }


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", PREFIX + "/1/discard", b'{"reason": '),
        ("POST", PREFIX + "/replay-bulk", b"\xff\xfe"),
        ("GET", PREFIX + "?limit=0", None),
        ("GET", PREFIX + "/not-a-number", None),
        ("GET", "/v1/no/such/route", None),
    ],
)
async def test_without_a_valid_token_a_request_is_401_before_its_input_is_looked_at(
    api: Api, method: str, path: str, body: bytes | None
) -> None:
    for headers in ({}, bearer(make_token(key=SECRET[::-1]))):
        response = await api.client.request(
            method, path, content=body, headers={**headers, "Content-Type": "application/json"}
        )
        assert_problem(response, 401, type="urn:jobfence:problem:unauthorized")


@pytest.mark.parametrize(
    ("headers", "detail"),
    [
        pytest.param(lambda: {"Authorization": "Bearer"}, "a bearer token is required", id="empty"),
        pytest.param(
            lambda: {"Authorization": f"Basic {SECRET}"}, "a bearer token is required", id="basic"
        ),
        pytest.param(lambda: bearer("not.a.jwt"), "malformed", id="garbage"),
        pytest.param(
            lambda: bearer(
                jwt.encode({"sub": "x", "exp": time.time() + 60}, key=None, algorithm="none")
            ),
            "algorithm",
            id="alg-none",
        ),
        pytest.param(lambda: bearer(make_token(expires_in=None)), "no exp claim", id="no-exp"),
        pytest.param(lambda: bearer(make_token(sub=None)), "no sub claim", id="no-sub"),
        pytest.param(lambda: bearer(make_token(sub="  ")), "sub claim", id="blank-sub"),
        pytest.param(lambda: bearer(make_token(sub="a\x00b")), "sub claim", id="nul-sub"),
        pytest.param(lambda: bearer(make_token(sub="x" * 501)), "sub claim", id="long-sub"),
        pytest.param(
            lambda: bearer(make_token(permissions=None, scope=PERMISSION_READ)),
            None,
            id="no-permissions-claim",
        ),
        pytest.param(
            lambda: bearer(
                jwt.encode(
                    {"sub": "x", "exp": time.time() + 60, "permissions": PERMISSION_READ}, SECRET
                )
            ),
            "permissions claim",
            id="permissions-not-a-list",
        ),
        pytest.param(lambda: bearer(make_token(nbf=time.time() + 600)), "not valid yet", id="nbf"),
    ],
)
async def test_malformed_or_incomplete_tokens_are_refused(
    api: Api, headers: Callable[[], dict[str, str]], detail: str | None
) -> None:
    response = await api.client.get(PREFIX, headers=headers())  # made now: never stale
    if detail is None:  # a valid token with no permissions at all
        assert_problem(response, 403)
        return
    problem = assert_problem(response, 401)
    assert detail in problem["detail"]


def _pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def hs256_signed_with(key: bytes) -> str:
    """A token HMAC-signed with ``key`` by hand (PyJWT refuses a PEM as an HMAC secret)."""

    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    header = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    claims = {"sub": "mallory", "exp": int(time.time()) + 60, "permissions": [PERMISSION_READ]}
    signing_input = header + b"." + b64(json.dumps(claims).encode())
    signature = hmac.new(key, signing_input, hashlib.sha256).digest()
    return (signing_input + b"." + b64(signature)).decode()


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def other_rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.mark.parametrize("algorithm", ["RS256", "ES256"])
async def test_tokens_signed_with_the_configured_public_keys_private_key_verify(
    pool: AsyncConnectionPool[Any],
    rsa_key: rsa.RSAPrivateKey,
    other_rsa_key: rsa.RSAPrivateKey,
    algorithm: str,
) -> None:
    private: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
    stranger: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
    if algorithm == "RS256":
        private, stranger = rsa_key, other_rsa_key
    else:
        private, stranger = (
            ec.generate_private_key(ec.SECP256R1()),
            ec.generate_private_key(ec.SECP256R1()),
        )
    public_pem = _pem(private)
    settings = ApiSettings(jwt_public_key=public_pem)
    async with running_api(pool, settings=settings) as api:

        async def status(token: str) -> int:
            return (await api.client.get(PREFIX, headers=bearer(token))).status_code

        assert await status(make_token(key=private, algorithm=algorithm)) == 200
        assert await status(make_token(key=stranger, algorithm=algorithm)) == 401
        assert await status(make_token(key=private, algorithm=algorithm, expires_in=-5)) == 401
        assert await status(make_token(key=private, algorithm=algorithm, permissions=[])) == 403
        # An HS256 token keyed with the public key itself (algorithm confusion): refused.
        assert await status(hs256_signed_with(public_pem.encode())) == 401
        # And an HS256 token with the usual test secret: this API verifies with the key only.
        assert await status(make_token()) == 401


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        pytest.param({"iss": "https://id.example", "aud": "jobfence-ops"}, 200, id="both-right"),
        pytest.param(
            {"iss": "https://id.example", "aud": ["other", "jobfence-ops"]}, 200, id="aud-list"
        ),
        pytest.param({"iss": "https://evil.example", "aud": "jobfence-ops"}, 401, id="wrong-iss"),
        pytest.param({"aud": "jobfence-ops"}, 401, id="no-iss"),
        pytest.param({"iss": "https://id.example", "aud": "billing"}, 401, id="wrong-aud"),
        pytest.param({"iss": "https://id.example"}, 401, id="no-aud"),
    ],
)
async def test_issuer_and_audience_are_checked_when_configured(
    pool: AsyncConnectionPool[Any], claims: dict[str, Any], expected: int
) -> None:
    settings = ApiSettings(
        jwt_secret=SECRET, jwt_issuer="https://id.example", jwt_audience="jobfence-ops"
    )
    async with running_api(pool, settings=settings) as api:
        response = await api.client.get(PREFIX, headers=bearer(make_token(**claims)))
        assert response.status_code == expected, response.text


async def test_issuer_and_audience_are_not_required_when_not_configured(api: Api) -> None:
    token = make_token(iss="anyone", aud="anything")
    assert (await api.client.get(PREFIX, headers=bearer(token))).status_code == 200


# -- Configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({}, "the API needs a key to verify tokens", id="no-key"),
        pytest.param({"jwt_secret": "short"}, "too short", id="short-secret"),
        pytest.param(
            {"jwt_secret": SECRET, "jwt_public_key": "-----BEGIN PUBLIC KEY-----"},
            "only one of",
            id="both",
        ),
        pytest.param({"jwt_public_key": "-----BEGIN nonsense"}, "not a PEM public key", id="pem"),
        pytest.param({"jwt_secret": SECRET, "bulk_chunk_size": 0}, "bulk_chunk_size", id="chunk"),
    ],
)
def test_api_settings_refuse_a_configuration_that_cannot_work(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ApiSettings(**kwargs)


def test_api_settings_refuse_weak_or_unsupported_public_keys() -> None:
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(ConfigError, match="2048 bits"):
        ApiSettings(jwt_public_key=_pem(small))
    p384 = ec.generate_private_key(ec.SECP384R1())
    with pytest.raises(ConfigError, match="P-256"):
        ApiSettings(jwt_public_key=_pem(p384))


def test_api_settings_from_env_read_every_variable_and_a_key_file(
    tmp_path: Path, rsa_key: rsa.RSAPrivateKey
) -> None:
    key_file = tmp_path / "jwt.pem"
    key_file.write_text(_pem(rsa_key))
    settings = ApiSettings.from_env(
        {
            "JOBFENCE_JWT_PUBLIC_KEY": str(key_file),
            "JOBFENCE_JWT_ISSUER": " https://id.example ",
            "JOBFENCE_JWT_AUDIENCE": "jobfence-ops",
        }
    )
    assert settings.jwt_public_key == _pem(rsa_key)
    assert (settings.jwt_issuer, settings.jwt_audience) == ("https://id.example", "jobfence-ops")
    from_text = ApiSettings.from_env({"JOBFENCE_JWT_PUBLIC_KEY": _pem(rsa_key)})
    assert from_text.jwt_public_key == _pem(rsa_key).strip()
    one_line = _pem(rsa_key).strip().replace("\n", "\\n")  # as pasted into a .env file
    assert ApiSettings.from_env({"JOBFENCE_JWT_PUBLIC_KEY": one_line}).jwt_public_key == (
        _pem(rsa_key).strip()
    )
    with pytest.raises(ConfigError, match="neither PEM text nor a readable file"):
        ApiSettings.from_env({"JOBFENCE_JWT_PUBLIC_KEY": str(tmp_path / "missing.pem")})
    hs = ApiSettings.from_env({"JOBFENCE_JWT_SECRET": SECRET})
    assert SECRET not in repr(hs)


async def test_jobfence_api_refuses_to_start_without_a_key_in_one_line(
    database_url: str, tmp_path: Path
) -> None:
    proc = ApiProcess(database_url, tmp_path, JOBFENCE_JWT_SECRET="")
    try:
        assert await proc.wait_exit() == 2
        lines = proc.output().strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("jobfence: error: the API needs a key to verify tokens: set ")
        assert "JOBFENCE_JWT_SECRET" in lines[0] and "JOBFENCE_JWT_PUBLIC_KEY" in lines[0]
    finally:
        proc.cleanup()


async def test_jobfence_api_serves_until_sigterm_and_never_logs_secrets(
    database_url: str, tmp_path: Path, conn: AsyncConnection[Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="cli-1")
    proc = ApiProcess(database_url, tmp_path, "--pool-size", "3")
    token = make_token(sub="cli-user")
    try:
        base_url = await proc.base_url()
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            assert (await client.get("/readyz")).status_code == 200
            listed = await client.get(PREFIX, headers=bearer(token))
            assert [item["id"] for item in listed.json()["items"]] == [dl_id]
            refused = await client.get(PREFIX, headers=bearer(make_token(key=SECRET[::-1])))
            assert refused.status_code == 401
            discarded = await client.post(
                f"{PREFIX}/{dl_id}/discard", json={"reason": "test"}, headers=bearer(token)
            )
            assert discarded.json()["resolved_by"] == "cli-user"
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit() == 0
    finally:
        proc.cleanup()
    output = proc.output()
    assert "Uvicorn running on" in output
    assert f'"GET {PREFIX} HTTP/1.1" 200' in output  # the access log is on
    assert SECRET not in output
    assert token not in output
    assert token.split(".")[2] not in output


async def test_jobfence_api_no_access_log_logs_no_line_per_request(
    database_url: str, tmp_path: Path
) -> None:
    proc = ApiProcess(database_url, tmp_path, "--pool-size", "1", "--no-access-log")
    try:
        base_url = await proc.base_url()
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            assert (await client.get("/readyz")).status_code == 200
            listed = await client.get(PREFIX, headers=bearer(make_token()))
            assert listed.status_code == 200
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit() == 0
    finally:
        proc.cleanup()
    output = proc.output()
    assert "Uvicorn running on" in output  # uvicorn's other INFO lines stay
    assert "HTTP/1.1" not in output and "uvicorn.access" not in output, output


async def test_no_secret_or_token_appears_in_responses_or_logs(
    api: Api, conn: AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="s-1")
    caplog.set_level(logging.DEBUG)
    tokens = [
        make_token(),
        make_token(key=SECRET[::-1]),
        make_token(expires_in=-1),
        make_token(permissions=[]),
        "garbage." + SECRET,
    ]
    bodies: list[str] = []
    for token in tokens:
        for method, path, body in (
            ("GET", PREFIX, None),
            ("GET", f"{PREFIX}/{dl_id}", None),
            ("POST", f"{PREFIX}/{dl_id}/discard", {"reason": ""}),
            ("POST", f"{PREFIX}/999/replay", None),
        ):
            response = await api.client.request(method, path, json=body, headers=bearer(token))
            bodies.append(response.text + str(response.headers))
    everything = "\n".join(bodies) + caplog.text
    assert SECRET not in everything
    for token in tokens:
        assert token not in everything
        assert token.split(".")[-1] not in everything
    assert await scalar(conn, "SELECT status FROM core.dead_letters") == "pending_review"


@pytest.fixture(autouse=True)
def _no_leaked_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """These tests pass settings explicitly; the environment must not change them."""
    for name in ("JOBFENCE_JWT_SECRET", "JOBFENCE_JWT_PUBLIC_KEY", "JOBFENCE_JWT_ISSUER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("JOBFENCE_JWT_AUDIENCE", raising=False)
    yield


async def test_jobfence_api_exits_3_when_its_port_is_taken(
    database_url: str, tmp_path: Path
) -> None:
    taken = loopback_socket()
    taken.listen()
    # The later --port wins over ApiProcess's own --port 0.
    proc = ApiProcess(database_url, tmp_path, "--port", str(taken.getsockname()[1]))
    try:
        assert await proc.wait_exit() == 3
        assert "error while attempting to bind on address" in proc.output()
        assert SECRET not in proc.output()
    finally:
        proc.cleanup()
        taken.close()


# -- The cache of verified tokens -----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_a_verified_token_is_remembered_until_its_exp_and_not_after() -> None:
    clock = FakeClock()
    verifier = TokenVerifier(ApiSettings(jwt_secret=SECRET), clock=clock)
    token = make_token(sub="cached", expires_in=600)
    exp = jwt.decode(token, options={"verify_signature": False})["exp"]
    first = verifier.verify(token)
    assert verifier.verify(token) is first  # from the cache: not verified again
    clock.now = exp - 0.001
    assert verifier.verify(token) is first
    clock.now = exp  # a token is expired from its exp on: the cache entry is not used
    second = verifier.verify(token)  # verified again (still valid by the real clock)
    assert second == first and second is not first


def test_the_token_cache_is_bounded_and_never_remembers_a_refused_token() -> None:
    verifier = TokenVerifier(ApiSettings(jwt_secret=SECRET), cache_size=2)
    tokens = [make_token(sub=f"user-{n}") for n in range(3)]
    first = [verifier.verify(token) for token in tokens]
    assert verifier.verify(tokens[2]) is first[2]
    assert verifier.verify(tokens[1]) is first[1]
    assert verifier.verify(tokens[0]) is not first[0]  # the oldest entry was dropped
    forged = make_token(key=SECRET[::-1])
    for _ in range(2):
        with pytest.raises(InvalidToken, match="signature does not verify"):
            verifier.verify(forged)
    uncached = TokenVerifier(ApiSettings(jwt_secret=SECRET), cache_size=0)
    assert uncached.verify(tokens[0]) is not uncached.verify(tokens[0])


async def test_a_cached_token_gets_401_over_http_once_it_expires(
    pool: AsyncConnectionPool[Any],
) -> None:
    token = make_token(expires_in=1.5)
    async with running_api(pool) as api:
        assert (await api.client.get(PREFIX, headers=bearer(token))).status_code == 200
        assert (await api.client.get(PREFIX, headers=bearer(token))).status_code == 200

        async def refused() -> bool:
            response = await api.client.get(PREFIX, headers=bearer(token))
            if response.status_code == 200:
                return False
            assert_problem(response, 401, detail="the token has expired")
            return True

        await wait_until(refused, timeout=10, interval=0.2, message="the token to expire")


# -- Time claims: RFC 7519 NumericDates of a sane range ------------------------------------------


def token_with(**claims: Any) -> str:
    """A token signed with the test secret, ``claims`` written as given (no exp added)."""
    payload: dict[str, Any] = {"sub": "alice", "permissions": list(ALL_PERMISSIONS)}
    payload |= claims
    return jwt.encode(payload, SECRET, algorithm="HS256")


@pytest.mark.parametrize(
    ("claims", "detail"),
    [
        pytest.param({"exp": "9999999999"}, "exp claim must be a JSON number", id="exp-string"),
        pytest.param({"exp": 1e300}, "exp claim is out of range", id="exp-1e300"),
        pytest.param({"exp": 10**400}, "exp claim is out of range", id="exp-huge-int"),
        pytest.param({"exp": float("nan")}, "exp claim is out of range", id="exp-nan"),
        pytest.param({"exp": float("inf")}, "exp claim is out of range", id="exp-inf"),
        pytest.param({"exp": float("-inf")}, "exp claim is out of range", id="exp-minus-inf"),
        pytest.param({"exp": True}, "exp claim must be a JSON number", id="exp-bool"),
        pytest.param({"exp": None}, "the token has no exp claim", id="exp-null"),
        pytest.param({"exp": [9999999999]}, "exp claim must be a JSON number", id="exp-list"),
        pytest.param({"exp": 32_503_680_001}, "exp claim is out of range", id="exp-after-3000"),
        pytest.param({"nbf": "0"}, "nbf claim must be a JSON number", id="nbf-string"),
        pytest.param({"nbf": -1}, "nbf claim is out of range", id="nbf-negative"),
        pytest.param({"iat": 1e300}, "iat claim is out of range", id="iat-1e300"),
        pytest.param({"iat": "now"}, "iat claim must be a JSON number", id="iat-string"),
        pytest.param({"iat": "FUTURE"}, "not valid yet (its iat", id="iat-future"),
    ],
)
async def test_time_claims_of_the_wrong_type_or_out_of_range_are_refused(
    api: Api, claims: dict[str, Any], detail: str
) -> None:
    """A string, a boolean, null, NaN, an infinity, 1e300 or a date after the year 3000 in
    exp, nbf or iat: 401 with a problem that names the claim, never a token that lives for
    ever (PyJWT alone takes int() of them: "9999999999" and 1e300 would pass)."""
    now = int(time.time())
    claims = {"exp": now + 300} | claims
    if claims.get("iat") == "FUTURE":
        claims["iat"] = now + 600
    response = await api.client.get(PREFIX, headers=bearer(token_with(**claims)))
    problem = assert_problem(response, 401, type="urn:jobfence:problem:unauthorized")
    assert detail in problem["detail"]
    assert 'error="invalid_token"' in response.headers["www-authenticate"]


async def test_time_claims_may_be_integers_or_fractions_of_seconds(api: Api) -> None:
    now = time.time()
    for claims in (
        {"exp": int(now) + 300},
        {"exp": now + 300.5, "nbf": now - 1.25, "iat": now - 0.5},
        {"exp": 32_503_680_000, "nbf": 0, "iat": 0},  # the bounds themselves
    ):
        response = await api.client.get(PREFIX, headers=bearer(token_with(**claims)))
        assert response.status_code == 200, (claims, response.text)


# -- The shared secret's entropy ------------------------------------------------------------------


WEAK_SECRETS = [
    pytest.param(" " * 40, "is only whitespace", id="40-spaces"),
    pytest.param("\t \n" * 12, "is only whitespace", id="whitespace-mix"),
    pytest.param("a" * 40, "shorter piece repeated", id="one-character"),
    pytest.param("ab" * 20, "shorter piece repeated", id="two-alternating"),
    pytest.param("0123456789abcdef" * 2, "shorter piece repeated", id="hex-digits-twice"),
    pytest.param("x" * 30 + "-secret-2", "too little entropy", id="padded-word"),
    pytest.param("é" * 15 + "x", "too short", id="15-characters-31-bytes"),
]


@pytest.mark.parametrize(("secret", "message"), WEAK_SECRETS)
def test_a_secret_without_real_entropy_is_refused_naming_the_variable(
    secret: str, message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        ApiSettings.from_env({"JOBFENCE_JWT_SECRET": secret})
    text = str(raised.value)
    assert text.startswith("JOBFENCE_JWT_SECRET ") and message in text, text
    assert secret not in text


@pytest.mark.parametrize(
    "secret",
    [
        pytest.param(SECRET, id="the-tests-secret"),
        pytest.param(secrets.token_hex(32), id="openssl-rand-hex-32"),
        pytest.param(secrets.token_hex(16), id="openssl-rand-hex-16"),
        pytest.param(secrets.token_urlsafe(32), id="openssl-rand-base64-32"),
        pytest.param(" " + secrets.token_hex(16) + " ", id="spaces-around-kept"),
    ],
)
def test_random_secrets_of_32_bytes_or_more_are_accepted(secret: str) -> None:
    assert ApiSettings.from_env({"JOBFENCE_JWT_SECRET": secret}).jwt_secret == secret


async def test_jobfence_api_refuses_a_secret_of_40_spaces_in_one_line_without_printing_it(
    database_url: str, tmp_path: Path
) -> None:
    proc = ApiProcess(database_url, tmp_path, JOBFENCE_JWT_SECRET=" " * 40)
    try:
        assert await proc.wait_exit() == 2
        lines = proc.output().strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("jobfence: error: JOBFENCE_JWT_SECRET is only whitespace"), lines
        assert " " * 10 not in lines[0]
    finally:
        proc.cleanup()


async def test_jobfence_api_refuses_a_repeated_secret_without_printing_it(
    database_url: str, tmp_path: Path
) -> None:
    weak = "hunter2!" * 5
    proc = ApiProcess(database_url, tmp_path, JOBFENCE_JWT_SECRET=weak)
    try:
        assert await proc.wait_exit() == 2
        output = proc.output()
        assert "jobfence: error: JOBFENCE_JWT_SECRET is a shorter piece repeated" in output
        assert "hunter2" not in output
    finally:
        proc.cleanup()
