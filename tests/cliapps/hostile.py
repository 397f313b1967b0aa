"""An app for the tests of what a producer can put into a worker's log: a card consumer whose
schema wants a number, and whose handler fails with an error text that holds an ANSI escape;
consumers whose schemas have a payload's keys in their errors (a mapping, ``extra="forbid"``);
a consumer whose handler changes a setting for its whole session (a plain ``SET``)."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel, ConfigDict

from jobfence import App, HardFailure, JobMeta

QUEUE = "cards"
ESCAPE_ERROR = "declined \x1b[31mred\x1b[0m"
SESSION_ZONE = "Pacific/Chatham"


class Card(BaseModel):
    n: int


async def charge(payload: Card, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    raise HardFailure(ESCAPE_ERROR)


class Tally(BaseModel):
    """Points per account number: the account numbers are the payload's keys."""

    points: dict[int, int]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    amount: int


async def accepted(payload: BaseModel, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    return None


async def set_zone(payload: Card, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    await tx.execute(f"SET TimeZone = '{SESSION_ZONE}'")  # not LOCAL: the whole session


app = App()
app.consumer("charge", queue=QUEUE, schema=Card)(charge)
app.consumer("tally", queue=QUEUE, schema=Tally)(accepted)
app.consumer("strict", queue=QUEUE, schema=Strict)(accepted)
app.consumer("zone", queue=QUEUE, schema=Card)(set_zone)
