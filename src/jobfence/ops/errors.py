"""The errors of the Ops service layer: a request it cannot serve, and bulk limits."""

from __future__ import annotations

from jobfence.errors import JobfenceError


class InvalidRequest(JobfenceError):
    """A request that cannot be served as asked (bad cursor, bad filter value).

    ``field`` names the parameter at fault by its name here (``cursor``, ``limit``,
    ``created_from``...), or is None; the message uses these names too. Each edge words it for
    its own audience: the HTTP API by its parameters, the CLI by its flags."""

    __module__ = "jobfence"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidCursor(InvalidRequest):
    """A cursor that no list page returned: mistyped, cut short, or made up."""

    __module__ = "jobfence"

    def __init__(self) -> None:
        super().__init__("cursor is not one a list page returned", field="cursor")


class BulkReplayNotFound(InvalidRequest):
    """No bulk replay has that id."""

    __module__ = "jobfence"


class BulkTooLarge(JobfenceError):
    """More dead letters match than the bulk replay's ``max_items`` allows."""

    __module__ = "jobfence"

    def __init__(self, matching: int, max_items: int) -> None:
        super().__init__(
            f"{matching} pending dead letters match, more than max_items={max_items}: "
            "narrow the filter or raise max_items"
        )
        self.matching = matching
        self.max_items = max_items
