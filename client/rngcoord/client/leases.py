"""Lease management: one group's stream position, its leases, prefetch and fingerprints.

A :class:`LeaseManager` serves one (group, epoch) on one rank. Leases have a fixed size ``L``
and are contiguous from an *anchor*, the pair (seq, cursor) where the epoch starts (seq 0 at
the epoch's start cursor) or where a Restore moved it::

    lease k covers [anchor_cursor + (k - anchor_seq) * L, ... + L)

Where an op's offsets land depends on nothing else (docs/design.md §2.6): the op's base is the
cursor, and the cursor then moves on by the op's size, ``roundup4(global numel)``. Leases
only authorise ranges: an op at cursor ``c`` of size ``n`` needs every lease overlapping
``[c, c + n)``, and an op bigger than a lease needs several consecutive ones.

Requests are deterministic, so that every rank sends the same requests with the same
fingerprints whatever the timing:

- when an op first touches lease ``k`` (lease ``k`` becomes *current*), every lease up to
  ``k + 1`` that has not been requested yet is requested: up to ``k`` because the op needs
  them, ``k + 1`` as the prefetch;
- joining the epoch, and a Restore, request the anchor lease the same way.

Each request carries the fingerprint of the op sequence up to and including the op (or
event) that caused it: a SHA-256 chain over (op name, global shape), truncated to 16 bytes.
Ranks that ran different random ops send different fingerprints for the same lease, and the
coordinator reports the divergence.

One background thread per manager sends the Reserve RPCs in seq order (the coordinator
grants lease ``k`` only after ``k - 1``). An op blocks only on a lease it needs that has not
arrived. A transient failure (:class:`CoordinatorUnavailable`) of a prefetch is retried when
the lease is needed; any other failure (divergence, a stale epoch...) is raised by the next op.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from rngcoord.client.connection import CoordinatorClient
from rngcoord.client.errors import (
    CoordinatorUnavailable,
    DivergenceError,
    RNGCoordError,
    refused,
)
from rngcoord.v1.rules import RuleViolation, check_cursor, check_size
from rngcoord.v1.types import JoinResult, Lease

#: The fingerprint chain's value before any op.
INITIAL_DIGEST = hashlib.sha256(b"rngcoord/v1/ops").digest()
FINGERPRINT_BYTES = 16
# Op keys a divergence report lists, to point at where the ranks' code paths differ.
_RECENT_OPS = 16


@dataclass
class _Request:
    seq: int
    fingerprint: bytes
    future: Future[Lease]
    previous: Future[Lease] | None  # the request of seq - 1, unless seq is an anchor
    generation: int


@dataclass
class LeaseStats:
    """Counters of one manager.

    Attributes:
        reserves: Reserve RPCs sent (all in the background thread).
        received: Leases received.
        stalls: Ops that waited for a lease that had not arrived.
    """

    reserves: int = 0
    received: int = 0
    stalls: int = 0


def check_lease_size(lease_size: int) -> None:
    """Refuse a lease size the coordinator would refuse: a multiple of 4 in [4, 2^64)."""
    try:
        check_size(lease_size, "lease_size")
    except RuleViolation as violation:
        raise refused(violation) from None


class LeaseManager:
    """The leases of one group's epoch on one rank.

    Args:
        client: The coordinator connection.
        job: The job name.
        group: The group name.
        rank: This rank's position in the group.
        member_id: This tracker's member id in the epoch.
        joined: The epoch, seed and start cursor from JoinGroup.
        lease_size: Offsets per lease, a multiple of 4; equal on every rank of the group
            (different sizes are reported as a divergence).
        resume: ``(cursor, digest)`` to continue from instead of the epoch's start, as
            :meth:`restore` does; ``None`` (default) starts at the epoch's start cursor.
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
        lease_size: int,
        resume: tuple[int, bytes] | None = None,
    ) -> None:
        check_lease_size(lease_size)
        self._client = client
        self.job = job
        self.group = group
        self.rank = rank
        self.member_id = member_id
        self.epoch = joined.epoch
        self.seed = joined.seed
        self.lease_size = lease_size
        self.stats = LeaseStats()
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._futures: dict[int, Future[Lease]] = {}
        self._fingerprints: dict[int, bytes] = {}
        self._generation = 0
        self._fatal: RNGCoordError | None = None
        self._recent: deque[bytes] = deque(maxlen=_RECENT_OPS)
        # The anchor and the op path's state; _anchor() sets them.
        self._anchor_seq = 0
        self._anchor_cursor = 0
        self._cursor = 0
        self._digest = INITIAL_DIGEST
        self._verified = -1  # every lease up to this seq has arrived and was checked
        self._limit = 0  # the end of lease _verified: ops ending at or before it are covered
        self._next_request = 0  # the first seq not requested yet
        if resume is None:
            self._anchor(0, joined.start, INITIAL_DIGEST)
        else:
            self.restore(*resume)

    # -- the op path ---------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """Where the next op's offsets start."""
        return self._cursor

    @property
    def digest(self) -> bytes:
        """The fingerprint chain over every op so far (32 bytes)."""
        return self._digest

    def advance(self, size: int, op_key: bytes) -> int:
        """Account one op of ``size`` offsets (a multiple of 4); return its base offset.

        ``op_key`` identifies the op (its name and global shape) for the fingerprint. In
        steady state this touches no lock and sends no RPC; it blocks only when the op needs
        a lease that has not arrived yet. If it raises, the cursor and the fingerprint chain
        are unchanged (the requests it made stand, so the same op can be run again).
        """
        base = self._cursor
        stop = base + size
        digest = hashlib.sha256(self._digest + op_key).digest()
        if stop > self._limit:
            self._extend(stop, digest)
        self._cursor = stop
        self._digest = digest
        self._recent.append(op_key)
        return base

    def _seq_of(self, offset: int) -> int:
        return self._anchor_seq + (offset - self._anchor_cursor) // self.lease_size

    def _lease_start(self, seq: int) -> int:
        return self._anchor_cursor + (seq - self._anchor_seq) * self.lease_size

    def _extend(self, stop: int, digest: bytes) -> None:
        """The slow path: request, and wait for, the leases an op ending at ``stop`` needs."""
        if self._fatal is not None:
            raise self._fatal
        last = self._seq_of(stop - 1)
        self._request_through(last + 1, digest)
        for seq in range(self._verified + 1, last + 1):
            self._check(seq, self._await(seq))
            self._verified = seq
        self._limit = self._lease_start(last + 1)
        if self._fatal is not None:  # set by the background thread meanwhile
            self._limit = -1
        for seq in [s for s in self._futures if s < last]:
            del self._futures[seq]
            self._fingerprints.pop(seq, None)

    def _request_through(self, seq: int, digest: bytes) -> None:
        """Request every lease up to ``seq`` not requested yet, fingerprinted ``digest``."""
        fingerprint = digest[:FINGERPRINT_BYTES]
        while self._next_request <= seq:
            self._fingerprints[self._next_request] = fingerprint
            self._submit(self._next_request)
            self._next_request += 1

    def _submit(self, seq: int) -> None:
        previous = None if seq == self._anchor_seq else self._futures.get(seq - 1)
        future: Future[Lease] = Future()
        self._futures[seq] = future
        request = _Request(seq, self._fingerprints[seq], future, previous, self._generation)
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
            for s in range(seq, self._next_request):
                self._submit(s)
            return self._futures[seq].result()

    def _check(self, seq: int, lease: Lease) -> None:
        start = self._lease_start(seq)
        if (lease.start, lease.end, lease.seed, lease.epoch) != (
            start,
            start + self.lease_size,
            self.seed,
            self.epoch,
        ):
            error = RNGCoordError(
                f"lease seq {seq} of group {self.group!r} epoch {self.epoch} is "
                f"[{lease.start}, {lease.end}) with seed {lease.seed} (epoch {lease.epoch}), "
                f"but this rank expected [{start}, {start + self.lease_size}) with seed "
                f"{self.seed}: a member restored the group to another cursor; load the same "
                "checkpoint on every rank and call install() again"
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
            )
        self._fatal = error
        # Sends the next op, whatever its size, down the slow path, which raises `error`.
        self._limit = -1
        return error

    # -- the background thread -----------------------------------------------------------

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
                    size=self.lease_size,
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

    # -- anchors: epoch start and Restore -------------------------------------------------

    def _anchor(self, seq: int, cursor: int, digest: bytes) -> None:
        """Start the stream at ``cursor`` with lease ``seq``, and request that lease."""
        self._anchor_seq = seq
        self._anchor_cursor = cursor
        self._cursor = cursor
        self._digest = digest
        self._verified = seq - 1
        self._limit = cursor if self._fatal is None else -1
        self._next_request = seq
        self._request_through(seq, digest)

    def restore(self, cursor: int, digest: bytes) -> None:
        """Continue the stream at ``cursor`` with fingerprint chain ``digest``.

        Sends a Restore for the first lease seq this rank has not requested: every rank of
        the group that restores at the same point of its op sequence names the same seq, and
        the coordinator records it once (audited).
        """
        try:
            check_cursor(cursor)
        except RuleViolation as violation:
            raise refused(violation) from None
        if self._fatal is not None:
            raise self._fatal
        seq = self._next_request
        self._client.restore(
            self.job,
            self.group,
            epoch=self.epoch,
            seq=seq,
            cursor=cursor,
            rank=self.rank,
            member_id=self.member_id,
        )
        self._generation += 1
        self._anchor(seq, cursor, digest)

    def close(self, leave: bool = True) -> None:
        """Stop the background thread; with ``leave`` (default), leave the epoch."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=self._client.deadline_s * (self._client.retries + 2))
            self._worker = None
        if leave:
            self._client.leave_group(
                self.job, self.group, epoch=self.epoch, rank=self.rank, member_id=self.member_id
            )
