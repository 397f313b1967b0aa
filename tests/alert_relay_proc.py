"""``jobfence alert-relay`` in a subprocess, made to stop dead after Better Stack answered.

    python tests/alert_relay_proc.py MARKER [STEP]

Runs the real command (configuration from the environment), except that recording the answer
of one step (STEP: ``create``, the default, ``resolve`` or ``escalate``) is replaced by: write
``MARKER`` (``<our id> <incident id>``, atomically) and block forever. Better Stack has then
done the step and answered, and the relay has not recorded it: the test SIGKILLs the process
right there.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from jobfence import cli
from jobfence.alerts.relay import AlertRelay

# The method that records each step's answer, and how to read (our id, incident id) from its
# arguments.
STEPS = {
    "create": ("_record_sent", lambda args: (args[1].id, args[2])),
    "resolve": ("_record_resolved", lambda args: (args[1], args[2].incident_id)),
    "escalate": ("_record_escalated", lambda args: (args[1].id, args[2].incident_id)),
}


def main(marker: Path, step: str) -> int:
    name, ids = STEPS[step]

    async def stop_before_recording(self: AlertRelay, *args: Any, **kwargs: Any) -> None:
        ours, incident_id = ids(args)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(f"{ours} {incident_id}\n")
        tmp.rename(marker)
        await asyncio.Event().wait()  # until SIGKILL

    setattr(AlertRelay, name, stop_before_recording)
    return cli.main(["alert-relay", "--poll-seconds", "0.05"])


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else "create"))
