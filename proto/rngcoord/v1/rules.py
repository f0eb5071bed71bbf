"""The contract's rules on field values, shared by the coordinator and the client.

Names, member ids, the uint64 range, lease sizes, cursors, seqs, ranks, world sizes and
fingerprints are checked here, once, by both sides: the server refuses a request that breaks a
rule with INVALID_ARGUMENT (reason INVALID_FIELD), and the client refuses to send it. Every
check raises :class:`RuleViolation`, a ``ValueError`` that names the field and shows the bad
value, so a message says exactly what to fix.

This module also names the rich error model's domain and the ErrorInfo metadata keys that
coordinator.proto's ``ErrorReason`` documents.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = [
    "ATTEST_EVERY",
    "DOMAIN",
    "MAX_FINGERPRINT",
    "MAX_OFFSET",
    "MAX_SECRET",
    "MAX_SEQ",
    "MAX_WORLD_SIZE",
    "MEMBER_ID_PATTERN",
    "MIN_SECRET",
    "NAME_PATTERN",
    "REPLICA_GROUP_PATTERN",
    "REPLICA_PATTERN",
    "U64_LIMIT",
    "RuleViolation",
    "check_attested_ops",
    "check_cursor",
    "check_fingerprint",
    "check_member_id",
    "check_member_secret",
    "check_name",
    "check_rank",
    "check_seq",
    "check_size",
    "check_u64",
    "check_world_size",
    "roundup4",
    "show",
]

DOMAIN: Final = "rngcoord.v1"
"""`google.rpc.ErrorInfo.domain` of every refusal."""

U64_LIMIT: Final = 1 << 64
"""One past the largest uint64."""

MAX_OFFSET: Final = U64_LIMIT - 4
"""The largest multiple of 4 below 2^64: no lease may end past it."""

MAX_SEQ: Final = (1 << 63) - 1
"""Lease seqs are stored unbiased in signed 64-bit columns; no job comes near this."""

MAX_WORLD_SIZE: Final = 1 << 20
"""The most ranks in one group: 1,048,576, ten times the largest jobs rngcoord is built for."""

MAX_FINGERPRINT: Final = 64
"""The longest op-sequence fingerprint, in bytes."""

MIN_SECRET: Final = 16
"""The shortest member credential, in bytes: 128 random bits."""

MAX_SECRET: Final = 64
"""The longest member credential, in bytes."""

NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@,\[\]-]{0,127}")
"""Job and group names: 1 to 128 characters, starting with a letter or digit."""

MEMBER_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""Member ids: one process incarnation, for example a UUID."""

REPLICA_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,47}")
"""Replica names (a torchft replica group, install's ``replica``): 1 to 48 characters."""

REPLICA_GROUP_PATTERN: Final = re.compile(
    rf"(?P<base>.+)/replica:(?P<replica>{REPLICA_PATTERN.pattern})(?:/seed:(?P<scope>\d+))?"
)
"""A replica's group: the group ``base`` among replica ``replica``'s groups, with a
manual_seed ``scope`` or not (the client names them; RecordQuorum accepts only these)."""


class RuleViolation(ValueError):
    """A field value that the contract does not allow.

    Args:
        field: the request field, e.g. ``"group"`` or ``"size"``.
        value: the value that was refused.
        rule: what the value must be, completing "it must ...".
    """

    def __init__(self, field: str, value: object, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"invalid {field} {show(value)}: it must {rule}")


def show(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters with "..." when longer."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def roundup4(n: int) -> int:
    """``n`` rounded up to a multiple of 4, the granularity of Philox offsets.

    >>> roundup4(0), roundup4(1), roundup4(8)
    (0, 4, 8)
    """
    return (n + 3) & ~3


def check_name(field: str, value: str) -> str:
    """A job or group name: :data:`NAME_PATTERN`."""
    if not isinstance(value, str) or NAME_PATTERN.fullmatch(value) is None:
        raise RuleViolation(
            field,
            value,
            "be 1 to 128 characters of A-Z a-z 0-9 . _ : / @ , [ ] -, starting with a letter "
            "or digit",
        )
    return value


def check_member_id(value: str) -> str:
    """A member id: :data:`MEMBER_ID_PATTERN`."""
    if not isinstance(value, str) or MEMBER_ID_PATTERN.fullmatch(value) is None:
        raise RuleViolation("member_id", value, "be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
    return value


def check_u64(field: str, value: int) -> int:
    """Any uint64."""
    if not isinstance(value, int) or not 0 <= value < U64_LIMIT:
        raise RuleViolation(field, value, "be in [0, 2^64)")
    return value


def check_world_size(value: int) -> int:
    """A world size in [1, :data:`MAX_WORLD_SIZE`]."""
    if not isinstance(value, int) or not 1 <= value <= MAX_WORLD_SIZE:
        raise RuleViolation("world_size", value, f"be in [1, {MAX_WORLD_SIZE}]")
    return value


def check_rank(value: int, world_size: int | None = None) -> int:
    """A rank: below ``world_size`` when that is given, else below the largest world size."""
    limit = MAX_WORLD_SIZE if world_size is None else world_size
    if not isinstance(value, int) or not 0 <= value < limit:
        raise RuleViolation("rank", value, f"be in [0, {limit})")
    return value


def check_seq(value: int) -> int:
    """A lease seq in [0, 2^63)."""
    if not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise RuleViolation("seq", value, "be in [0, 2^63)")
    return value


def check_size(value: int, field: str = "size") -> int:
    """A lease size: a multiple of 4 in [4, 2^64)."""
    if not isinstance(value, int) or not 4 <= value < U64_LIMIT or value % 4:
        raise RuleViolation(field, value, "be a multiple of 4 in [4, 2^64)")
    return value


def check_cursor(value: int, field: str = "cursor") -> int:
    """A stream position: a multiple of 4 in [0, 2^64 - 4]."""
    if not isinstance(value, int) or not 0 <= value <= MAX_OFFSET or value % 4:
        raise RuleViolation(field, value, "be a multiple of 4 in [0, 2^64 - 4]")
    return value


#: Members attest their op fingerprint every this many random ops (AttestRequest.ops).
ATTEST_EVERY: Final = 1024


def check_attested_ops(value: int) -> int:
    """An attested op count: a positive multiple of :data:`ATTEST_EVERY` below 2^63."""
    if not isinstance(value, int) or not 0 < value <= MAX_SEQ or value % ATTEST_EVERY:
        raise RuleViolation("ops", value, f"be a positive multiple of {ATTEST_EVERY} below 2^63")
    return value


def check_fingerprint(value: bytes) -> bytes:
    """An op-sequence fingerprint: 1 to :data:`MAX_FINGERPRINT` bytes."""
    if not isinstance(value, bytes) or not 1 <= len(value) <= MAX_FINGERPRINT:
        raise RuleViolation("fingerprint", value, f"be 1 to {MAX_FINGERPRINT} bytes")
    return value


def check_member_secret(value: bytes) -> bytes:
    """A member's credential: :data:`MIN_SECRET` to :data:`MAX_SECRET` bytes. A refusal names
    only its length, never its bytes."""
    if not isinstance(value, bytes) or not MIN_SECRET <= len(value) <= MAX_SECRET:
        shown = f"<{len(value)} bytes>" if isinstance(value, bytes) else type(value).__name__
        raise RuleViolation(
            "member_secret",
            shown,
            f"be {MIN_SECRET} to {MAX_SECRET} random bytes, drawn once per member_id and sent "
            "with every call as that member",
        )
    return value
