"""Validation of request fields: names, ranks, sizes, offsets and other numbers.

Every check raises `InvalidArgument` naming the field and the bad value (its repr, truncated),
so a refused request says exactly what to fix. The limits live here too.
"""

from __future__ import annotations

import re

from rngcoord.server.errors import InvalidArgument

__all__ = [
    "MAX_OFFSET",
    "MAX_SEQ",
    "MAX_WORLD_SIZE",
    "U64_LIMIT",
    "check_cursor",
    "check_fingerprint",
    "check_member_id",
    "check_name",
    "check_rank",
    "check_seq",
    "check_size",
    "check_u64",
    "check_world_size",
]

U64_LIMIT = 1 << 64
"""One past the largest uint64."""

MAX_OFFSET = U64_LIMIT - 4
"""The largest multiple of 4 below 2^64: no lease may end past it."""

MAX_SEQ = (1 << 63) - 1
"""Lease seqs are stored unbiased in signed 64-bit columns; no job comes near this."""

MAX_WORLD_SIZE = 65536

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@,\[\]-]{0,127}")
_MEMBER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_MAX_FINGERPRINT = 64


def _show(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_name(field: str, value: str) -> str:
    """A job or group name: `[A-Za-z0-9][A-Za-z0-9._:/@,\\[\\]-]{0,127}`."""
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise InvalidArgument(
            f"invalid {field} {_show(value)}: it must be 1 to 128 characters of "
            "A-Z a-z 0-9 . _ : / @ , [ ] -, starting with a letter or digit"
        )
    return value


def check_member_id(value: str) -> str:
    """A member id: 1 to 128 characters of `[A-Za-z0-9._:-]`."""
    if not isinstance(value, str) or _MEMBER_ID.fullmatch(value) is None:
        raise InvalidArgument(
            f"invalid member_id {_show(value)}: it must be 1 to 128 characters of "
            "A-Z a-z 0-9 . _ : -"
        )
    return value


def check_u64(field: str, value: int) -> int:
    """Any uint64."""
    if not isinstance(value, int) or not 0 <= value < U64_LIMIT:
        raise InvalidArgument(f"invalid {field} {_show(value)}: it must be in [0, 2^64)")
    return value


def check_world_size(value: int) -> int:
    """A world size in [1, 65536]."""
    if not isinstance(value, int) or not 1 <= value <= MAX_WORLD_SIZE:
        raise InvalidArgument(
            f"invalid world_size {_show(value)}: it must be in [1, {MAX_WORLD_SIZE}]"
        )
    return value


def check_rank(value: int, world_size: int | None = None) -> int:
    """A rank: below `world_size` when that is given, else below the largest world size."""
    limit = MAX_WORLD_SIZE if world_size is None else world_size
    if not isinstance(value, int) or not 0 <= value < limit:
        raise InvalidArgument(f"invalid rank {_show(value)}: it must be in [0, {limit})")
    return value


def check_seq(value: int) -> int:
    """A lease seq in [0, 2^63)."""
    if not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise InvalidArgument(f"invalid seq {_show(value)}: it must be in [0, 2^63)")
    return value


def check_size(value: int) -> int:
    """A lease size: a multiple of 4 in [4, 2^64)."""
    if not isinstance(value, int) or not 4 <= value < U64_LIMIT or value % 4:
        raise InvalidArgument(
            f"invalid size {_show(value)}: it must be a multiple of 4 in [4, 2^64)"
        )
    return value


def check_cursor(value: int) -> int:
    """A stream position: a multiple of 4 in [0, 2^64 - 4]."""
    if not isinstance(value, int) or not 0 <= value <= MAX_OFFSET or value % 4:
        raise InvalidArgument(
            f"invalid cursor {_show(value)}: it must be a multiple of 4 in [0, 2^64 - 4]"
        )
    return value


def check_fingerprint(value: bytes) -> bytes:
    """An op-sequence fingerprint: 1 to 64 bytes."""
    if not isinstance(value, bytes) or not 1 <= len(value) <= _MAX_FINGERPRINT:
        raise InvalidArgument(
            f"invalid fingerprint {_show(value)}: it must be 1 to {_MAX_FINGERPRINT} bytes"
        )
    return value
