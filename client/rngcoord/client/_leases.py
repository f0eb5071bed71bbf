"""Lease management: one group's stream position, its leases, prefetch and fingerprints.

A :class:`LeaseManager` serves one (group, epoch) on one rank. Leases are contiguous from an
*anchor*, the pair (seq, cursor) where the epoch starts (seq 0 at the epoch's start cursor) or
where a Restore moved it: lease k starts where lease k - 1 ends.

Where an op's offsets land depends on nothing else (docs/design.md §2.6): the op's base is the
cursor, and the cursor then moves on by the op's size. Leases only authorise ranges: an op at
cursor ``c`` of size ``n`` needs every lease overlapping ``[c, c + n)``, and an op bigger than
a lease needs several consecutive ones.

**Lease sizes follow the work** (docs/design.md §6). The size of each lease is a pure function
of the op sequence, so that ranks agree on every boundary and fingerprint while the number of
RPCs stays bounded whatever the tensor sizes. :class:`LeaseSchedule` gives lease j, fixed by
an op that ended at cursor ``c`` with the largest op so far of size ``m`` offsets, from the
lease's start ``s``::

    size = min(pow2ceil(max(min_size, 16 * m, 4 * (max(c, s) - origin))), max_size)

where ``origin`` is where the schedule began (the epoch's start). Each lease holds at least 16
of the largest op, and four times everything drawn before it starts, so leases grow
geometrically with the stream: a run that draws D offsets in all asks for O(log D) leases.

**Which leases, fixed when** (docs/design.md §6.2). Lease j's request (seq, size, fingerprint)
is *fixed* at a point of the op sequence, never at a time:

- joining the epoch, or a Restore, makes the anchor lease ``a`` current and fixes leases
  ``a .. a + L`` (``L`` = :attr:`LeaseSchedule.lookahead`, 4);
- an op that first touches lease ``k`` (lease ``k`` becomes *current*) fixes every lease up
  to ``k + L`` not fixed yet, and an op bigger than what is fixed fixes what it needs.

Each request carries the fingerprint of the op sequence up to and including the op (or event)
that fixed it: a SHA-256 chain over (op name, global shape), truncated to 16 bytes. So every
rank fixes the same requests, whatever its timing. *When* a fixed request is sent is the only
thing timing decides: lease ``k + 1`` goes out when lease ``k`` becomes current (the
prefetch), and further fixed leases as soon as the leases sent would last less than
``prefetch_s`` (30 s) at the rate this rank draws offsets. So a coordinator restart shorter
than that never blocks an op, and ranks that send at different times send the same requests.

Worked example, a stream starting at cursor 0 with the default schedule (min 2^16, cap 2^50,
lookahead 4):

- the join fixes leases 0..4 from ``m = 0``, each four times its start: [0, 2^16),
  [2^16, 327680), [327680, 2424832), [2424832, 19202048), [19202048, 153419776); lease 0 is
  sent.
- op 1, a dropout on 8 x 64 x 4096 x 4096 elements, is n = 2^33 offsets, beyond what is fixed.
  It fixes lease 5 with m = c = 2^33: size = pow2ceil(max(2^16, 2^37, 2^35)) = 2^37, so
  lease 5 is [153419776, 153419776 + 2^37) and holds the op's end. Lease 5 is now current,
  which fixes leases 6..9 (lease 6: 4 x its start rounds up to 2^40), and leases 0..6 go out.
- ops 2..16 (the same dropout) stay inside lease 5; op 17 makes lease 6 current, fixes
  lease 10 and sends lease 7, and so on. A training loop that draws S offsets per step asks,
  after k steps, for leases that hold at least 4k steps each: the Reserve RPCs per step fall
  as 1/k, until the cap.

Fingerprints in requests catch a divergence within one lease, and a lease may hold many ops.
So each rank also *attests* its fingerprint (an Attest RPC, sent by a background thread of its
own: neither the op nor a lease request waits for it) at every multiple of its *stride* of
ops since the anchor. The stride starts at :data:`~rngcoord.v1.rules.ATTEST_EVERY` (1,024)
and is always a power-of-two multiple of it: after each attestation it becomes the smallest
one that the rank's latest rate of ops takes at least ``attest_min_s`` (30 s) to draw
(:func:`attest_stride`). So a rank attests about once per 30 to 60 s however fast it draws,
and any two ranks, whatever their strides, both attest every multiple of the larger one. The
coordinator keeps the first attestation of each count and reports a divergence to the rank
whose bytes differ, and to the others at their next attestation or request: ranks that ran
different ops are caught within 1,024 ops or about ``2 * attest_min_s`` of drawing, whichever
comes later (twice that for the first to attest), whatever the lease sizes, and so are
``shared_stream`` skews (docs/design.md §6.1).

One background thread per manager sends the Reserve RPCs in seq order (the coordinator grants
lease ``k`` only after ``k - 1``). An op blocks only on a lease it needs that has not arrived.

**Outages** (docs/design.md §6.2). The client retries every call through an outage, for up to
its outage budget (``install(outage_s=...)``, 10 minutes by default): ops keep drawing from
the leases held, an op that needs a lease that has not arrived waits for it, attestations
queue behind each other, and leaving the group at :meth:`LeaseManager.close` gives up at the
budget with a warning. Only a lease request that fails past the budget raises
:class:`CoordinatorUnavailable`, from the op that needs the lease (asked once more then, in
case the coordinator came back meanwhile); any other failure (divergence, a stale epoch...)
is raised by the next op.

**Heartbeat** (docs/design.md §7.1). With big leases a rank may go minutes without a call, so
a replaced epoch (another launch's takeover, a torchelastic restart) would be noticed late.
Rank 0 of each group asks for the group's epoch every ``heartbeat_s`` (15 s) with a GetGroup
of one member, and a newer epoch makes its next op raise :class:`StaleEpochError`; the
launcher then stops the job. One rank per group keeps the cost at one read per group per
heartbeat, whatever the world size. The other ranks learn at their next call: a lease, or an
attestation.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from rngcoord.client._connection import CoordinatorClient
from rngcoord.client._errors import (
    CoordinatorUnavailable,
    DivergenceError,
    RNGCoordError,
    StaleEpochError,
    refused,
)
from rngcoord.client._schedule import LeaseSchedule, StreamState, attest_stride, check_lease_size
from rngcoord.v1.rules import ATTEST_EVERY, MAX_OFFSET, RuleViolation, check_cursor
from rngcoord.v1.types import JoinResult, Lease

__all__ = [
    "ATTEST_MIN_S",
    "FINGERPRINT_BYTES",
    "HEARTBEAT_S",
    "INITIAL_DIGEST",
    "LeaseManager",
    "LeaseSchedule",
    "LeaseStats",
    "StreamState",
    "attest_stride",
    "check_lease_size",
]

#: The fingerprint chain's value before any op.
INITIAL_DIGEST = hashlib.sha256(b"rngcoord/v1/ops").digest()
FINGERPRINT_BYTES = 16
# Op keys a divergence report lists, to point at where the ranks' code paths differ: enough to
# reach back past the lookahead's lag with small leases.
_RECENT_OPS = 32
#: Default seconds between rank 0's epoch checks (LeaseManager(heartbeat_s=)).
HEARTBEAT_S = 15.0
#: Default least seconds between a rank's attestations (LeaseManager(attest_min_s=)).
ATTEST_MIN_S = 30.0
# The draw rate is measured over this much recent time (and at least this little).
_RATE_WINDOW_S = 60.0
_RATE_MIN_S = 0.25

logger = logging.getLogger("rngcoord.client.leases")


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
        longest_stall_s: The longest such wait, in seconds.
        attestations: Attest RPCs sent (by the attestation thread).
        attest_failures: Attestations lost to an outage past the budget or a new epoch.
    """

    reserves: int = 0
    received: int = 0
    stalls: int = 0
    longest_stall_s: float = 0.0
    attestations: int = 0
    attest_failures: int = 0


class LeaseManager:
    """The leases of one group's epoch on one rank.

    Args:
        client: The coordinator connection; its ``outage_s`` is how long an outage may last
            before an op that needs a new lease fails.
        job: The job name.
        group: The group name.
        rank: This rank's position in the group.
        member_id: This tracker's member id in the epoch.
        joined: The epoch, seed and start cursor from JoinGroup.
        schedule: How big each lease is, and how far ahead leases are fixed; equal on every
            rank of the group (different sizes are reported as a divergence). Default:
            :class:`LeaseSchedule`'s defaults.
        resume: Where to continue instead of the epoch's start, as :meth:`restore` does;
            ``None`` (default) starts at the epoch's start cursor.
        resume_from: The job whose checkpoint ``resume`` comes from, when it is another
            job's (the restore record names it). Default ``""``: this job's.
        restore_timeout_s: How long a Restore waits for the group's other members to ask for
            it too. Default 60.0.
        prefetch_s: Send fixed lease requests early enough that the leases sent last this
            many seconds at the rate this rank draws offsets, so that an outage this long
            blocks no op (within the schedule's lookahead). Timing decides only when a request
            goes out, never what it asks. Default 30.0.
        heartbeat_s: On rank 0, check the group's epoch this often, so that a replaced
            epoch fails the next op within about this long; 0 turns it off. Other ranks
            send no heartbeat. Default 15.0.
        attest_min_s: Attest about this often at most: the attestation stride doubles after
            an interval shorter than this (see the module docstring). 0 attests every
            1,024 ops. Default 30.0.
        clock: Seconds, for the time rules of prefetch and attestation (not the heartbeat).
            Default :func:`time.monotonic`.
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
        resume_from: str = "",
        restore_timeout_s: float = 60.0,
        prefetch_s: float = 30.0,
        heartbeat_s: float = HEARTBEAT_S,
        attest_min_s: float = ATTEST_MIN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self.restore_timeout_s = restore_timeout_s
        self.prefetch_s = prefetch_s
        self.attest_min_s = attest_min_s
        self._clock = clock
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
        # Set by close(): the threads stop retrying through an outage.
        self._closing = threading.Event()
        self._futures: dict[int, Future[Lease]] = {}
        self._requests: dict[int, _Request] = {}
        self._generation = 0
        self._fatal: RNGCoordError | None = None
        self._recent: deque[bytes] = deque(maxlen=_RECENT_OPS)
        # (size, op key) of each op since record_ops(); None while not recording.
        self._recorded: list[tuple[int, bytes]] | None = None
        # The fixed leases: seq of the first, and the start of each, with the end of the
        # last; lease seqs[i] covers [starts[i], starts[i + 1]) (the last ends at `_next_start`).
        # `_plans` holds the size and fingerprint of each fixed lease.
        self._first_seq = 0
        self._starts: list[int] = []
        self._next_start = 0
        self._plans: dict[int, tuple[int, bytes]] = {}
        self._sent = -1  # every fixed lease up to this seq has been sent
        self._current = -1  # the highest lease an op (or the anchor) has touched
        self._verified = -1  # every lease up to this seq has arrived and was checked
        # Ops ending at or before this go straight through: the end of lease _verified, or
        # earlier, where the op path looks again at what to send.
        self._limit = 0
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, cursor)
        self._origin = joined.start
        self._anchor_seq = 0
        self._ops = 0  # random ops since the anchor
        self._attest_stride = ATTEST_EVERY
        # When, and at which op count, this rank last attested (or its stream began): the
        # rate that sizes the next stride. After a stride grows, the next multiple of it may
        # come sooner than a whole stride, so the count is kept rather than assumed.
        self._attested_at = clock()
        self._attested_ops = 0
        self._largest_op = 0
        self._cursor = joined.start
        self._digest = INITIAL_DIGEST
        self._heartbeat: threading.Thread | None = None
        if rank == 0 and heartbeat_s > 0:
            self._heartbeat = threading.Thread(
                target=self._run_heartbeat,
                args=(heartbeat_s,),
                name=f"rngcoord-heartbeat[{group}]",
                daemon=True,
            )
            self._heartbeat.start()
        if resume is None:
            self._anchor(0, joined.start, INITIAL_DIGEST)
        else:
            self._origin, self._largest_op = resume.origin, resume.largest_op
            self.restore(resume.cursor, resume.digest, from_job=resume_from)

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
    def ops(self) -> int:
        """Random ops drawn since the stream's anchor: its join, or its latest Restore."""
        return self._ops

    def record_ops(self) -> None:
        """Keep the size and op key of every op from now on (a later call starts over), for
        :meth:`recorded_ops`: rngcoord.client.torchft replays a step's ops onto a peer's
        position when a heal lands after the step drew."""
        self._recorded = []

    def recorded_ops(self) -> list[tuple[int, bytes]]:
        """(size, op key) of each op since :meth:`record_ops`, oldest first."""
        return list(self._recorded or ())

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
        if self._recorded is not None:
            self._recorded.append((size, op_key))
        # Ops that draw nothing are in the fingerprint but not counted: every counted op then
        # draws at least 4 offsets, which is how the coordinator bounds an attested count
        # by the leases granted (docs/design.md §6.1).
        if size:
            self._ops += 1
            if self._ops % self._attest_stride == 0:
                self._send_attestation(digest)
        return base

    def _seq_containing(self, offset: int) -> int:
        return self._first_seq + bisect.bisect_right(self._starts, offset) - 1

    def _bounds(self, seq: int) -> tuple[int, int]:
        i = seq - self._first_seq
        end = self._starts[i + 1] if i + 1 < len(self._starts) else self._next_start
        return self._starts[i], end

    def _extend(self, stop: int, digest: bytes, largest: int) -> None:
        """The slow path: fix, send and wait for the leases an op ending at ``stop`` needs,
        and send what the time rule asks for."""
        if self._fatal is not None:
            raise self._fatal
        while self._next_start < stop:
            self._fix_next(digest, largest, stop)
        need = self._seq_containing(stop - 1)
        if need > self._current:
            self._current = need
            self._fix_through(need + self.schedule.lookahead, digest, largest, stop)
        self._send_through(max(need + 1, self._wanted(stop)))
        for seq in range(self._verified + 1, need + 1):
            self._check(seq, self._await(seq))
            self._verified = seq
        limit = self._bounds(need)[1]
        sent_end = self._bounds(self._sent)[1]
        if self._sent < self._first_seq + len(self._starts) - 1 and sent_end > stop:
            # More is fixed than sent: look again once half of what is sent ahead is drawn,
            # in case the rate rose.
            limit = min(limit, stop + (sent_end - stop) // 2)
        self._limit = limit
        if self._fatal is not None:  # set by the background thread meanwhile
            self._limit = -1
        # Forget what no later op can touch: every lease before `need`.
        drop = need - self._first_seq
        if drop > 0:
            del self._starts[:drop]
            for seq in range(self._first_seq, need):
                self._futures.pop(seq, None)
                self._requests.pop(seq, None)
                self._plans.pop(seq, None)
            self._first_seq = need

    def _fix_through(self, seq: int, digest: bytes, largest: int, stop: int) -> None:
        while self._first_seq + len(self._starts) <= seq:
            self._fix_next(digest, largest, stop)

    def _fix_next(self, digest: bytes, largest: int, stop: int) -> None:
        """Fix the lease after the last one fixed, sized by the schedule as if everything
        before it were drawn by the time it is needed (its size depends on no timing)."""
        start = self._next_start
        consumed = max(0, max(stop, start) - self._origin)
        size = self.schedule.size(largest_op=largest, consumed=consumed)
        room = MAX_OFFSET - start
        if 4 <= room < size:
            size = room  # the last lease of the offset space; the coordinator refuses beyond
        seq = self._first_seq + len(self._starts)
        self._starts.append(start)
        self._next_start = start + size
        self._plans[seq] = (size, digest[:FINGERPRINT_BYTES])

    def _wanted(self, stop: int) -> int:
        """The last fixed lease to send now so that what is sent lasts ``prefetch_s`` at the
        recent draw rate (-1 while the rate is unknown)."""
        now = self._clock()
        samples = self._samples
        samples.append((now, stop))
        while len(samples) > 2 and now - samples[1][0] >= _RATE_WINDOW_S:
            samples.popleft()
        then, drawn_from = samples[0]
        if now - then < _RATE_MIN_S:
            return -1
        want = (stop - drawn_from) / (now - then) * self.prefetch_s
        last = self._first_seq + len(self._starts) - 1
        seq = max(self._sent, self._first_seq)
        while seq < last and self._bounds(seq)[1] - stop < want:
            seq += 1
        return seq

    def _send_through(self, seq: int) -> None:
        """Send every fixed lease up to ``seq`` not sent yet, in seq order."""
        seq = min(seq, self._first_seq + len(self._starts) - 1)
        while self._sent < seq:
            self._sent += 1
            size, fingerprint = self._plans[self._sent]
            self._submit(self._sent, size, fingerprint)

    def _submit(self, seq: int, size: int, fingerprint: bytes) -> None:
        previous = None if seq == self._anchor_seq else self._futures.get(seq - 1)
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
        waited = time.monotonic()
        if not future.done():
            self.stats.stalls += 1
        try:
            return future.result()
        except CoordinatorUnavailable:
            # The request failed past the outage budget, maybe long before the lease was
            # needed: ask once more, in case the coordinator is back (an outage still on
            # raises at once).
            self._generation += 1
            for s in range(seq, self._sent + 1):
                old = self._requests[s]
                self._submit(s, old.size, old.fingerprint)
            return self._futures[seq].result()
        finally:
            self.stats.longest_stall_s = max(self.stats.longest_stall_s, time.monotonic() - waited)

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

    # -- the background threads ----------------------------------------------------------

    def _send_attestation(self, digest: bytes) -> None:
        now = self._clock()
        self._attest_stride = attest_stride(
            self._ops - self._attested_ops, now - self._attested_at, self.attest_min_s
        )
        self._attested_at, self._attested_ops = now, self._ops
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
            if (
                request.generation != self._generation or self._closing.is_set()
            ) and not request.future.done():
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
                    cancel=self._closing,
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
                cancel=self._closing,
            )
        except (DivergenceError, StaleEpochError) as e:
            self._fail(e)
        except RNGCoordError:
            # Never fatal: the client retried it through the outage budget, and a new epoch
            # or an outage past the budget shows up in the next lease request, which is not
            # optional.
            self.stats.attest_failures += 1

    def _run_heartbeat(self, every_s: float) -> None:
        while not self._closing.wait(every_s) and self._fatal is None:
            try:
                info = self._client.get_group(self.job, self.group, members_limit=1)
            except RNGCoordError:
                continue  # an outage or a refusal: the next lease request reports it
            except Exception as e:
                # The client was closed under the call (grpc: "Cannot invoke RPC on closed
                # channel"). The heartbeat only hastens news the next call brings anyway, so
                # it never raises in a thread of the job's.
                logger.debug("rngcoord: heartbeat of group %r stops: %s", self.group, e)
                return
            if info.epoch != self.epoch:
                self._fail(
                    StaleEpochError(
                        f"epoch {self.epoch} of group {self.group!r} was replaced: the "
                        f"coordinator's current epoch is {info.epoch} (another launch took "
                        "over with install(takeover=True), or this launch restarted); this "
                        "rank's stream is fenced, rejoin the group",
                        code="FAILED_PRECONDITION",
                        reason="STALE_EPOCH",
                        metadata={"group": self.group, "epoch": str(self.epoch)},
                    )
                )
                return

    # -- anchors: epoch start and Restore -------------------------------------------------

    def _anchor(self, seq: int, cursor: int, digest: bytes) -> None:
        """Start the stream at ``cursor`` with lease ``seq``, fix the leases up to the
        lookahead, and request lease ``seq``."""
        self._anchor_seq = seq
        self._ops = 0
        self._attested_ops = 0
        self._first_seq = seq
        self._starts = []
        self._plans.clear()
        self._futures.clear()
        self._requests.clear()
        self._next_start = cursor
        self._cursor = cursor
        self._digest = digest
        self._verified = self._sent = seq - 1
        self._current = seq
        self._limit = cursor if self._fatal is None else -1
        self._samples.clear()
        self._samples.append((self._clock(), cursor))
        self._fix_through(seq + self.schedule.lookahead, digest, self._largest_op, cursor)
        self._send_through(seq)

    def restore(self, cursor: int, digest: bytes, from_job: str = "") -> None:
        """Continue the stream at ``cursor`` with fingerprint chain ``digest``; ``from_job``
        names the job whose checkpoint they come from when it is another job's (audited).

        Sends a Restore for the first lease seq that is not fixed yet: every rank of the group
        that restores at the same point of its op sequence names the same seq (no rank has
        requested it). The coordinator applies it once every member has asked (each rank's
        call is its vote, and returns then), and records it with the voters (audited).

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
            from_job=from_job,
        )
        self._generation += 1
        self._anchor(seq, cursor, digest)

    def close(self, leave: bool = True) -> None:
        """Stop the background threads; with ``leave`` (default), leave the epoch.

        Requests and attestations still waiting out an outage are dropped. Leaving waits out
        an outage for up to the client's budget, then gives up with a warning: the run is
        over, and the coordinator fences the epoch when the group rejoins anyway.
        """
        self._closing.set()
        # A call in flight ends within its deadline; a retry's sleep ends at once.
        wait_s = self._client.deadline_s + 1.0
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=wait_s)
            self._worker = None
        if self._attester is not None:
            self._attestations.put(None)
            self._attester.join(timeout=wait_s)
            self._attester = None
        if leave:
            try:
                self._client.leave_group(
                    self.job,
                    self.group,
                    epoch=self.epoch,
                    rank=self.rank,
                    member_id=self.member_id,
                )
            except CoordinatorUnavailable as e:
                logger.warning(
                    "rngcoord: rank %d could not leave group %r (epoch %d): %s",
                    self.rank,
                    self.group,
                    self.epoch,
                    e,
                )
