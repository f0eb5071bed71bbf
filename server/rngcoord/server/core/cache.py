"""The coordinator's memory of what it has read or written, so that a hit costs no store read.

Four bounded maps, each evicting its oldest entry when full:

- leases by (job, group, epoch, seq): a granted lease never changes, so it is kept as is;
- members by (job, group, epoch, rank): who holds the rank (`membership.Member`: its id,
  whether it left, and its secret's hash);
- groups by (job, group): the seed, the current epoch and its divergence record;
- attestations by (job, group, epoch, anchor seq, op count): the first fingerprint attested,
  which never changes either.

Granted leases, first attestations and formed epochs never change; what does change (a
group's current epoch, a divergence, a leave) is dropped from the cache by the change feed
(rngcoord.server.core.feed) and by this process's own writes, and a hit uses the cache only while
the feed is fresh (docs/design.md §7.4 gives the staleness bound). Grants, first
attestations and divergences, and the fencing of grants, always consult the store.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from rngcoord.server.storage.queries import LeaseRow, Member

__all__ = ["AttestationKey", "Bounded", "Cache", "GroupState"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
#: (job, group, epoch, anchor seq, op count) of an attestation.
AttestationKey = tuple[str, str, int, int, int]


class Bounded(Generic[K, V]):
    """A dict of at most `capacity` entries that drops its oldest entry when full.

    Args:
        capacity: most entries kept.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def put(self, key: K, value: V) -> None:
        entries = self._entries
        if key not in entries and len(entries) >= self._capacity:
            del entries[next(iter(entries))]
        entries[key] = value

    def drop(self, key: K) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True, slots=True)
class GroupState:
    """What a hit needs of a group: its seed, current epoch and that epoch's divergence."""

    seed: int
    epoch: int
    diverged: str | None


class Cache:
    """The four bounded maps of one coordinator process.

    Args:
        leases: most leases kept. Default 1,048,576 (about 200 MB at most).
        members: most (epoch, rank) member ids kept. Default 2,097,152.
        groups: most groups kept. Default 262,144.
        attestations: most first attestations kept. Default 262,144.
    """

    def __init__(
        self,
        *,
        leases: int = 1 << 20,
        members: int = 1 << 21,
        groups: int = 1 << 18,
        attestations: int = 1 << 18,
    ) -> None:
        self.leases: Bounded[tuple[str, str, int, int], LeaseRow] = Bounded(leases)
        self.members: Bounded[tuple[str, str, int, int], Member] = Bounded(members)
        self.groups: Bounded[tuple[str, str], GroupState] = Bounded(groups)
        self.attestations: Bounded[AttestationKey, bytes] = Bounded(attestations)

    def clear(self) -> None:
        """Forget everything: the store this memory described went back in time."""
        for bounded in (self.leases, self.members, self.groups, self.attestations):
            bounded.clear()
