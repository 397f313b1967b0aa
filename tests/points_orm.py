"""pointsapp's effect written through the SQLAlchemy ORM, in a sync handler's fence transaction."""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy import BigInteger, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import pointsapp
from jobfence import HardFailure, JobMeta
from jobfence.contrib.sqlalchemy import async_session_for, session_for


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "accounts"
    __table_args__ = {"schema": "public"}  # noqa: RUF012 - SQLAlchemy's declarative form
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    points: Mapped[int] = mapped_column(BigInteger)


class AwardRow(Base):
    __tablename__ = "awards"
    __table_args__ = {"schema": "public"}  # noqa: RUF012
    # The table has no primary key; the ORM needs one to map it: job_id is unique per award.
    job_id: Mapped[str] = mapped_column(String, primary_key=True)
    account_id: Mapped[int] = mapped_column(Integer)
    points: Mapped[int] = mapped_column(Integer)


def apply_award_orm(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
    """:func:`pointsapp.apply_award` with the ORM: an AwardRow and the account's balance."""
    if payload.mode == "transient":
        raise pointsapp.Flaky(f"ledger timeout on attempt {job.attempt}")
    if payload.mode == "hard":
        raise HardFailure("account is closed")
    with session_for(tx) as session:
        session.add(
            AwardRow(job_id=job.job_id, account_id=payload.account_id, points=payload.points)
        )
        account = session.get(Account, payload.account_id, with_for_update=True)
        assert account is not None
        account.points += payload.points


async def apply_award_orm_async(
    payload: pointsapp.Award, job: JobMeta, tx: psycopg.AsyncConnection[Any]
) -> None:
    """:func:`apply_award_orm` in an async handler, with an ``AsyncSession``."""
    if payload.mode == "transient":
        raise pointsapp.Flaky(f"ledger timeout on attempt {job.attempt}")
    if payload.mode == "hard":
        raise HardFailure("account is closed")
    async with async_session_for(tx) as session:
        session.add(
            AwardRow(job_id=job.job_id, account_id=payload.account_id, points=payload.points)
        )
        account = await session.get(Account, payload.account_id, with_for_update=True)
        assert account is not None
        account.points += payload.points
