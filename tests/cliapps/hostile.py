"""An app for the tests of what a producer can put into a worker's log: a card consumer whose
schema wants a number, and whose handler fails with an error text that holds an ANSI escape."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel

from jobfence import App, HardFailure, JobMeta

QUEUE = "cards"
ESCAPE_ERROR = "declined \x1b[31mred\x1b[0m"


class Card(BaseModel):
    n: int


async def charge(payload: Card, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    raise HardFailure(ESCAPE_ERROR)


app = App()
app.consumer("charge", queue=QUEUE, schema=Card)(charge)
