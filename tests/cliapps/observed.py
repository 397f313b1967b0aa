"""The points app with fast retries, for tests that watch a real worker's metrics and logs.

``mode="leak"`` makes the handler log the configured secrets (as a careless handler or client
library might) and fail hard with them in its error message: redaction must hide them all.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from psycopg import AsyncConnection

from jobfence import App, HardFailure, JobMeta, RetryPolicy
from pointsapp import QUEUE, Award, apply_award

OTHER_QUEUE = "other"
FAST_RETRY = RetryPolicy(
    max_retries=1, base_seconds=0.05, cap_seconds=0.1, rationale="tests: retry at once"
)

log = logging.getLogger("observed.handler")


async def observed_award(payload: Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    if payload.mode == "leak":
        token = os.environ.get("JOBFENCE_BETTERSTACK_TOKEN", "")
        url = os.environ.get("JOBFENCE_DATABASE_URL", "")
        jwt = os.environ.get("JOBFENCE_JWT_SECRET", "")
        log.error("calling Better Stack with Bearer %s from %s (jwt %s)", token, url, jwt)
        log.warning("request failed", extra={"authorization": f"Bearer {token}", "dsn": url})
        try:
            raise RuntimeError(f"401 Unauthorized for token {token} at {url}")
        except RuntimeError:
            log.exception("client error")
        raise HardFailure(f"Better Stack rejected token {token}")
    await apply_award(payload, job, tx)


app = App()
app.consumer("award_points", queue=QUEUE, schema=Award, retry=FAST_RETRY)(observed_award)
app.consumer("other_points", queue=OTHER_QUEUE, schema=Award)(apply_award)
