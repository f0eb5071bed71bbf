"""What a stream's leases look like, apart from the manager that asks for them: the lease
sizes (:class:`LeaseSchedule`, a pure function of the op sequence so far, so that ranks agree
on every boundary), the attestation stride (:func:`attest_stride`), and the position a
checkpoint keeps (:class:`StreamState`). :mod:`rngcoord.client._leases` explains how they are
used, and re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rngcoord.client._errors import InvalidRequest, refused
from rngcoord.v1.rules import ATTEST_EVERY, RuleViolation, check_size

__all__ = ["LeaseSchedule", "StreamState", "attest_stride", "check_lease_size"]

# The largest attestation stride: a rank drawing faster than 2^40 ops per attest_min_s is not
# a real one (a clock that stands still, in a test).
_MAX_ATTEST_STRIDE = 2**40


def check_lease_size(lease_size: int) -> None:
    """Refuse a lease size the coordinator would refuse: a multiple of 4 in [4, 2^64)."""
    try:
        check_size(lease_size, "lease_size")
    except RuleViolation as violation:
        raise refused(violation) from None


@dataclass(frozen=True)
class LeaseSchedule:
    """How big each lease is: a pure function of the op sequence so far (see the module).

    Args:
        min_size: the smallest lease, a power of two. Default 2^16.
        op_factor: each lease holds at least this many of the largest op so far. Default 16.
        growth: each lease holds at least this many times what was drawn so far. Default 4.
        max_size: the largest lease, a power of two. Default 2^50: a new epoch starts above
            the last lease, so this bounds what an epoch change can leave unused.
        fixed: every lease this size instead (a multiple of 4), for tests and tools that want
            known boundaries. Default None: sizes follow the work.
        lookahead: leases fixed beyond the current one, which a rank may request before it
            needs them (see the module). Default 4.
    """

    min_size: int = 1 << 16
    op_factor: int = 16
    growth: int = 4
    max_size: int = 1 << 50
    fixed: int | None = None
    lookahead: int = 4

    def __post_init__(self) -> None:
        if self.fixed is not None:
            check_lease_size(self.fixed)
        if self.lookahead < 1:
            raise InvalidRequest(f"lookahead must be at least 1, got {self.lookahead}")

    def size(self, *, largest_op: int, consumed: int) -> int:
        """The size of a lease asked for when the largest op so far is `largest_op` offsets and
        `consumed` offsets have been drawn since the schedule began (or will have been, when
        the lease starts).

        >>> LeaseSchedule().size(largest_op=1 << 33, consumed=1 << 33)
        137438953472
        >>> LeaseSchedule(fixed=64).size(largest_op=1 << 33, consumed=0)
        64
        """
        if self.fixed is not None:
            return self.fixed
        want = max(self.min_size, self.op_factor * largest_op, self.growth * consumed)
        return min(self.max_size, 1 << (want - 1).bit_length())


@dataclass(frozen=True)
class StreamState:
    """Where a stream stands, as a checkpoint keeps it: enough to continue it bitwise.

    Args:
        cursor: where the next op's offsets start.
        digest: the fingerprint chain over every op so far.
        origin: where the lease schedule began (sizes depend on what was drawn since).
        largest_op: the largest op so far, in offsets.
    """

    cursor: int
    digest: bytes
    origin: int
    largest_op: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "offset": self.cursor,
            "digest": self.digest,
            "origin": self.origin,
            "largest_op": self.largest_op,
        }


def attest_stride(ops: int, interval_s: float, min_s: float) -> int:
    """The attestation stride after ``ops`` ops took ``interval_s`` seconds: the smallest
    power-of-two multiple of ATTEST_EVERY that this rate takes at least ``min_s`` to draw,
    at most 2^40 ops. Strides of this form nest, so two ranks always meet.

    >>> attest_stride(1024, 0.5, 30.0)  # 2,048 ops/s: 61,440 ops take 30 s -> 2^16
    65536
    >>> attest_stride(65536, 300.0, 30.0)  # slower now: 218 ops/s -> 6,554 ops -> 2^13
    8192
    >>> attest_stride(4096, 60.0, 0.0)  # min_s 0: every 1,024 ops
    1024
    """
    if min_s <= 0:
        return ATTEST_EVERY
    wanted = ops * min_s / interval_s if interval_s > 0 else float(_MAX_ATTEST_STRIDE)
    result = ATTEST_EVERY
    while result < wanted and result < _MAX_ATTEST_STRIDE:
        result *= 2
    return result
