"""RecordQuorum: audit the torchft quorums that a replica took part in.

torchft changes a job's membership at every step without restarts (docs/torchft.md): replica
groups join a quorum through a Lighthouse, and a replica that comes back heals from a live
peer. One member of each replica records each quorum it sees here: one `quorums` row and one
audit record of kind `quorum` per (epoch, quorum id) of the replica's group, with the step, how
many replicas took part and the peer it healed from, so that an auditor reads the replica
timeline next to the Restores that each heal made. The replicas of one quorum id, across the
job's groups, are its participants.
"""

from __future__ import annotations

import functools

from rngcoord.server.core.context import Handler
from rngcoord.server.core.membership import Caller, fields, read_member
from rngcoord.server.errors import InvalidArgument
from rngcoord.server.storage import queries
from rngcoord.server.storage.store import Tx
from rngcoord.v1.rules import (
    MAX_SEQ,
    MAX_WORLD_SIZE,
    REPLICA_GROUP_PATTERN,
    REPLICA_PATTERN,
    RuleViolation,
    check_u64,
)

__all__ = ["Quorums"]


class Quorums(Handler):
    """The RecordQuorum RPC over one store.

    Args:
        context: the Coordinator's store access, memory, chain and clock.
    """

    async def record(
        self, caller: Caller, *, quorum_id: int, step: int, participants: int, healed_from: str
    ) -> bool:
        """Record that the caller's replica took part in torchft quorum `quorum_id`, formed
        at `step` with `participants` replicas, healing from replica `healed_from` ("" for
        none); return True when it had been recorded already.

        Raises:
            InvalidArgument: a malformed field; the group is not a replica's; `healed_from`
                names the caller's own replica.
            NotFound, StaleEpoch, NotMember, PermissionDenied: as for Reserve.
        """
        caller.check()
        replica = REPLICA_GROUP_PATTERN.fullmatch(caller.group)
        if replica is None:
            raise InvalidArgument(
                f"group {caller.group!r} is not a replica's group (…/replica:NAME): quorums "
                "are recorded by torchft replicas, installed with replica=NAME",
                field="group",
                value=caller.group,
            )
        with fields():
            check_u64("quorum_id", quorum_id)
            if not 0 <= step <= MAX_SEQ:
                raise RuleViolation("step", step, "be in [0, 2^63)")
            if not 1 <= participants <= MAX_WORLD_SIZE:
                raise RuleViolation("participants", participants, f"be in [1, {MAX_WORLD_SIZE}]")
            if healed_from and REPLICA_PATTERN.fullmatch(healed_from) is None:
                raise RuleViolation(
                    "healed_from", healed_from, "be a replica name (1 to 48 of A-Z a-z 0-9 . _ -)"
                )
        if healed_from == replica["replica"]:
            raise InvalidArgument(
                f"replica {healed_from!r} cannot heal from itself: healed_from names the peer "
                "whose state it loaded",
                field="healed_from",
                value=healed_from,
            )
        return bool(
            await self._write(
                functools.partial(
                    self._record_tx,
                    caller=caller,
                    replica=replica["replica"],
                    quorum_id=quorum_id,
                    step=step,
                    participants=participants,
                    healed_from=healed_from,
                    now_us=self._clock.now_us(),
                )
            )
        )

    def _record_tx(
        self,
        tx: Tx,
        *,
        caller: Caller,
        replica: str,
        quorum_id: int,
        step: int,
        participants: int,
        healed_from: str,
        now_us: int,
    ) -> bool:
        read_member(tx, caller)
        if not queries.insert_quorum(
            tx,
            caller.job,
            caller.group,
            caller.epoch,
            quorum_id,
            step=step,
            participants=participants,
            healed_from=healed_from,
            now_us=now_us,
        ):
            return True
        self._chain.append(
            tx,
            ts_us=now_us,
            job=caller.job,
            group=caller.group,
            kind="quorum",
            actor=caller.actor,
            detail={
                "epoch": caller.epoch,
                "rank": caller.rank,
                "replica": replica,
                "quorum_id": quorum_id,
                "step": step,
                "participants": participants,
                "healed_from": healed_from,
            },
        )
        return False
