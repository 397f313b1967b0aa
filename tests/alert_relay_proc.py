"""``jobfence alert-relay`` in a subprocess, made to stop dead after Better Stack answered.

    python tests/alert_relay_proc.py MARKER

Runs the real command (configuration from the environment), except that recording an incident
is replaced by: write ``MARKER`` (``<alert id> <incident id>``, atomically) and block forever.
Better Stack has then created the incident and answered 201, and the relay has not recorded
it: the test SIGKILLs the process right there.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from jobfence import cli
from jobfence.alerts.relay import AlertRelay


def main(marker: Path) -> int:
    async def stop_before_recording(
        self: AlertRelay, conn: Any, alert: Any, incident_id: str, request: Any
    ) -> None:
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(f"{alert.id} {incident_id}\n")
        tmp.rename(marker)
        await asyncio.Event().wait()  # until SIGKILL

    AlertRelay._record_sent = stop_before_recording  # type: ignore[method-assign]
    return cli.main(["alert-relay", "--poll-seconds", "0.05"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1])))
