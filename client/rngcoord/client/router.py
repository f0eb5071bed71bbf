"""The router: the one object DTensor sees as its RNG tracker, dispatching to each rank's own.

DTensor keeps its tracker in the module global ``torch.distributed.tensor._random._rng_tracker``,
one per process. Under a multi-threaded process group every thread is a rank, so a process-global
tracker would mix the ranks' streams (the first warning of pytorch#103235). rngcoord installs a
:class:`TrackerRouter` there instead: trackers are registered under their global rank and each
call goes to the tracker of ``torch.distributed.get_rank()``, which is per thread under the
threaded process group and the process's rank otherwise.

The router subclasses PyTorch's ``OffsetBasedRNGTracker`` because DTensor's CUDA path asserts
``isinstance(_rng_tracker, OffsetBasedRNGTracker)``; like the trackers, it never runs the
upstream ``__init__``. It knows the trackers only through :class:`RankTracker`, so it depends
on no tracker module.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.tensor._random as dtensor_random
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from rngcoord.client.errors import RNGCoordError

_lock = threading.Lock()


class RankTracker(Protocol):
    """What the router needs of one rank's tracker (rngcoord.client.tracker implements it)."""

    rank: int
    """The global rank the tracker serves."""

    distribute_region_enabled: bool

    def region(
        self, spec: DTensorSpec, generator: torch.Generator | None, caller: types.FrameType | None
    ) -> contextlib.AbstractContextManager[None]:
        """DTensor's ``_distribute_region``; ``caller`` is the frame of DTensor's code that
        asked, from which the tracker reads the random op."""
        ...

    def hop_offsets(self, spec: DTensorSpec, caller: types.FrameType | None) -> tuple[int, int]:
        """DTensor's ``_compute_rng_offsets`` (its CUDA ``run_dtensor_rng_op`` path)."""
        ...


class TrackerRouter(dtensor_random.OffsetBasedRNGTracker):
    """Routes DTensor's tracker calls to the tracker of the calling rank."""

    def __init__(self) -> None:
        # Upstream's __init__ is deliberately not called (see the module docstring).
        self._trackers: dict[int, RankTracker] = {}

    def tracker(self) -> RankTracker:
        """The calling rank's tracker."""
        rank = dist.get_rank()
        tracker = self._trackers.get(rank)
        if tracker is None:
            raise RNGCoordError(
                f"rank {rank} runs a DTensor random op but has no rngcoord tracker (ranks "
                f"with one: {sorted(self._trackers)}): call rngcoord.client.install() on "
                "every rank"
            )
        return tracker

    @property
    def trackers(self) -> dict[int, RankTracker]:
        """The registered trackers by global rank (a copy)."""
        return dict(self._trackers)

    @property
    def distribute_region_enabled(self) -> bool:
        return self.tracker().distribute_region_enabled

    @distribute_region_enabled.setter
    def distribute_region_enabled(self, value: bool) -> None:
        self.tracker().distribute_region_enabled = value

    def _distribute_region(  # type: ignore[override]
        self, spec: DTensorSpec, generator: torch.Generator | None = None
    ) -> contextlib.AbstractContextManager[None]:
        return self.tracker().region(spec, generator, sys._getframe(1))

    def _compute_rng_offsets(self, spec: DTensorSpec) -> tuple[int, int]:
        return self.tracker().hop_offsets(spec, sys._getframe(1))


def register(tracker: RankTracker) -> RankTracker | None:
    """Make ``tracker`` its rank's DTensor tracker; return the one it replaces, if any.

    :func:`rngcoord.client.install` registers the coordinator-backed tracker; a local
    :class:`~rngcoord.client.RNGStateTracker` can be registered the same way.

    Installs the router as DTensor's tracker if it is not already (replacing an upstream
    tracker that DTensor may have created lazily).
    """
    with _lock:
        router = dtensor_random._rng_tracker
        if not isinstance(router, TrackerRouter):
            router = TrackerRouter()
            dtensor_random._rng_tracker = router
        previous = router._trackers.get(tracker.rank)
        router._trackers[tracker.rank] = tracker
        return previous if previous is not tracker else None


def unregister(tracker: RankTracker) -> None:
    """Remove ``tracker`` from the router; with no tracker left, DTensor gets none."""
    with _lock:
        router = dtensor_random._rng_tracker
        if not isinstance(router, TrackerRouter):
            return
        if router._trackers.get(tracker.rank) is tracker:
            del router._trackers[tracker.rank]
        if not router._trackers:
            dtensor_random._rng_tracker = None
