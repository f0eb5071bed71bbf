"""Lease management: one group's stream position, its leases, prefetch and fingerprints.

A :class:`LeaseManager` serves one (group, epoch) on one rank. Leases are contiguous from an
*anchor*, the pair (seq, cursor) where the epoch starts (seq 0 at the epoch's start cursor) or
where a Restore moved it: lease k starts where lease k - 1 ends.

Where an op's offsets land depends on nothing else (docs/design.md §2.6): the op's base is the
cursor, and the cursor then moves on by the op's size. Leases only authorise ranges: an op at
cursor ``c`` of size ``n`` needs every lease overlapping ``[c, c + n)``, and an op bigger than
a lease needs several consecutive ones.

**Lease sizes follow the work** (docs/design.md §6). The size of each lease is a pure function
of what every rank of the group knows when it asks, the op sequence so far, so that ranks agree
on every boundary and fingerprint while the number of RPCs stays bounded whatever the tensor
sizes. :class:`LeaseSchedule` gives lease k, asked for after an op that ended at cursor ``c``,
with the largest op so far of size ``m`` offsets::

    size = min(pow2ceil(max(min_size, 16 * m, 4 * (c - origin))), max_size)

where ``origin`` is where the schedule began (the epoch's start). Each lease holds at least 16
of the largest op and four times everything drawn so far, so leases grow geometrically with
the stream: a run that draws D offsets in all asks for O(log D) leases.

Worked example, a stream starting at cursor 0 with the default schedule (min 2^16, cap 2^50):

- op 1, a dropout on 8 x 64 x 4096 x 4096 elements, is n = 2^33 offsets. It needs lease 0,
  asked with m = 2^33 and c = 2^33: size = pow2ceil(max(2^16, 2^37, 2^35)) = 2^37. Lease 1
  is prefetched at once, with the same inputs: [2^37, 2^38).
- ops 2..16 (the same dropout) stay inside lease 0. Op 17 is the first to touch lease 1,
  which prefetches lease 2 with c = 17 * 2^33: size = pow2ceil(4 * 17 * 2^33) = 2^40, so
  lease 2 is [2^38, 2^38 + 2^40).
- op 33 touches lease 2 and prefetches lease 3 of 2^41, and so on. A training loop that draws
  S offsets per step, after k steps, asks for a lease that holds at least 4k steps: the
  Reserve RPCs per step fall as 1/k, until the cap.

Requests are deterministic, so that every rank sends the same requests with the same
fingerprints whatever the timing:

- when an op first touches lease ``k`` (lease ``k`` becomes *current*), every lease up to
  ``k + 1`` that has not been requested yet is requested: up to ``k`` because the op needs
  them, ``k + 1`` as the prefetch;
- joining the epoch, and a Restore, request the anchor lease the same way.

Each request carries the fingerprint of the op sequence up to and including the op (or event)
that caused it: a SHA-256 chain over (op name, global shape), truncated to 16 bytes. Ranks that
ran different random ops send different fingerprints (or sizes) for the same lease, and the
coordinator reports the divergence.

Fingerprints in requests catch a divergence within one lease, and a lease may hold many ops.
So every :data:`~rngcoord.v1.rules.ATTEST_EVERY` (1,024) ops since the anchor, each rank also
*attests* its fingerprint (an Attest RPC, sent by a background thread of its own: neither
the op nor a lease request waits for it). The coordinator keeps the first attestation of
each count and reports a divergence to the rank whose bytes differ, and to the others at
their next attestation or request:
ranks that ran different ops are caught within 1,024 ops (2,048 for the first to attest),
whatever the lease sizes, and so are ``shared_stream`` skews.

One background thread per manager sends the Reserve RPCs in seq order (the coordinator grants
lease ``k`` only after ``k - 1``). An op blocks only on a lease it needs that has not arrived.
A transient failure (:class:`CoordinatorUnavailable`) of a prefetch is retried when the lease is
needed; any other failure (divergence, a stale epoch...) is raised by the next op.
"""

from __future__ import annotations

import bisect
import hashlib
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rngcoord.client.connection import CoordinatorClient
from rngcoord.client.errors import (
    CoordinatorUnavailable,
    DivergenceError,
    RNGCoordError,
    refused,
)
from rngcoord.v1.rules import ATTEST_EVERY, MAX_OFFSET, RuleViolation, check_cursor, check_size
from rngcoord.v1.types import JoinResult, Lease

__all__ = [
    "FINGERPRINT_BYTES",
    "INITIAL_DIGEST",
    "LeaseManager",
    "LeaseSchedule",
    "LeaseStats",
    "StreamState",
    "check_lease_size",
]

#: The fingerprint chain's value before any op.
INITIAL_DIGEST = hashlib.sha256(b"rngcoord/v1/ops").digest()
FINGERPRINT_BYTES = 16
# Op keys a divergence report lists, to point at where the ranks' code paths differ.
_RECENT_OPS = 16


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
    """

    min_size: int = 1 << 16
    op_factor: int = 16
    growth: int = 4
    max_size: int = 1 << 50
    fixed: int | None = None

    def __post_init__(self) -> None:
        if self.fixed is not None:
            check_lease_size(self.fixed)

    def size(self, *, largest_op: int, consumed: int) -> int:
        """The size of a lease asked for when the largest op so far is `largest_op` offsets and
        `consumed` offsets have been drawn since the schedule began.

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


@dataclass
class _Request:
    seq: int
    size: int
    fingerprint: bytes
    future: Future[Lease]
    previous: Future[Lease] | None  # the request of seq - 1, unless seq is an anchor
    generation: int


@dataclass(frozen=True)
class _Attestation:
    anchor_seq: int
    ops: int
    fingerprint: bytes


@dataclass
class LeaseStats:
    """Counters of one manager.

    Attributes:
        reserves: Reserve RPCs sent (all in the background thread).
        received: Leases received.
        stalls: Ops that waited for a lease that had not arrived.
        attestations: Attest RPCs sent (every 1,024 ops, by the attestation thread).
        attest_failures: Attestations lost to an unreachable coordinator or a new epoch.
    """

    reserves: int = 0
    received: int = 0
    stalls: int = 0
    attestations: int = 0
    attest_failures: int = 0


class LeaseManager:
    """The leases of one group's epoch on one rank.

    Args:
        client: The coordinator connection.
        job: The job name.
        group: The group name.
        rank: This rank's position in the group.
        member_id: This tracker's member id in the epoch.
        joined: The epoch, seed and start cursor from JoinGroup.
        schedule: How big each lease is; equal on every rank of the group (different sizes
            are reported as a divergence). Default: :class:`LeaseSchedule`'s defaults.
        resume: Where to continue instead of the epoch's start, as :meth:`restore` does;
            ``None`` (default) starts at the epoch's start cursor.
        restore_timeout_s: How long a Restore waits for the group's other members to ask for
            it too. Default 60.0.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        job: str,
        group: str,
        *,
        rank: int,
        member_id: str,
        joined: JoinResult,
        schedule: LeaseSchedule | None = None,
        resume: StreamState | None = None,
        restore_timeout_s: float = 60.0,
    ) -> None:
        self._client = client
        self.restore_timeout_s = restore_timeout_s
        self.job = job
        self.group = group
        self.rank = rank
        self.member_id = member_id
        self.epoch = joined.epoch
        self.seed = joined.seed
        self.schedule = schedule if schedule is not None else LeaseSchedule()
        self.stats = LeaseStats()
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        # Attestations have a thread of their own, so that none delays a lease request.
        self._attestations: queue.SimpleQueue[_Attestation | None] = queue.SimpleQueue()
        self._attester: threading.Thread | None = None
        self._futures: dict[int, Future[Lease]] = {}
        self._requests: dict[int, _Request] = {}
        self._generation = 0
        self._fatal: RNGCoordError | None = None
        self._recent: deque[bytes] = deque(maxlen=_RECENT_OPS)
        # The requested leases: seq of the first, and the start of each, with the end of the
        # last; lease seqs[i] covers [starts[i], starts[i + 1]) (the last ends at `_next_start`).
        self._first_seq = 0
        self._starts: list[int] = []
        self._next_start = 0
        self._verified = -1  # every lease up to this seq has arrived and was checked
        self._limit = 0  # the end of lease _verified: ops ending at or before it are covered
        self._origin = joined.start
        self._anchor_seq = 0
        self._ops = 0  # random ops since the anchor
        self._largest_op = 0
        self._cursor = joined.start
        self._digest = INITIAL_DIGEST
        if resume is None:
            self._anchor(0, joined.start, INITIAL_DIGEST)
        else:
            self._origin, self._largest_op = resume.origin, resume.largest_op
            self.restore(resume.cursor, resume.digest)

    # -- the op path ---------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """Where the next op's offsets start."""
        return self._cursor

    @property
    def digest(self) -> bytes:
        """The fingerprint chain over every op so far (32 bytes)."""
        return self._digest

    @property
    def state(self) -> StreamState:
        """Where the stream stands, for a checkpoint."""
        return StreamState(self._cursor, self._digest, self._origin, self._largest_op)

    def advance(self, size: int, op_key: bytes) -> int:
        """Account one op of ``size`` offsets (a multiple of 4); return its base offset.

        ``op_key`` identifies the op (its name and global shape) for the fingerprint. In
        steady state this touches no lock and sends no RPC; it blocks only when the op needs
        a lease that has not arrived yet. If it raises, the cursor, the fingerprint chain and
        the schedule's state are unchanged (the requests it made stand, so the same op can be
        run again).
        """
        base = self._cursor
        stop = base + size
        digest = hashlib.sha256(self._digest + op_key).digest()
        largest = size if size > self._largest_op else self._largest_op
        if stop > self._limit:
            self._extend(stop, digest, largest)
        self._cursor = stop
        self._digest = digest
        self._largest_op = largest
        self._recent.append(op_key)
        self._ops += 1
        if self._ops % ATTEST_EVERY == 0:
            self._send_attestation(digest)
        return base

    def _seq_containing(self, offset: int) -> int:
        return self._first_seq + bisect.bisect_right(self._starts, offset) - 1

    def _bounds(self, seq: int) -> tuple[int, int]:
        i = seq - self._first_seq
        end = self._starts[i + 1] if i + 1 < len(self._starts) else self._next_start
        return self._starts[i], end

    def _extend(self, stop: int, digest: bytes, largest: int) -> None:
        """The slow path: request, and wait for, the leases an op ending at ``stop`` needs."""
        if self._fatal is not None:
            raise self._fatal
        while self._next_start < stop:
            self._request_next(digest, largest, stop)
        need = self._seq_containing(stop - 1)
        if self._first_seq + len(self._starts) <= need + 1:
            self._request_next(digest, largest, stop)  # the prefetch: lease need + 1
        for seq in range(self._verified + 1, need + 1):
            self._check(seq, self._await(seq))
            self._verified = seq
        self._limit = self._bounds(need)[1]
        if self._fatal is not None:  # set by the background thread meanwhile
            self._limit = -1
        # Forget what no later op can touch: every lease before `need`.
        drop = need - self._first_seq
        if drop > 0:
            del self._starts[:drop]
            for seq in range(self._first_seq, need):
                self._futures.pop(seq, None)
                self._requests.pop(seq, None)
            self._first_seq = need

    def _request_next(self, digest: bytes, largest: int, stop: int) -> None:
        """Request the lease after the last one requested, sized by the schedule."""
        size = self.schedule.size(largest_op=largest, consumed=max(0, stop - self._origin))
        room = MAX_OFFSET - self._next_start
        if 4 <= room < size:
            size = room  # the last lease of the offset space; the coordinator refuses beyond
        seq = self._first_seq + len(self._starts)
        self._starts.append(self._next_start)
        self._next_start += size
        self._submit(seq, size, digest[:FINGERPRINT_BYTES])

    def _submit(self, seq: int, size: int, fingerprint: bytes) -> None:
        anchor = not self._starts or seq == self._first_seq
        previous = None if anchor else self._futures.get(seq - 1)
        future: Future[Lease] = Future()
        self._futures[seq] = future
        request = _Request(seq, size, fingerprint, future, previous, self._generation)
        self._requests[seq] = request
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._run, name=f"rngcoord-leases[{self.group}]", daemon=True
            )
            self._worker.start()
        self._queue.put(request)

    def _await(self, seq: int) -> Lease:
        future = self._futures[seq]
        if not future.done():
            self.stats.stalls += 1
        try:
            return future.result()
        except CoordinatorUnavailable:
            # The prefetch failed while the coordinator was away: ask again, now that the
            # lease is needed; this raises if it is still unreachable.
            self._generation += 1
            last = self._first_seq + len(self._starts)
            for s in range(seq, last):
                old = self._requests[s]
                self._submit(s, old.size, old.fingerprint)
            return self._futures[seq].result()

    def _check(self, seq: int, lease: Lease) -> None:
        start, end = self._bounds(seq)
        if (lease.start, lease.end, lease.seed, lease.epoch) != (start, end, self.seed, self.epoch):
            error = RNGCoordError(
                f"lease seq {seq} of group {self.group!r} epoch {self.epoch} is "
                f"[{lease.start}, {lease.end}) with seed {lease.seed} (epoch {lease.epoch}), "
                f"but this rank expected [{start}, {end}) with seed {self.seed}: a member "
                "restored the group to another cursor; load the same checkpoint on every rank "
                "and call install() again"
            )
            raise self._fail(error)

    def _fail(self, error: RNGCoordError) -> RNGCoordError:
        """Make ``error`` final: every later op raises it. Returns it, for a divergence with
        this rank's latest ops added."""
        if isinstance(error, DivergenceError):
            ops = "; ".join(key.decode() for key in reversed(list(self._recent)))
            error = DivergenceError(
                f"{error.message} Latest random ops of rank {self.rank} in group "
                f"{self.group!r}, newest first: {ops or 'none'}",
                error.code,
                error.reason,
                error.metadata,
            )
        self._fatal = error
        # Sends the next op, whatever its size, down the slow path, which raises `error`.
        self._limit = -1
        return error

    # -- the background thread -----------------------------------------------------------

    def _send_attestation(self, digest: bytes) -> None:
        if self._attester is None:
            self._attester = threading.Thread(
                target=self._run_attestations, name=f"rngcoord-attest[{self.group}]", daemon=True
            )
            self._attester.start()
        self._attestations.put(
            _Attestation(self._anchor_seq, self._ops, digest[:FINGERPRINT_BYTES])
        )

    def _run_attestations(self) -> None:
        while (attestation := self._attestations.get()) is not None:
            self._attest(attestation)

    def _run(self) -> None:
        while (request := self._queue.get()) is not None:
            if request.generation != self._generation and not request.future.done():
                request.future.cancel()
                continue
            previous = request.previous
            if previous is not None and (previous.cancelled() or previous.exception()):
                # The coordinator would refuse this seq before the previous one exists.
                error = None if previous.cancelled() else previous.exception()
                request.future.set_exception(
                    error or CoordinatorUnavailable(f"lease seq {request.seq - 1} was cancelled")
                )
                continue
            try:
                self.stats.reserves += 1
                lease = self._client.reserve(
                    self.job,
                    self.group,
                    epoch=self.epoch,
                    seq=request.seq,
                    size=request.size,
                    fingerprint=request.fingerprint,
                    rank=self.rank,
                    member_id=self.member_id,
                )
            except CoordinatorUnavailable as e:
                request.future.set_exception(e)
            except RNGCoordError as e:
                request.future.set_exception(self._fail(e))
            except BaseException as e:  # never leave an op waiting on a dead thread
                request.future.set_exception(e)
                raise
            else:
                self.stats.received += 1
                request.future.set_result(lease)

    def _attest(self, attestation: _Attestation) -> None:
        try:
            self.stats.attestations += 1
            self._client.attest(
                self.job,
                self.group,
                epoch=self.epoch,
                anchor_seq=attestation.anchor_seq,
                ops=attestation.ops,
                fingerprint=attestation.fingerprint,
                rank=self.rank,
                member_id=self.member_id,
            )
        except DivergenceError as e:
            self._fail(e)
        except RNGCoordError:
            # Best effort: an unreachable coordinator or a new epoch shows up in the next
            # lease request, which is not optional.
            self.stats.attest_failures += 1

    # -- anchors: epoch start and Restore -------------------------------------------------

    def _anchor(self, seq: int, cursor: int, digest: bytes) -> None:
        """Start the stream at ``cursor`` with lease ``seq``, and request that lease."""
        self._anchor_seq = seq
        self._ops = 0
        self._first_seq = seq
        self._starts = []
        self._next_start = cursor
        self._cursor = cursor
        self._digest = digest
        self._verified = seq - 1
        self._limit = cursor if self._fatal is None else -1
        self._request_next(digest, self._largest_op, cursor)

    def restore(self, cursor: int, digest: bytes) -> None:
        """Continue the stream at ``cursor`` with fingerprint chain ``digest``.

        Sends a Restore for the first lease seq this rank has not requested: every rank of
        the group that restores at the same point of its op sequence names the same seq. The
        coordinator applies it once every member has asked (each rank's call is its vote, and
        returns then), and records it with the voters (audited).

        Raises:
            RestoreTimeoutError: not every member asked within ``restore_timeout_s``.
        """
        try:
            check_cursor(cursor)
        except RuleViolation as violation:
            raise refused(violation) from None
        if self._fatal is not None:
            raise self._fatal
        seq = self._first_seq + len(self._starts)
        self._client.restore(
            self.job,
            self.group,
            epoch=self.epoch,
            seq=seq,
            cursor=cursor,
            rank=self.rank,
            member_id=self.member_id,
            timeout_s=self.restore_timeout_s,
        )
        self._generation += 1
        self._anchor(seq, cursor, digest)

    def close(self, leave: bool = True) -> None:
        """Stop the background thread; with ``leave`` (default), leave the epoch."""
        wait_s = self._client.deadline_s * (self._client.retries + 2)
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=wait_s)
            self._worker = None
        if self._attester is not None:
            self._attestations.put(None)
            self._attester.join(timeout=wait_s)
            self._attester = None
        if leave:
            self._client.leave_group(
                self.job, self.group, epoch=self.epoch, rank=self.rank, member_id=self.member_id
            )
