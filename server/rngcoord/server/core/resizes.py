"""RecordResize: audit a resume whose checkpoint stream this mesh cannot continue.

Under the offsets policy a stream belongs to its mesh, so a job resumed on another mesh
cannot rewind onto the saved cursor (docs/design.md §7.6). The client warns, and one member
of each group records it here: one `resizes` row and one audit record of kind `resize` per
(epoch, saved group), so that an auditor sees why the stream did not rewind.
"""

from __future__ import annotations

import functools

from rngcoord.server.core.context import Handler
from rngcoord.server.core.membership import Caller, fields, read_member
from rngcoord.server.errors import InvalidArgument
from rngcoord.server.storage import queries
from rngcoord.server.storage.store import Tx
from rngcoord.v1.rules import check_cursor, check_name

__all__ = ["MAX_PER_EPOCH", "Resizes"]

#: Most resize records of one epoch: a checkpoint names a few groups (the root mesh, its
#: sub-meshes, their manual_seed scopes), and without a bound one member's credential could
#: grow the audit log without end by naming ever new saved groups.
MAX_PER_EPOCH = 64


class Resizes(Handler):
    """The RecordResize RPC over one store.

    Args:
        context: the Coordinator's store access, memory, chain and clock.
    """

    async def record(self, caller: Caller, *, saved_group: str, saved_cursor: int) -> bool:
        """Record that the caller's epoch could not continue `saved_group` at `saved_cursor`;
        return True when it had been recorded already.

        Raises:
            InvalidArgument: a malformed field, `saved_group` is the caller's own group
                (that stream can be restored), or the epoch holds MAX_PER_EPOCH records.
            NotFound, StaleEpoch, NotMember, PermissionDenied: as for Reserve.
        """
        caller.check()
        with fields():
            check_name("saved_group", saved_group)
            check_cursor(saved_cursor, "saved_cursor")
        if saved_group == caller.group:
            raise InvalidArgument(
                f"saved_group {saved_group!r} is the group being joined: its stream resumes "
                "with Restore, not RecordResize",
                field="saved_group",
                value=saved_group,
            )
        return bool(
            await self._write(
                functools.partial(
                    self._record_tx,
                    caller=caller,
                    saved_group=saved_group,
                    saved_cursor=saved_cursor,
                    now_us=self._clock.now_us(),
                )
            )
        )

    def _record_tx(
        self, tx: Tx, *, caller: Caller, saved_group: str, saved_cursor: int, now_us: int
    ) -> bool:
        read_member(tx, caller)
        if queries.resize_count(tx, caller.job, caller.group, caller.epoch) >= MAX_PER_EPOCH:
            if queries.has_resize(tx, caller.job, caller.group, caller.epoch, saved_group):
                return True
            raise InvalidArgument(
                f"epoch {caller.epoch} of group {caller.group!r} already records "
                f"{MAX_PER_EPOCH} resizes, the most one epoch keeps: a checkpoint names a "
                "few groups, not this many",
                field="saved_group",
                value=saved_group,
            )
        if not queries.insert_resize(
            tx, caller.job, caller.group, caller.epoch, saved_group, saved_cursor, now_us
        ):
            return True
        self._chain.append(
            tx,
            ts_us=now_us,
            job=caller.job,
            group=caller.group,
            kind="resize",
            actor=caller.actor,
            detail={
                "epoch": caller.epoch,
                "rank": caller.rank,
                "saved_group": saved_group,
                "saved_cursor": saved_cursor,
            },
        )
        return False
