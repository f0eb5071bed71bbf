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

While a tracker is registered, two more of DTensor's entry points lead to it:

- ``torch.distributed.tensor._random.manual_seed`` is replaced by :func:`manual_seed` (callers
  that look it up on the module at call time see it; a name imported before install() keeps
  upstream's function, which only reseeds the device generator, so DTensor draws ignore it).
- ``exponential_``, ``log_normal_``, ``geometric_`` and ``cauchy_`` are not among DTensor's
  random ops: DTensor runs them on each local shard with the device generator as it stands,
  so shards repeat. Adding them to ``OpDispatcher._random_ops`` does not help, because the
  C++ dispatch fast path keeps its own list (``is_random_op`` in python_variable.cpp) and
  never reaches the Python slow path for them; ``OpDispatcher._custom_op_handlers`` is
  consulted first, so :func:`random_op` is registered there and runs them in the
  tracker's region like any other random op.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.tensor._random as dtensor_random
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial

from rngcoord.client.compiling import not_compiled
from rngcoord.client.errors import RNGCoordError

_lock = threading.Lock()


class RankTracker(Protocol):
    """What the router needs of one rank's tracker (rngcoord.client.tracker implements it)."""

    rank: int
    """The global rank the tracker serves."""

    @property
    def op_handlers(self) -> Mapping[torch._ops.OpOverload, Callable[..., object]]:
        """DTensor custom op handlers this tracker needs while registered (its policy's)."""
        ...

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

    def manual_seed(self, seed: int, mesh: DeviceMesh) -> None:
        """DTensor's ``manual_seed(seed, mesh)``."""
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

    # Disabled for Dynamo: after a graph break, DTensor's dispatch runs eagerly from a
    # resumed frame, and Dynamo would otherwise try to compile the tracker's Python code.
    @not_compiled
    def _distribute_region(  # type: ignore[override]
        self, spec: DTensorSpec, generator: torch.Generator | None = None
    ) -> contextlib.AbstractContextManager[None]:
        return self.tracker().region(spec, generator, sys._getframe(1))

    @not_compiled
    def _compute_rng_offsets(self, spec: DTensorSpec) -> tuple[int, int]:
        return self.tracker().hop_offsets(spec, sys._getframe(1))


_upstream_manual_seed = dtensor_random.manual_seed
_aten = torch.ops.aten
#: In-place distributions DTensor does not treat as random ops (see the module docstring).
EXTRA_RANDOM_OPS = (
    _aten.exponential_.default,
    _aten.log_normal_.default,
    _aten.geometric_.default,
    _aten.cauchy_.default,
)


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """``torch.distributed.tensor._random.manual_seed`` while rngcoord is installed: the
    calling rank's tracker handles it (an audited restart of its streams with the job's seed;
    see :meth:`rngcoord.client.OffsetBasedRNGTracker.manual_seed`). Ranks without a tracker
    get upstream's."""
    router = dtensor_random._rng_tracker
    if isinstance(router, TrackerRouter) and dist.get_rank() in router._trackers:
        router.tracker().manual_seed(seed, device_mesh)
    else:
        _upstream_manual_seed(seed, device_mesh)


@not_compiled
def random_op(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """DTensor's custom handler for random ops that DTensor would not run in the tracker's
    region (:data:`EXTRA_RANDOM_OPS`; every random op under the sharding_invariant policy,
    whose regions replace the local op, on every device): the local op runs inside the
    calling rank's tracker region, as DTensor's dispatch runs its own random ops there. The
    output has the input's placements (random ops are elementwise)."""
    target = next(a for a in args if isinstance(a, DTensor))
    spec = target._spec
    if any(isinstance(p, Partial) for p in spec.placements):
        raise RNGCoordError(
            f"{op_call} on a DTensor with Partial placements {spec.placements}: a random fill "
            "of a partial sum is ill-defined; redistribute to Shard or Replicate first"
        )
    local_kwargs = dict(kwargs)
    generator = local_kwargs.pop("generator", None)
    assert generator is None or isinstance(generator, torch.Generator)
    local_args = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
    if target._local_tensor.is_meta:
        # As in DTensor's dispatch: meta tensors hold no values, so no stream moves.
        result = op_call(*local_args, **local_kwargs)
    else:
        router = dtensor_random._rng_tracker
        assert isinstance(router, TrackerRouter)
        # The tracker reads the op from this frame's local `op_call` (for its fingerprint).
        with router.tracker().region(spec, generator, sys._getframe()):
            result = op_call(*local_args, **local_kwargs)
    if op_call.overloadpacket.__name__.endswith("_"):
        return target
    if isinstance(result, tuple):
        return tuple(_like(r, spec) for r in result)
    assert isinstance(result, torch.Tensor)
    return _like(result, spec)


def _like(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor of `local` with `spec`'s mesh, placements and shape, and `local`'s dtype."""
    meta = TensorMeta(spec.shape, spec.stride, local.dtype)
    out_spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return DTensor(local, out_spec, requires_grad=False)  # type: ignore[no-untyped-call]


def _handlers() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    handlers: dict[torch._ops.OpOverload, Callable[..., Any]] = (
        DTensor._op_dispatcher._custom_op_handlers
    )
    return handlers


# The custom op handlers installed on behalf of the registered trackers' policies.
_policy_handlers: dict[torch._ops.OpOverload, Callable[..., object]] = {}


def _update_policy_handlers(router: TrackerRouter) -> None:
    """Install the op handlers the registered trackers need (the sharding_invariant policy
    routes every DTensor random op through the trackers' regions), and only those."""
    wanted: dict[torch._ops.OpOverload, Callable[..., object]] = {}
    for tracker in router._trackers.values():
        wanted.update(tracker.op_handlers)
    for op in _policy_handlers.keys() - wanted.keys():
        _handlers().pop(op, None)
    _handlers().update(wanted)
    _policy_handlers.clear()
    _policy_handlers.update(wanted)


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
            dtensor_random.manual_seed = manual_seed
            _handlers().update(dict.fromkeys(EXTRA_RANDOM_OPS, random_op))
        previous = router._trackers.get(tracker.rank)
        router._trackers[tracker.rank] = tracker
        _update_policy_handlers(router)
        return previous if previous is not tracker else None


def unregister(tracker: RankTracker) -> None:
    """Remove ``tracker`` from the router; with no tracker left, DTensor gets none."""
    with _lock:
        router = dtensor_random._rng_tracker
        if not isinstance(router, TrackerRouter):
            return
        if router._trackers.get(tracker.rank) is tracker:
            del router._trackers[tracker.rank]
        _update_policy_handlers(router)
        if not router._trackers:
            dtensor_random._rng_tracker = None
            dtensor_random.manual_seed = _upstream_manual_seed
            for op in EXTRA_RANDOM_OPS:
                _handlers().pop(op, None)
