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

- ``torch.distributed.tensor._random.manual_seed`` leads to :func:`manual_seed`, however the
  caller found it: the code of upstream's function object is swapped for a trampoline
  (``__code__``), so a name imported before install() (``from
  torch.distributed.tensor._random import manual_seed``, as upstream's own tests do) takes
  rngcoord's meaning too. Replacing the module attribute would miss
  those names, and walking the referrers of the function would miss closures and copies;
  every name is bound to the one function object, whose code is the one thing they share.
  The original code is restored when the last tracker leaves.
- ``torch.distributed.tensor._dispatch.run_dtensor_rng_op`` (DTensor's CUDA path) is
  replaced by :func:`run_dtensor_rng_op`: while DTensor's dispatch is traced, it runs the op
  in the traced region the tracker left (rngcoord.client._traced), so that the graph draws
  from the leases; otherwise it is upstream's higher-order op.
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
import logging
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
from torch.distributed.tensor import _dispatch as dtensor_dispatch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial

from rngcoord.client import _traced
from rngcoord.client._compiling import not_compiled
from rngcoord.client._errors import RNGCoordError

logger = logging.getLogger("rngcoord.client.router")
_lock = threading.Lock()


class RankTracker(Protocol):
    """What the router needs of one rank's tracker (rngcoord.client._tracker implements it)."""

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


_upstream_function = dtensor_random.manual_seed
_upstream_code = _upstream_function.__code__
#: Upstream's manual_seed with its original code, whatever the function object runs now.
_upstream_manual_seed = types.FunctionType(
    _upstream_code,
    _upstream_function.__globals__,
    _upstream_function.__name__,
    _upstream_function.__defaults__,
    _upstream_function.__closure__,
)
_upstream_manual_seed.__kwdefaults__ = _upstream_function.__kwdefaults__
_upstream_hop = dtensor_dispatch.run_dtensor_rng_op  # type: ignore[attr-defined]
_aten = torch.ops.aten
#: In-place distributions DTensor does not treat as random ops (see the module docstring).
EXTRA_RANDOM_OPS = (
    _aten.exponential_.default,
    _aten.log_normal_.default,
    _aten.geometric_.default,
    _aten.cauchy_.default,
)


@not_compiled
def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """``torch.distributed.tensor._random.manual_seed`` while rngcoord is installed: the
    calling rank's tracker handles it (the streams of the seed's base, from their start; see
    :meth:`rngcoord.client.OffsetBasedRNGTracker.manual_seed`). Ranks without a tracker get
    upstream's."""
    router = dtensor_random._rng_tracker
    if isinstance(router, TrackerRouter) and dist.get_rank() in router._trackers:
        router.tracker().manual_seed(seed, device_mesh)
    else:
        _upstream_manual_seed(seed, device_mesh)


def _trampoline(seed: int, device_mesh: DeviceMesh) -> None:
    # This code runs as upstream's function, with upstream's module globals: it may only
    # import what it needs, and its parameters are upstream's (callers pass them by name).
    from rngcoord.client._router import manual_seed as routed

    routed(seed, device_mesh)


def _code_swappable() -> bool:
    """Whether upstream's manual_seed can run the trampoline's code: same parameters, and
    no closure cells (a code object's free variables must match the function's)."""
    mine, theirs = _trampoline.__code__, _upstream_code
    return (
        not theirs.co_freevars
        and theirs.co_argcount == mine.co_argcount
        and theirs.co_kwonlyargcount == mine.co_kwonlyargcount == 0
        and theirs.co_varnames[: theirs.co_argcount] == mine.co_varnames[: mine.co_argcount]
    )


def _route_manual_seed(on: bool) -> None:
    if _code_swappable():
        _upstream_function.__code__ = _trampoline.__code__ if on else _upstream_code
        return
    # A torch whose manual_seed has another shape: only callers that look it up on the
    # module at call time reach rngcoord; say so rather than let the others do nothing.
    dtensor_random.manual_seed = manual_seed if on else _upstream_function
    if on:
        logger.warning(
            "rngcoord: torch.distributed.tensor._random.manual_seed has parameters %s; a "
            "name imported before install() keeps upstream's function, which DTensor draws "
            "ignore: call it through the module",
            _upstream_code.co_varnames[: _upstream_code.co_argcount],
        )


def run_dtensor_rng_op(
    start_offset_incr: int, end_offset_incr: int, op: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """DTensor's CUDA path while rngcoord is installed: upstream's higher-order op, except
    while the tracker traces (it left a traced region, rngcoord.client._traced): then the op
    runs in that region, which records ``rngcoord::draw``. The increments are not needed
    then: the draw's region places the op when the graph runs."""
    region = _traced.take_pending()
    if region is None:
        return _upstream_hop(start_offset_incr, end_offset_incr, op, *args, **kwargs)
    with region:
        return op(*args, **kwargs)


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
            _route_manual_seed(True)
            dtensor_dispatch.run_dtensor_rng_op = run_dtensor_rng_op  # type: ignore[attr-defined]
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
            _route_manual_seed(False)
            dtensor_dispatch.run_dtensor_rng_op = _upstream_hop  # type: ignore[attr-defined]
            for op in EXTRA_RANDOM_OPS:
                _handlers().pop(op, None)
