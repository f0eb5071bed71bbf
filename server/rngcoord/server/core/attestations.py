"""Attest: members compare their op fingerprints at multiples of 1,024 ops (docs/design.md §6.1).

The first attestation of (epoch, anchor seq, op count) is stored with who sent it; the others
compare with it, from memory (first attestations never change) or on a reader, so only a
count's first attestation, or a divergence, reaches the writer. A first attestation must be
within what the epoch's leases since the anchor can hold (an op draws at least 4 offsets), so
a member cannot plant one far ahead of the ops. A divergence is recorded by
rngcoord.server.core.divergences, which hears every member that attests the same count.
"""

from __future__ import annotations

import functools
from typing import TypeVar

from rngcoord.server.core import divergences
from rngcoord.server.core.cache import AttestationKey, GroupState
from rngcoord.server.core.context import Handler
from rngcoord.server.core.membership import Caller, fence, fields, not_found, read_member
from rngcoord.server.errors import Divergence, InvalidArgument
from rngcoord.server.storage import attestation_queries, queries
from rngcoord.server.storage.store import Tx
from rngcoord.v1.rules import check_attested_ops, check_fingerprint, check_seq

__all__ = ["Attestations"]

T = TypeVar("T")

# The fewest offsets one counted op draws (a multiple of 4, and ops that draw nothing are not
# counted): attested ops * this can never pass what the leases since the anchor hold.
_OFFSETS_PER_OP = 4


class _Hear:
    """The epoch diverged at this very count: the writer must hear this member's side."""


_HEAR = _Hear()


class Attestations(Handler):
    """The Attest RPC over one store.

    Args:
        context: the Coordinator's store access, memory, chain and clock.
    """

    async def attest(
        self, caller: Caller, *, anchor_seq: int, ops: int, fingerprint: bytes
    ) -> None:
        """Compare a member's op fingerprint at an op count with the first one attested.

        Raises:
            InvalidArgument: a malformed field, or an op count beyond what the epoch's leases
                since the anchor can hold.
            NotFound, StaleEpoch, NotMember, PermissionDenied: as for Reserve.
            Divergence: the epoch diverged, now or before.
        """
        caller.check()
        with fields():
            check_seq(anchor_seq)
            check_attested_ops(ops)
            check_fingerprint(fingerprint)
        key = (caller.job, caller.group, caller.epoch, anchor_seq, ops)
        if self._agrees_in_memory(caller, key, fingerprint):
            return
        first = await self._read(functools.partial(self._first, caller=caller, key=key))
        if isinstance(first, attestation_queries.Attestation) and first.fingerprint == fingerprint:
            self._cache.attestations.put(key, fingerprint)
            return
        try:
            await self._write(
                functools.partial(
                    self._attest_tx,
                    caller=caller,
                    key=key,
                    fingerprint=fingerprint,
                    now_us=self._clock.now_us(),
                )
            )
        except Divergence:
            self._cache.groups.drop((caller.job, caller.group))
            raise
        self._cache.attestations.put(key, fingerprint)

    def _agrees_in_memory(self, caller: Caller, key: AttestationKey, fingerprint: bytes) -> bool:
        """True when memory alone shows this attestation agrees: the group's current epoch,
        not diverged, this member with this secret, and the same first attestation."""
        if not self._fresh():
            return False
        state = self._cache.groups.get((caller.job, caller.group))
        if state is None or state.epoch != caller.epoch or state.diverged is not None:
            return False
        held = self._cache.members.get((caller.job, caller.group, caller.epoch, caller.rank))
        if held is None:
            return False
        fence(caller, state.epoch, held)
        return self._cache.attestations.get(key) == fingerprint

    def _first(
        self, tx: Tx, *, caller: Caller, key: AttestationKey
    ) -> attestation_queries.Attestation | _Hear | None:
        """Fence the caller, fill the cache as Reserve's reads do, and return the first
        attestation of `key` (or `_HEAR` when the epoch diverged at this count)."""
        g = queries.group_row(tx, caller.job, caller.group)
        if g is None:
            raise not_found(caller.job, caller.group, queries.job_seed(tx, caller.job) is not None)
        held = queries.member(tx, caller.job, caller.group, caller.epoch, caller.rank)
        fence(caller, g.epoch, held)
        assert held is not None
        row = queries.epoch_row(tx, caller.job, caller.group, caller.epoch)
        diverged = None if row is None else row.diverged
        self._cache.groups.put((caller.job, caller.group), GroupState(g.seed, g.epoch, diverged))
        self._cache.members.put((caller.job, caller.group, caller.epoch, caller.rank), held)
        if diverged is not None:
            if divergences.hears(diverged, _point(key), caller.rank):
                return _HEAR
            raise divergences.refusal(caller.job, caller.group, caller.epoch, diverged, caller.rank)
        return attestation_queries.attestation(tx, *key)

    def _attest_tx(
        self, tx: Tx, *, caller: Caller, key: AttestationKey, fingerprint: bytes, now_us: int
    ) -> None:
        _, row = read_member(tx, caller)
        anchor_seq, ops = key[3], key[4]
        where = {"anchor_seq": anchor_seq, "ops": ops}
        mine = divergences.Side(
            caller.rank, divergences.attest_sent(fingerprint), caller.actor, caller.peer
        )
        if row.diverged is not None:
            if not divergences.hears(row.diverged, _point(key), caller.rank):
                raise divergences.refusal(
                    caller.job, caller.group, caller.epoch, row.diverged, caller.rank
                )
            raise divergences.add_side(
                tx,
                self._chain,
                job=caller.job,
                group=caller.group,
                epoch=caller.epoch,
                at=_point(key),
                where=where,
                caller=mine,
                actor=caller.actor,
                now_us=now_us,
            )
        first = attestation_queries.attestation(tx, *key)
        if first is None:
            covered = attestation_queries.covered_offsets(
                tx, caller.job, caller.group, caller.epoch, anchor_seq
            )
            if ops * _OFFSETS_PER_OP > covered:
                raise InvalidArgument(
                    f"rank {caller.rank} attested {ops} random ops since lease seq {anchor_seq} "
                    f"of group {caller.group!r} epoch {caller.epoch}, but the leases granted "
                    f"since then hold {covered} offsets, at most {covered // _OFFSETS_PER_OP} "
                    "ops: an attestation cannot come ahead of the ops it attests",
                    field="ops",
                    value=ops,
                )
            attestation_queries.insert_attestation(
                tx,
                *key,
                attestation_queries.Attestation(
                    fingerprint, caller.rank, caller.actor, caller.peer
                ),
                now_us,
            )
            return
        if first.fingerprint == fingerprint:
            return
        raise divergences.record(
            tx,
            self._chain,
            job=caller.job,
            group=caller.group,
            epoch=caller.epoch,
            at=_point(key),
            where=where,
            first=divergences.Side(
                first.rank, divergences.attest_sent(first.fingerprint), first.actor, first.peer
            ),
            caller=mine,
            actor=caller.actor,
            now_us=now_us,
        )


def _point(key: AttestationKey) -> str:
    """The divergence point of an attested count."""
    return f"ops:{key[3]}:{key[4]}"
