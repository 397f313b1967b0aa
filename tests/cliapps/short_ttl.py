"""An app whose consumer keeps its fence for one hour: shorter than D3's minimum."""

from __future__ import annotations

from datetime import timedelta

from jobfence import App
from pointsapp import QUEUE, Award, apply_award

FENCE_TTL = timedelta(hours=1)

app = App()
app.consumer("short_fence", queue=QUEUE, schema=Award, fence_ttl=FENCE_TTL)(apply_award)

not_an_app = {"consumers": ["short_fence"]}
