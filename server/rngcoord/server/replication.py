"""Whether a PostgreSQL primary's acknowledged commits survive a failover to its standby.

A grant is acknowledged only after its commit (docs/design.md §2.3). With asynchronous
replication, the PostgreSQL default, a standby promoted after the primary dies may lack the
last commits: the promoted store has forgotten grants that ranks already hold, and would
grant those offsets again. Only synchronous replication (``synchronous_standby_names`` set
on the primary, and the writer's ``synchronous_commit`` at ``remote_write`` or above) makes
every acknowledged grant reach a standby first. The PostgreSQL store reads these settings
at start and on every reconnect of its writer (a reconnect may have found a new primary).
"""

from __future__ import annotations

from dataclasses import dataclass

from rngcoord.server.errors import Unavailable

_WAITS_FOR_STANDBY = ("on", "remote_write", "remote_apply")
"""``synchronous_commit`` levels at which a commit waits for a synchronous standby."""

SQL = (
    "SELECT current_setting('synchronous_standby_names'), current_setting('synchronous_commit'),"
    " (SELECT coalesce(string_agg(coalesce(application_name, '?') || ' ' ||"
    " coalesce(sync_state, 'unknown'), ', ' ORDER BY application_name), '')"
    " FROM pg_stat_replication)"
)
"""One round trip: the standby names, this session's commit level and the standbys attached
(``sync_state`` is null for roles without pg_monitor, shown as ``unknown``)."""


@dataclass(frozen=True)
class Replication:
    """A primary's replication settings, as the writer's session sees them.

    Args:
        standby_names: ``synchronous_standby_names`` ('' when replication is asynchronous).
        synchronous_commit: the writer session's ``synchronous_commit``.
        standbys: the attached standbys, ``"NAME SYNC_STATE"`` each, comma-separated.
    """

    standby_names: str
    synchronous_commit: str
    standbys: str

    @property
    def synchronous(self) -> bool:
        """Every acknowledged commit has reached a synchronous standby (or waits for one)."""
        return bool(self.standby_names.strip()) and self.synchronous_commit in _WAITS_FOR_STANDBY

    def describe(self) -> str:
        """A sentence for the log and for refusals."""
        attached = self.standbys or "none"
        if self.synchronous:
            return (
                f"synchronous replication (synchronous_standby_names = '{self.standby_names}', "
                f"standbys: {attached}): acknowledged grants survive a failover to a "
                "synchronous standby"
            )
        if not self.standby_names.strip():
            why = "synchronous_standby_names is empty"
        else:
            why = f"synchronous_commit is {self.synchronous_commit}"
        return (
            f"asynchronous replication ({why}; standbys: {attached}): a standby promoted after "
            "the primary dies may lack acknowledged grants, and offsets that ranks hold would "
            "be granted again; set synchronous_standby_names on the primary before failing over"
        )


class ReplicationRefused(Unavailable):
    """The primary does not replicate synchronously, and ``--require-sync-replication`` asks
    that it does: at start serve exits; later (a reconnect found an asynchronous primary)
    writes are refused as the store being unavailable until a synchronous primary answers."""
