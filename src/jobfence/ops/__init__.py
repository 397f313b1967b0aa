"""Ops management of dead letters: one service layer behind the HTTP API and the CLI.

Both edges only parse, call these functions and format; neither holds logic of its own. One job
per module: :mod:`~jobfence.ops.filters` (which dead letters a request means),
:mod:`~jobfence.ops.listing` (pages, counts, pending groups), :mod:`~jobfence.ops.item_cache`
(the list items cache and the JSON pages served from it), :mod:`~jobfence.ops.show` (one dead
letter whole), :mod:`~jobfence.ops.resolve` (replay or discard one), :mod:`~jobfence.ops.bulk`
(bulk replay) and :mod:`~jobfence.ops.errors`. Everything is importable from ``jobfence.ops``.
"""

from __future__ import annotations

from jobfence.ops.bulk import (
    BULK_ALL_NEEDED as BULK_ALL_NEEDED,
)
from jobfence.ops.bulk import (
    BULK_ALL_WITH_FILTER as BULK_ALL_WITH_FILTER,
)
from jobfence.ops.bulk import (
    BULK_CHUNK as BULK_CHUNK,
)
from jobfence.ops.bulk import (
    DEFAULT_BULK_MAX as DEFAULT_BULK_MAX,
)
from jobfence.ops.bulk import (
    MAX_BULK_ITEMS as MAX_BULK_ITEMS,
)
from jobfence.ops.bulk import (
    BulkItem as BulkItem,
)
from jobfence.ops.bulk import (
    BulkReplay as BulkReplay,
)
from jobfence.ops.bulk import (
    check_bulk_selection as check_bulk_selection,
)
from jobfence.ops.bulk import (
    get_bulk_replay as get_bulk_replay,
)
from jobfence.ops.bulk import (
    list_bulk_items as list_bulk_items,
)
from jobfence.ops.bulk import (
    run_bulk_replay as run_bulk_replay,
)
from jobfence.ops.bulk import (
    start_bulk_replay as start_bulk_replay,
)
from jobfence.ops.errors import (
    BulkReplayNotFound as BulkReplayNotFound,
)
from jobfence.ops.errors import (
    BulkTooLarge as BulkTooLarge,
)
from jobfence.ops.errors import (
    InvalidCursor as InvalidCursor,
)
from jobfence.ops.errors import (
    InvalidRequest as InvalidRequest,
)
from jobfence.ops.filters import (
    GROUP_KEYS as GROUP_KEYS,
)
from jobfence.ops.filters import (
    STATUSES as STATUSES,
)
from jobfence.ops.filters import (
    TIME_RULE as TIME_RULE,
)
from jobfence.ops.filters import (
    DeadLetterFilter as DeadLetterFilter,
)
from jobfence.ops.filters import (
    parse_time as parse_time,
)
from jobfence.ops.filters import (
    where_clause as where_clause,
)
from jobfence.ops.item_cache import (
    ItemCache as ItemCache,
)
from jobfence.ops.item_cache import (
    list_dead_letters_json as list_dead_letters_json,
)
from jobfence.ops.listing import (
    DEFAULT_PAGE as DEFAULT_PAGE,
)
from jobfence.ops.listing import (
    MAX_PAGE as MAX_PAGE,
)
from jobfence.ops.listing import (
    PAYLOAD_INLINE_LIMIT as PAYLOAD_INLINE_LIMIT,
)
from jobfence.ops.listing import (
    PAYLOAD_SUMMARY_CHARS as PAYLOAD_SUMMARY_CHARS,
)
from jobfence.ops.listing import (
    READ_IDS as READ_IDS,
)
from jobfence.ops.listing import (
    READ_ITEMS as READ_ITEMS,
)
from jobfence.ops.listing import (
    READ_RENDERED as READ_RENDERED,
)
from jobfence.ops.listing import (
    SQL as SQL,
)
from jobfence.ops.listing import (
    DeadLetterGroup as DeadLetterGroup,
)
from jobfence.ops.listing import (
    DeadLetterItem as DeadLetterItem,
)
from jobfence.ops.listing import (
    DeadLetterPage as DeadLetterPage,
)
from jobfence.ops.listing import (
    count_dead_letters as count_dead_letters,
)
from jobfence.ops.listing import (
    decode_cursor as decode_cursor,
)
from jobfence.ops.listing import (
    encode_cursor as encode_cursor,
)
from jobfence.ops.listing import (
    group_pending as group_pending,
)
from jobfence.ops.listing import (
    list_dead_letters as list_dead_letters,
)
from jobfence.ops.listing import (
    list_page_query as list_page_query,
)
from jobfence.ops.resolve import (
    discard as discard,
)
from jobfence.ops.resolve import (
    replay as replay,
)
from jobfence.ops.show import (
    DeadLetterDetail as DeadLetterDetail,
)
from jobfence.ops.show import (
    payload_body as payload_body,
)
from jobfence.ops.show import (
    show_dead_letter as show_dead_letter,
)
from jobfence.ops.show import (
    show_dead_letter_json as show_dead_letter_json,
)

__all__ = [
    "BulkItem",
    "BulkReplay",
    "BulkReplayNotFound",
    "BulkTooLarge",
    "DeadLetterDetail",
    "DeadLetterFilter",
    "DeadLetterGroup",
    "DeadLetterItem",
    "DeadLetterPage",
    "InvalidCursor",
    "InvalidRequest",
    "ItemCache",
    "check_bulk_selection",
    "parse_time",
    "count_dead_letters",
    "discard",
    "get_bulk_replay",
    "group_pending",
    "list_bulk_items",
    "list_dead_letters",
    "list_dead_letters_json",
    "list_page_query",
    "payload_body",
    "replay",
    "run_bulk_replay",
    "show_dead_letter",
    "show_dead_letter_json",
    "start_bulk_replay",
]
