"""RNG state trackers: where each DTensor random op draws from, on one rank.

:class:`RNGStateTracker` keeps named streams of (seed, offset) and applies them to the device
around each random op. An op's base is its stream's cursor; the local shard draws from
``base + start`` and the cursor then moves to ``base + end`` on every rank, where
(:func:`shard_offsets`, cached per DTensorSpec; docs/design.md §5.2)

is

- upstream's layout, ``start = roundup4(idx * n0)`` and ``end = roundup4(N)``, whenever its
  shards cannot overlap: ``n0 % 4 == 0`` and ``k * n0 <= roundup4(N)``. Evenly sharded
  tensors keep upstream's offsets, so CUDA jobs see what DTensor alone would draw.
- otherwise the aligned layout, ``start = idx * roundup4(n0)`` and ``end = k * roundup4(n0)``,

with ``N`` the global numel, ``n0`` the numel of the first (largest) shard as upstream's
``_calc_first_shard_size`` gives it (an upper bound where one tensor dim is sharded on
several mesh dims), ``k`` the number of distinct shards and ``idx`` this shard's linear index
(upstream's ``_calc_shard_info`` and ``_calc_shard_linear_idx``). Upstream rounds
``idx * n0`` up to 4 and so overlaps shards whose numel is not a multiple of 4, and lets the
last shards run past ``end`` into the next op where ``k * n0 > roundup4(N)``.

Worked example, an (8,) tensor with ``[Shard(0)]`` on 4 ranks: ``n0 = 2``, ``k = 4``,
``N = 8``. Upstream gives starts 0, 4, 4, 8 and end 8: ranks 1 and 2
draw the same numbers, and rank 3's (offsets 8..9) are the next op's rank 0's. The aligned
layout gives starts 0, 4, 8, 12 and end 16: every shard, and every op, draws its own offsets.

The streams of :class:`RNGStateTracker` are local: it is the coordinator-free reference, and
what every rank would compute.

:class:`OffsetBasedRNGTracker` is the default policy: one stream per group (by default one per
(sub)mesh), whose seed, epoch and leases come from the coordinator. It subclasses PyTorch's
``OffsetBasedRNGTracker`` because DTensor's CUDA path asserts that class; it never runs the
upstream ``__init__``, which raises on CPU meshes and broadcasts rank 0's device state.

How a draw reaches the device:

- Philox devices (cuda and cuda-like): the device's default generator is set to
  ``(seed, base + shard start)`` before the op and left at ``(seed, base + end)`` after it,
  as upstream leaves it. On CUDA, DTensor's dispatch runs the op through
  ``torch._prims.rng_prims.run_dtensor_rng_op`` and calls only ``_compute_rng_offsets``:
  the tracker sets ``(seed, base)`` there and the higher-order op adds the shard start.
- CPU: the default CPU generator is given the state of the stream
  ``cpu_key(seed, base + shard start)`` (:mod:`rngcoord.client.devices`) for the op, and the
  user's CPU state is restored afterwards.

torch.compile: DTensor's dispatch, and so the tracker, runs when a graph is traced, not when
it runs, and upstream's graph reads the device generator *at run time*
(``run_dtensor_rng_op``'s CUDA impl, or the plain op). While it is traced, the tracker's
region therefore records the local random op as the custom op ``rngcoord::draw``
(:mod:`rngcoord.client.traced`), which enters this region when the graph runs: compiled
graphs draw from the leases, with ``fullgraph=True`` too, on every backend and for other
tracers (make_fx, export) alike, and compiled and eager values and cursors are equal bit for
bit. A trace never plans or joins a group. What cannot be recorded (a user generator,
symbolic shapes) breaks Dynamo's graph before the op, which then runs eagerly from its
lease, or is refused under other tracers. ``compiled_random_ops="device"`` opts out: traced
ops then draw from the device generator as it stands, outside the leases, as upstream's do.
The tracker's own code is ``torch.compiler.disable``d: after a graph break, DTensor's
dispatch runs from a resumed frame and Dynamo would otherwise compile the regions.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import struct
import sys
import threading
import types
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.tensor._random as dtensor_random
from torch.distributed._functional_collectives import _are_we_tracing
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from rngcoord.client import invariant, portable, traced
from rngcoord.client.compiling import not_compiled
from rngcoord.client.connection import CoordinatorClient
from rngcoord.client.devices import (
    CPUStateWriter,
    DeviceHandle,
    check_philox_offset,
    cpu_key,
    device_handle,
    pack_philox,
    unpack_philox,
)
from rngcoord.client.errors import (
    CoordinatorUnavailable,
    InvalidRequest,
    JoinTimeoutError,
    NotFoundError,
    RNGCoordError,
    StoreMismatchError,
)
from rngcoord.client.groups import (
    REPLICA_PATTERN,
    GroupSpec,
    invariant_group,
    is_split_dim,
    mesh_of_name,
    policy_of,
    replica_name,
    shared_group,
    stream_group,
    with_suffix,
)
from rngcoord.client.leases import (
    ATTEST_MIN_S,
    INITIAL_DIGEST,
    LeaseManager,
    LeaseSchedule,
    StreamState,
)
from rngcoord.client.router import random_op, unregister
from rngcoord.client.trace import OpTrace
from rngcoord.v1.seeds import group_seed
from rngcoord.v1.types import JoinResult

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: ``format`` of the dicts :meth:`RNGStateTracker.state_dict` returns.
STATE_FORMAT = "rngcoord.tracker/1"
_MAX_PLANS = 4096
_STATE16 = struct.Struct("<QQ")

# One generator per device (and one CPU generator) serves every thread-rank of a process:
# a region holds this lock so that thread-ranks do not interleave their states.
_GENERATOR_LOCK = threading.RLock()

#: What a traced (compiled) DTensor random op does: see the module docstring.
CompiledOps = Literal["eager", "device"]
#: How a DTensor random op draws: DTensor's offsets on the device generator ("offsets"), or
#: the portable, mesh-independent values of rngcoord.client.invariant.
Policy = Literal["offsets", "sharding_invariant"]


def _roundup4(n: int) -> int:
    return (n + 3) // 4 * 4


def shard_offsets(spec: DTensorSpec) -> tuple[int, int]:
    """``(start, end)`` of this rank's shard of ``spec``, relative to the op's base: the
    shard draws from ``base + start``, and the stream's cursor moves to ``base + end``.

    Upstream's layout where it cannot overlap, else the aligned one; see the module
    docstring for the rule and a worked example. The calling rank must be in the mesh.
    """
    coordinate = spec.mesh.get_coordinate()
    assert coordinate is not None
    idx_by_dim, count_by_dim = dtensor_random._calc_shard_info(coordinate, spec)
    idx = int(dtensor_random._calc_shard_linear_idx(idx_by_dim, count_by_dim))
    shards = math.prod(int(c) for c in count_by_dim)
    first = math.prod(dtensor_random._calc_first_shard_size(spec))
    total = _roundup4(math.prod(spec.shape))
    if first % 4 == 0 and shards * first <= total:
        return idx * first, total
    stride = _roundup4(first)
    return idx * stride, shards * stride


class _Stream(Protocol):
    """A stream position: a seed and a cursor that :meth:`advance` moves op by op."""

    seed: int

    @property
    def cursor(self) -> int: ...

    @property
    def digest(self) -> bytes: ...

    @property
    def state(self) -> StreamState: ...

    def advance(self, size: int, op_key: bytes) -> int: ...


class LocalStream:
    """A stream kept in this process only: the seed and cursor are what the caller sets.

    Args:
        seed: The stream's seed (uint64).
        cursor: Where the next op's offsets start, a multiple of 4. Default 0.
        digest: The fingerprint chain so far. Default: the chain before any op.
        origin: Where a lease schedule over this stream would have begun. Default: `cursor`.
        largest_op: The largest op so far, in offsets. Default 0.
    """

    def __init__(
        self,
        seed: int,
        cursor: int = 0,
        digest: bytes = INITIAL_DIGEST,
        origin: int | None = None,
        largest_op: int = 0,
    ) -> None:
        self.seed = seed
        self.cursor = cursor
        self.digest = digest
        self.origin = cursor if origin is None else origin
        self.largest_op = largest_op

    @property
    def state(self) -> StreamState:
        return StreamState(self.cursor, self.digest, self.origin, self.largest_op)

    def advance(self, size: int, op_key: bytes) -> int:
        """Account one op of ``size`` offsets, identified by ``op_key``; return its base.
        The fingerprint chain and the schedule's state move on as a LeaseManager's do, so
        state dicts of either kind of stream load into the other."""
        base = self.cursor
        self.cursor = base + size
        self.digest = hashlib.sha256(self.digest + op_key).digest()
        self.largest_op = max(self.largest_op, size)
        return base


@dataclass
class _Plan:
    """What a DTensorSpec needs, computed once: its stream, and DTensor's offsets."""

    stream: _Stream | None  # None: this rank is not part of the spec's mesh
    start: int
    end: int
    shape: str
    op_keys: dict[object, bytes]


def _op_name(op: object) -> str:
    # OpOverloads print as "aten.uniform_.default"; functions (torch.rand) have no stable
    # repr (it holds an address), so use the name.
    if isinstance(op, torch._ops.OpOverload):
        return str(op)
    return f"torch.{getattr(op, '__name__', type(op).__name__)}"


def _dispatch_code() -> types.CodeType | None:
    from torch.distributed.tensor import _dispatch

    slow_path = getattr(_dispatch.OpDispatcher, "_dispatch_get_local_results_slow_path", None)
    return getattr(slow_path, "__code__", None)


def _init_helper_code() -> types.CodeType | None:
    from torch.distributed.tensor import _api

    return getattr(getattr(_api, "_dtensor_init_helper", None), "__code__", None)


# The two places in torch that call into the tracker, and the local holding the random op:
# OpDispatcher._dispatch_get_local_results_slow_path (op_call; both the _distribute_region
# and the run_dtensor_rng_op path) and the DTensor factories' _dtensor_init_helper (init_op,
# torch.rand / torch.randn). rngcoord.client.compat checks both at install time.
_CALLERS: dict[types.CodeType | None, str] = {
    _dispatch_code(): "op_call",
    _init_helper_code(): "init_op",
    # The router's handler of the random ops DTensor leaves alone; wrapped by
    # torch.compiler.disable, and the frame that calls the tracker is the inner one.
    getattr(random_op, "__wrapped__", random_op).__code__: "op_call",
    # A compiled graph's rngcoord::draw, which sets op_call to the op DTensor's frame held
    # when the graph was traced: compiled and eager ops fingerprint alike.
    traced._run.__code__: "op_call",
}
_CALLERS.pop(None, None)


def _caller_args(frame: types.FrameType | None, op: object) -> dict[str, Any]:
    """The scalar arguments of the random op (``p`` of ``bernoulli_``...), read from the
    calling frame's ``args`` and ``kwargs`` (the router's handler has them), for the trace;
    empty where they cannot be read."""
    for _ in range(4):
        if frame is None or not isinstance(op, torch._ops.OpOverload):
            return {}
        if frame.f_code in _CALLERS:
            args, kwargs = frame.f_locals.get("args"), frame.f_locals.get("kwargs")
            if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
                return {}
            try:
                bound = portable.bind_op_args(op, args, kwargs)
            except (TypeError, ValueError):
                return {}
            return {k: v for k, v in bound.items() if isinstance(v, (int, float, bool))}
        frame = frame.f_back
    return {}


def _caller_op(frame: types.FrameType | None) -> object | None:
    """The random op that DTensor is running, read from the frame that called the tracker
    or one of the few above it (torch.compiler.disable puts its wrapper in between)."""
    for _ in range(4):
        if frame is None:
            return None
        local = _CALLERS.get(frame.f_code)
        if local is not None:
            return frame.f_locals.get(local)
        frame = frame.f_back
    return None


class _TracedStream:
    """A stream that writes each op it accounts to the trace (install(trace=PATH))."""

    def __init__(
        self,
        stream: _Stream,
        trace: OpTrace,
        group: str,
        spec: DTensorSpec,
        caller: types.FrameType | None,
    ) -> None:
        self._stream = stream
        self._trace = trace
        self._group = group
        self._spec = spec
        self._caller = caller

    @property
    def seed(self) -> int:
        return self._stream.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._stream.seed = value

    @property
    def cursor(self) -> int:
        return self._stream.cursor

    @property
    def digest(self) -> bytes:
        return self._stream.digest

    @property
    def state(self) -> StreamState:
        return self._stream.state

    def advance(self, size: int, op_key: bytes) -> int:
        base = self._stream.advance(size, op_key)
        meta = self._spec.tensor_meta
        dtype = str(meta.dtype).removeprefix("torch.") if meta is not None else "unknown"
        op = _caller_op(self._caller)
        name = "<unknown op>" if op is None else _op_name(op)
        self._trace.record(
            self._group,
            base,
            size,
            tuple(self._spec.shape),
            dtype,
            name,
            _caller_args(self._caller, op),
        )
        return base


class _CPURegion:
    """Runs the region on the default CPU generator set to one stream key, then restores
    the user's CPU state."""

    __slots__ = ("_key", "_saved", "_writer")

    def __init__(self, writer: CPUStateWriter, key: int) -> None:
        self._writer = writer
        self._key = key

    @not_compiled
    def __enter__(self) -> None:
        _GENERATOR_LOCK.acquire()
        generator = torch.default_generator
        self._saved = generator.get_state()
        generator.set_state(self._writer.write(self._key))

    @not_compiled
    def __exit__(self, *exc: object) -> None:
        try:
            torch.default_generator.set_state(self._saved)
        finally:
            _GENERATOR_LOCK.release()


class _PhiloxRegion:
    """Runs the region with the device generator at (seed, offset) and leaves it at
    (seed, post)."""

    __slots__ = ("_hpu", "_offset", "_post", "_seed", "_tracker")

    def __init__(self, tracker: RNGStateTracker, seed: int, offset: int, post: int) -> None:
        self._tracker = tracker
        self._seed = seed
        self._offset = offset
        self._post = post
        # Upstream switches Gaudi's generator to its Philox context around the op.
        self._hpu = tracker.device_type == "hpu"

    @not_compiled
    def __enter__(self) -> None:
        _GENERATOR_LOCK.acquire()
        if self._hpu:
            self._tracker._handle_or_raise().set_rng_ctx("philox")  # type: ignore[attr-defined]
        self._tracker._set_philox(self._seed, self._offset)

    @not_compiled
    def __exit__(self, *exc: object) -> None:
        try:
            self._tracker._set_philox(self._seed, self._post)
            if self._hpu:
                self._tracker._handle_or_raise().unset_rng_ctx("philox")  # type: ignore[attr-defined]
        finally:
            _GENERATOR_LOCK.release()


class RNGStateTracker:
    """Named random streams of one rank, applied to the device around DTensor random ops.

    Each stream has a tag, a seed (uint64) and an offset (the cursor: where the next op's
    offsets start). The streams of this class live in this process: set them with
    :meth:`set_seed` and :meth:`set_offset`. A mesh's stream is the one tagged with the mesh's
    group name (:func:`rngcoord.client.groups.group_name`). With the same seeds and start
    offsets it draws exactly what :class:`OffsetBasedRNGTracker` draws.

    Args:
        device_type: The device of the DTensors' local shards: ``"cpu"`` (default),
            ``"cuda"``, or a cuda-like device with a ``torch.<device_type>`` module.
        rank: This rank's global rank. Default ``None``: ``torch.distributed.get_rank()``.
        root: The job's root mesh, whose sub-meshes' copies share streams along replicate
            dims (:func:`rngcoord.client.groups.stream_group`). Default ``None``: every mesh
            is its own stream.
        split_dims: Names of ``root``'s dims whose sub-mesh copies draw separately. Default
            ``None``: dims named ``pp*`` or ``pipe*``.
        policy: ``"offsets"`` (default): DTensor's offset semantics on the device's own
            generator (the shard layout above). ``"sharding_invariant"``: every shard gets
            the slice of what one device would draw, from a stream named independently of
            the mesh (:mod:`rngcoord.client.invariant`).
        compiled_random_ops: ``"eager"`` (default): a traced DTensor random op (torch.compile,
            make_fx, export) draws from the streams when the graph runs, exactly as the eager
            op would (``rngcoord::draw``); ``"device"``: traced ops draw from the device
            generator as it stands (upstream's behaviour), outside the streams. See the
            module docstring.
        trace: Write a JSON line per op drawn from the streams to this path (``{rank}`` is
            replaced by the rank; :mod:`rngcoord.client.trace`), for ``rngcoord replay
            --trace``. Default ``None``: no trace.
    """

    def __init__(
        self,
        device_type: str = "cpu",
        rank: int | None = None,
        root: DeviceMesh | None = None,
        split_dims: Sequence[str] | None = None,
        policy: Policy = "offsets",
        compiled_random_ops: CompiledOps = "eager",
        trace: str | os.PathLike[str] | None = None,
    ) -> None:
        if policy not in ("offsets", "sharding_invariant"):
            raise InvalidRequest(
                f'policy must be "offsets" or "sharding_invariant", got {policy!r}'
            )
        if compiled_random_ops not in ("eager", "device"):
            raise InvalidRequest(
                f'compiled_random_ops must be "eager" or "device", got {compiled_random_ops!r}'
            )
        self.device_type = device_type
        self.policy = policy
        self.compiled_random_ops = compiled_random_ops
        self.root = root
        self.split_dims = None if split_dims is None else tuple(split_dims)
        self.rank = dist.get_rank() if rank is None else rank
        handle = device_handle(device_type)
        if handle is None and device_type != "cpu":
            raise InvalidRequest(
                f"device {device_type!r} has no torch.{device_type} module with "
                "get_rng_state/set_rng_state: register its device module "
                "(torch._register_device_module) or use a cuda, cuda-like or cpu mesh"
            )
        # Attributes upstream's trackers define, which DTensor and torch code read.
        self._device = torch.device(device_type)
        self._device_handle: DeviceHandle | None = handle
        self._use_distribute_region = True
        self._streams: dict[str, _Stream] = {}
        self._plans: dict[DTensorSpec, _Plan] = {}
        # A mesh's group, found once: at 10^5 ranks it is a few ms of tensor work, and a
        # model has many specs (plans) on few meshes.
        self._groups: dict[DeviceMesh, GroupSpec] = {}
        self._cpu_writer = CPUStateWriter() if handle is None else None
        self._philox = bytearray(16)
        self._philox_tensor = torch.frombuffer(self._philox, dtype=torch.uint8)
        self._trace = None if trace is None else OpTrace(trace, self.rank, policy)

    # -- the seed's interface -------------------------------------------------------------

    @property
    def distribute_region_enabled(self) -> bool:
        """Whether random ops draw from the tracker's streams (default ``True``). When
        ``False``, DTensor random ops use the device generator as it stands."""
        return self._use_distribute_region

    @distribute_region_enabled.setter
    def distribute_region_enabled(self, value: bool) -> None:
        self._use_distribute_region = value

    @property
    def rng_states(self) -> dict[str, torch.Tensor]:
        """A snapshot of every stream: tag -> 16-byte uint8 tensor, the seed as uint64 in
        ``[0:8]`` and the offset as uint64 in ``[8:16]``, little-endian (``_PhiloxState``'s
        layout). Writing to the tensors changes nothing: use :meth:`set_seed` and
        :meth:`set_offset`."""
        return {
            tag: torch.frombuffer(bytearray(_STATE16.pack(s.seed, s.cursor)), dtype=torch.uint8)
            for tag, s in self._streams.items()
        }

    def _stream(self, tag: str) -> _Stream:
        stream = self._streams.get(tag)
        if stream is None:
            raise InvalidRequest(
                f"no stream {tag!r} on rank {self.rank} (streams: {sorted(self._streams)}): "
                "a stream exists once a random op ran on its mesh or set_seed created it"
            )
        return stream

    def get_seed(self, tag: str) -> int:
        """The seed of the stream ``tag``."""
        return self._stream(tag).seed

    def set_seed(self, tag: str, seed: int) -> None:
        """Set the seed of the stream ``tag``, creating it at offset 0 if needed."""
        if not 0 <= seed < 1 << 64:
            raise InvalidRequest(f"seed must be a uint64, got {seed}")
        stream = self._streams.get(tag)
        if stream is None:
            self._streams[tag] = LocalStream(seed)
        else:
            stream.seed = seed

    def get_offset(self, tag: str) -> int:
        """The cursor of the stream ``tag``: where its next op's offsets start."""
        return self._stream(tag).cursor

    def set_offset(self, tag: str, offset: int) -> None:
        """Move the stream ``tag`` to ``offset`` (a multiple of 4)."""
        if offset % 4 or not 0 <= offset < 1 << 64:
            raise InvalidRequest(f"offset must be a multiple of 4 below 2^64, got {offset}")
        stream = self._stream(tag)
        assert isinstance(stream, LocalStream)
        stream.cursor = offset

    def manual_seed(self, seed: int, mesh: DeviceMesh) -> None:
        """DTensor's ``manual_seed(seed, mesh)``: every stream of this rank starts over from
        offset 0 with ``seed``, as every DTensor draw does after upstream's
        ``torch.manual_seed``. The calling rank must be in ``mesh``."""
        _check_in_mesh(mesh, self.rank, "manual_seed")
        if not 0 <= seed < 1 << 64:
            raise InvalidRequest(f"seed must be a uint64, got {seed}")
        for tag in self._streams:
            self._streams[tag] = LocalStream(seed)

    def state_dict(self) -> dict[str, Any]:
        """The streams' positions: ``{"format", "streams": {tag: {"seed", "offset",
        "digest"}}}``. Plain Python values, for ``torch.save`` or DCP."""
        return {
            "format": STATE_FORMAT,
            "streams": {
                tag: {"seed": s.seed, **s.state.to_dict()}
                for tag, s in self._stream_states().items()
            },
        }

    def _stream_states(self) -> Mapping[str, _Stream]:
        return self._streams

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue every stream of ``state`` where it was saved."""
        for tag, entry in _streams_of(state).items():
            self._streams[tag] = LocalStream(
                entry["seed"],
                entry["offset"],
                entry["digest"],
                entry["origin"],
                entry["largest_op"],
            )

    @property
    def op_handlers(self) -> Mapping[torch._ops.OpOverload, Callable[..., object]]:
        """DTensor custom op handlers this tracker needs while registered: under the
        sharding_invariant policy, every random op goes through its region."""
        if self.policy == "sharding_invariant":
            return dict.fromkeys(invariant.INVARIANT_OPS, random_op)
        return {}

    # -- DTensor's hooks ----------------------------------------------------------------------

    def _distribute_region(
        self, spec: DTensorSpec, generator: torch.Generator | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """The context in which DTensor runs the local random op of ``spec``.

        Called by DTensor for every random op except CUDA ops without a generator. The
        stream advances when this is called, whatever happens in the region.
        """
        return self.region(spec, generator, sys._getframe(1))

    def region(
        self,
        spec: DTensorSpec,
        generator: torch.Generator | None,
        caller: types.FrameType | None,
    ) -> contextlib.AbstractContextManager[None]:
        if not self._use_distribute_region:
            # DTensor's dispatch checks this flag itself; its factories (rand, randn) do not.
            return contextlib.nullcontext()
        if _are_we_tracing():
            return self._traced_region(spec, generator, caller)
        plan = self._plans.get(spec) or self._plan(spec)
        stream = plan.stream
        if stream is None:
            return contextlib.nullcontext()
        if generator is not None:
            return self._generator_region(plan, generator)
        if self._trace is not None:
            stream = _TracedStream(stream, self._trace, self._stream_tag(spec), spec, caller)
        if self.policy == "sharding_invariant":
            return invariant.InvariantRegion(stream, spec, lambda: self._op_key(plan, caller))
        if self._cpu_writer is not None:
            base = stream.advance(plan.end, self._op_key(plan, caller))
            return _CPURegion(self._cpu_writer, cpu_key(stream.seed, base + plan.start))
        check_philox_offset(stream.cursor + plan.end)
        base = stream.advance(plan.end, self._op_key(plan, caller))
        return _PhiloxRegion(self, stream.seed, base + plan.start, base + plan.end)

    def _traced_region(
        self,
        spec: DTensorSpec,
        generator: torch.Generator | None,
        caller: types.FrameType | None,
    ) -> contextlib.AbstractContextManager[None]:
        """The region of a DTensor random op that is being traced (torch.compile, make_fx,
        export): the graph gets ``rngcoord::draw``, which draws from the leases when it runs
        (rngcoord.client.traced). Nothing is planned or joined here: a trace never talks to
        the coordinator, and Dynamo may trace a frame many times."""
        if self.compiled_random_ops == "device":
            _warn_tracing_once()
            return contextlib.nullcontext()
        if generator is not None:
            # A torch.Generator is the user's own stream, advanced in Python; a graph cannot
            # carry it.
            self._untraceable(
                "a DTensor random op with a user generator cannot be recorded in a graph"
            )
            return contextlib.nullcontext()
        try:
            return traced.TracedRegion(spec, _caller_op(caller))
        except traced.UntraceableRandomOp as e:
            self._untraceable(str(e))
            return contextlib.nullcontext()

    @staticmethod
    def _untraceable(why: str) -> None:
        """Break Dynamo's graph before the op (so that it runs eagerly, from its lease), or
        refuse other tracing."""
        if torch.compiler.is_compiling():
            _break_graph(why)
        raise RNGCoordError(
            f"{why}: run the op eagerly or under torch.compile (which breaks the graph "
            'there), or pass compiled_random_ops="device" to install() to draw outside the '
            "leases"
        )

    def _compute_rng_offsets(self, spec: DTensorSpec) -> tuple[int, int]:
        """DTensor's CUDA path: account the op and set the device generator to
        ``(seed, base)``; ``run_dtensor_rng_op`` then runs the op at ``base + start`` and
        leaves the generator at ``base + end``. Returns ``(start, end)``."""
        return self.hop_offsets(spec, sys._getframe(1))

    def hop_offsets(self, spec: DTensorSpec, caller: types.FrameType | None) -> tuple[int, int]:
        if self.policy == "sharding_invariant":
            # The policy's op handler runs every dispatched random op in a region instead.
            raise RNGCoordError(
                "DTensor asked for Philox offsets under the sharding_invariant policy: an op "
                "outside rngcoord.client.invariant.INVARIANT_OPS took DTensor's CUDA path"
            )
        if _are_we_tracing():
            _check_in_mesh(spec.mesh, self.rank, "a DTensor random op")
            start, end = shard_offsets(spec)
            if self.compiled_random_ops == "device":
                _warn_tracing_once()
            else:
                # run_dtensor_rng_op follows in DTensor's frame; the router's replacement
                # runs the op inside this region, which records rngcoord::draw instead, and
                # the draw's region sets the generator when the graph runs. Nothing is
                # planned (joined) here: a trace never talks to the coordinator.
                traced.set_pending(traced.TracedRegion(spec, _caller_op(caller)))
            return start, end
        traced.set_pending(None)
        plan = self._plans.get(spec) or self._plan(spec)
        if plan.stream is None:
            raise RNGCoordError(f"rank {self.rank} is not part of the mesh of {spec}")
        stream = plan.stream
        if self._trace is not None:
            stream = _TracedStream(stream, self._trace, self._stream_tag(spec), spec, caller)
        check_philox_offset(stream.cursor + plan.end)
        base = stream.advance(plan.end, self._op_key(plan, caller))
        self._set_philox(stream.seed, base)
        return plan.start, plan.end

    # -- internals ----------------------------------------------------------------------------

    def _plan(self, spec: DTensorSpec) -> _Plan:
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        if spec.mesh.get_coordinate() is None:
            plan = _Plan(None, 0, 0, "", {})
        else:
            start, end = shard_offsets(spec)
            stream = self._stream_for(spec.mesh)
            plan = _Plan(stream, start, end, str(tuple(spec.shape)), {})
        self._plans[spec] = plan
        return plan

    def _stream_tag(self, spec: DTensorSpec) -> str:
        """The name of the group (stream) that ops on ``spec``'s mesh draw from."""
        return self._group_of(spec.mesh).name

    def _stream_for(self, mesh: DeviceMesh) -> _Stream:
        """The stream that random ops on ``mesh`` draw from."""
        return self._stream(self._group_of(mesh).name)

    def _group_of(self, mesh: DeviceMesh) -> GroupSpec:
        group = self._groups.get(mesh)
        if group is None:
            group = self._groups[mesh] = self._find_group(mesh)
        return group

    def _find_group(self, mesh: DeviceMesh) -> GroupSpec:
        if self.policy == "sharding_invariant" and self.root is not None:
            return invariant_group(self.root, self.rank, self.split_dims)
        return stream_group(mesh, self.rank, self.root, self.split_dims)

    @staticmethod
    def _op_key(plan: _Plan, caller: types.FrameType | None) -> bytes:
        op = _caller_op(caller)
        key = plan.op_keys.get(op)
        if key is None:
            name = "<unknown op>" if op is None else _op_name(op)
            key = plan.op_keys[op] = f"{name}{plan.shape}".encode()
        return key

    def _handle_or_raise(self) -> DeviceHandle:
        if self._device_handle is None:
            raise RNGCoordError(f"device {self.device_type!r} has no Philox generator")
        return self._device_handle

    def _set_philox(self, seed: int, offset: int) -> None:
        # The buffer aliases self._philox_tensor; set_rng_state copies it.
        struct.pack_into("<Qq", self._philox, 0, seed, offset)
        self._handle_or_raise().set_rng_state(self._philox_tensor)

    def _generator_region(
        self, plan: _Plan, generator: torch.Generator
    ) -> contextlib.AbstractContextManager[None]:
        """A user-supplied generator is the user's own stream: the coordinator is not
        involved, and the generator advances like the default stream would."""
        if generator.device.type == "cpu":
            # One 63-bit draw advances the user's generator the same way on every rank; the
            # shard start then separates the shards within the op.
            drawn = int(torch.empty((), dtype=torch.int64).random_(generator=generator))
            return _CPURegion(self._cpu_writer or CPUStateWriter(), cpu_key(drawn, plan.start))
        return _UserPhiloxRegion(self, generator, plan.start, plan.end)


class _UserPhiloxRegion:
    """Upstream's semantics for a user generator on a Philox device: the op runs at the
    generator's offset plus the shard start on the device's default generator, which is then
    restored, and the user's generator moves on by the op's end increment."""

    __slots__ = ("_end", "_generator", "_saved", "_start", "_tracker")

    def __init__(
        self, tracker: RNGStateTracker, generator: torch.Generator, start: int, end: int
    ) -> None:
        self._tracker = tracker
        self._generator = generator
        self._start = start
        self._end = end

    @not_compiled
    def __enter__(self) -> None:
        _GENERATOR_LOCK.acquire()
        handle = self._tracker._handle_or_raise()
        self._saved = handle.get_rng_state()
        seed, offset = unpack_philox(self._generator.get_state())
        check_philox_offset(offset + self._end)
        handle.set_rng_state(
            torch.frombuffer(bytearray(pack_philox(seed, offset + self._start)), dtype=torch.uint8)
        )

    @not_compiled
    def __exit__(self, *exc: object) -> None:
        try:
            handle = self._tracker._handle_or_raise()
            handle.set_rng_state(self._saved)
            seed, offset = unpack_philox(self._generator.get_state())
            self._generator.set_state(
                torch.frombuffer(
                    bytearray(pack_philox(seed, offset + self._end)), dtype=torch.uint8
                )
            )
        finally:
            _GENERATOR_LOCK.release()


@not_compiled
def _break_graph(why: str) -> None:
    # Dynamo turns Unsupported raised while it runs an op on fake tensors into a graph break
    # before the op (or, with fullgraph=True, into an error carrying this explanation).
    torch._dynamo.exc.unimplemented(
        gb_type="rngcoord: DTensor random op",
        context="",
        explanation=(
            f"{why}; rngcoord runs it eagerly, between compiled graphs, so that it draws from "
            "the coordinator's leases"
        ),
        hints=[
            'Drop fullgraph=True, or pass compiled_random_ops="device" to '
            "rngcoord.client.install() to let compiled random ops draw outside the leases.",
        ],
    )


_tracing_warned = False


def _warn_tracing_once() -> None:
    global _tracing_warned
    if not _tracing_warned:
        _tracing_warned = True
        logger.warning(
            "rngcoord: a DTensor random op is being traced with compiled_random_ops="
            '"device": traced random ops draw from the device generator as it stands, '
            "outside the coordinator's leases and the audit"
        )


def _check_in_mesh(mesh: DeviceMesh, rank: int, what: str) -> None:
    if mesh.get_coordinate() is None:
        # Upstream's manual_seed raises RuntimeError with this text; keep it matchable.
        raise InvalidRequest(
            f"{what} requires the current rank to be a part of the device mesh: rank {rank} "
            f"is not in {mesh}"
        )


def _streams_of(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Validate a tracker state dict and return its streams."""
    if state.get("format") != STATE_FORMAT:
        raise InvalidRequest(
            f"not an rngcoord tracker state dict (format {state.get('format')!r}, expected "
            f"{STATE_FORMAT!r}): pass what RNGStateTracker.state_dict() returned"
        )
    streams = state.get("streams")
    if not isinstance(streams, Mapping):
        raise InvalidRequest("tracker state dict has no 'streams' mapping")
    checked: dict[str, dict[str, Any]] = {}
    for tag, entry in streams.items():
        seed, offset, digest = entry.get("seed"), entry.get("offset"), entry.get("digest")
        # Checkpoints written before lease schedules carry neither: the schedule restarts.
        origin, largest = entry.get("origin", offset), entry.get("largest_op", 0)
        if not (
            isinstance(seed, int)
            and isinstance(offset, int)
            and isinstance(digest, bytes)
            and isinstance(origin, int)
            and isinstance(largest, int)
            and 0 <= seed < 1 << 64
            and 0 <= origin <= offset < 1 << 64
            and offset % 4 == 0
            and largest >= 0
        ):
            raise InvalidRequest(
                f"stream {tag!r} of the state dict is malformed: seed={seed!r} "
                f"offset={offset!r} digest={digest!r} origin={origin!r} largest_op={largest!r}"
            )
        checked[tag] = {
            "seed": seed,
            "offset": offset,
            "digest": digest,
            "origin": origin,
            "largest_op": largest,
        }
        epoch = entry.get("epoch")
        if epoch is not None:
            if not isinstance(epoch, int) or epoch < 0:
                raise InvalidRequest(f"stream {tag!r} of the state dict has epoch {epoch!r}")
            checked[tag]["epoch"] = epoch
    return checked


# mypy sees upstream's @contextmanager _distribute_region and ours as different signatures;
# both return a context manager over the region.
class OffsetBasedRNGTracker(  # type: ignore[misc]
    RNGStateTracker, dtensor_random.OffsetBasedRNGTracker
):
    """The coordinator-backed tracker of one rank: DTensor's offset policy over leases.

    Each group (by default each (sub)mesh that runs a random op; with ``shared_stream`` one
    group for every mesh) is joined on its first random op: a JoinGroup barrier of the
    mesh's ranks that returns the group's seed, epoch and start cursor. Ops then draw from
    leases that a background thread prefetches; see :mod:`rngcoord.client.leases`.

    Args:
        device_mesh: The job's mesh. Its device type picks the generator, and with
            ``shared_stream`` its ranks form the one group.
        client: The coordinator connection.
        job: The job name.
        seed: The job's root seed (uint64). Default ``None``: the job's recorded seed, or one
            the coordinator draws when the job is new.
        lease_size: Offsets in every lease, a multiple of 4, equal on every rank. Default
            ``None``: leases sized to the work (:class:`~rngcoord.client.leases.LeaseSchedule`),
            so that the RPCs per step stay bounded whatever the tensor sizes.
        shared_stream: One stream for every mesh, over ``device_mesh``'s ranks, instead of
            one per (sub)mesh. Default ``False``.
        join_timeout_s: How long a JoinGroup barrier waits for the mesh's other ranks.
            Default 60.0.
        owns_client: Close ``client`` in :meth:`close`. Default ``False``.
        split_dims: Names of ``device_mesh``'s dims whose sub-mesh copies draw separate
            numbers (:func:`rngcoord.client.groups.stream_group`). Default ``None``: dims
            named ``pp*`` or ``pipe*``; every other dim replicates, as in DTensor.
        policy: ``"offsets"`` (default) or ``"sharding_invariant"``; see
            :class:`RNGStateTracker`.
        compiled_random_ops: What a traced DTensor random op does. Default ``"eager"``: the
            graph draws it from the leases when it runs, as eager would. See
            :class:`RNGStateTracker`.
        trace: A per-op JSONL trace path (``{rank}``: the rank), flushed at :meth:`close`;
            see :class:`RNGStateTracker`. Default ``None``.
        attest_min_s: Attest about this often at most; see
            :class:`~rngcoord.client.leases.LeaseManager`. Default 30.0.
        replica: The replica group this process belongs to (a torchft replica): its groups
            are its own, named with ``/replica:<replica>``, so that same-shaped meshes of
            different replicas never share a group, and their seeds differ. Default
            ``None``: no replica.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        client: CoordinatorClient,
        job: str,
        seed: int | None = None,
        lease_size: int | None = None,
        shared_stream: bool = False,
        join_timeout_s: float = 60.0,
        owns_client: bool = False,
        split_dims: Sequence[str] | None = None,
        policy: Policy = "offsets",
        compiled_random_ops: CompiledOps = "eager",
        trace: str | os.PathLike[str] | None = None,
        attest_min_s: float = ATTEST_MIN_S,
        replica: str | None = None,
    ) -> None:
        # Upstream's __init__ is deliberately not called: it raises on CPU meshes and
        # broadcasts rank 0's device state, which the coordinator makes unnecessary.
        RNGStateTracker.__init__(
            self,
            device_mesh.device_type,
            root=device_mesh,
            split_dims=split_dims,
            policy=policy,
            compiled_random_ops=compiled_random_ops,
            trace=trace,
        )
        _check_in_mesh(device_mesh, self.rank, "install()")
        if seed is not None and not 0 <= seed < 1 << 64:
            raise InvalidRequest(f"seed must be a uint64, got {seed}")
        if replica is not None and not REPLICA_PATTERN.fullmatch(replica):
            raise InvalidRequest(
                f"replica must be 1 to 48 letters, digits, '.', '_' or '-', starting with a "
                f"letter or digit; got {replica!r}"
            )
        self.replica = replica
        # A bad size fails here, at install(), not at the first random op. Offsets past 2^63
        # on Philox devices are refused per op (devices.check_philox_offset), since CPU
        # streams may use the whole uint64 range.
        self.schedule = LeaseSchedule(fixed=lease_size)
        self.client = client
        self.job = job
        self.shared_stream = shared_stream
        self.join_timeout_s = join_timeout_s
        self.attest_min_s = attest_min_s
        self.member_id = f"r{self.rank}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.device_mesh = device_mesh
        self._job_seed = seed
        self._owns_client = owns_client
        self._managers: dict[str, LeaseManager] = {}
        self._recording = False  # record_ops(): groups joined from now on record too
        self._pending: dict[str, dict[str, Any]] = {}
        # The job whose state a pending stream came from, where not this one (audited).
        self._pending_from: dict[str, str] = {}
        self._join_lock = threading.Lock()
        self._shared = shared_group(device_mesh, self.rank) if shared_stream else None
        self._expected_store: str | None = None
        self._saved_head = ""
        # The base seed whose streams ops draw from (manual_seed), None for the root seed's,
        # and the scope of every joined group.
        self._scope: int | None = None
        self._scopes: dict[str, int | None] = {}
        #: Streams of the last loaded state that cannot rewind onto this mesh (a resize under
        #: the offsets policy): saved group -> this mesh's group. See :meth:`load_state_dict`.
        self.unrestorable: dict[str, str] = {}
        # This mesh's group -> (saved group, saved cursor) of those streams, until the group
        # is joined and its rank 0 has audited them (RecordResize).
        self._resized: dict[str, list[tuple[str, int]]] = {}

    @property
    def job_seed(self) -> int | None:
        """The job's root seed: known once a group is joined, or when given."""
        return self._job_seed

    @property
    def leases(self) -> Mapping[str, LeaseManager]:
        """The lease manager of every group this rank has joined, by group name."""
        return types.MappingProxyType(self._managers)

    def _find_group(self, mesh: DeviceMesh) -> GroupSpec:
        group = self._unscoped_group(mesh)
        if self._scope is None:
            return group
        return GroupSpec(scoped_name(group.name, self._scope), group.rank, group.world_size)

    def _unscoped_group(self, mesh: DeviceMesh) -> GroupSpec:
        """The group of ``mesh`` before manual_seed's scope: among this replica's own groups
        where there is a replica."""
        if self._shared is not None:
            if mesh.get_coordinate() is not None and not set(mesh.mesh.flatten().tolist()) <= set(
                self.device_mesh.mesh.flatten().tolist()
            ):
                raise InvalidRequest(
                    f"{mesh} has ranks outside the shared stream's mesh {self.device_mesh}: "
                    "install() with the job's root mesh"
                )
            group = self._shared
        else:
            group = super()._find_group(mesh)
        if self.replica is None:
            return group
        return GroupSpec(replica_name(group.name, self.replica), group.rank, group.world_size)

    def _stream_for(self, mesh: DeviceMesh) -> _Stream:
        group = self._group_of(mesh)
        manager = self._managers.get(group.name)
        if manager is None:
            with self._join_lock:
                manager = self._managers.get(group.name) or self._join(group)
        return manager

    def join(self, *meshes: DeviceMesh) -> None:
        """Join the groups of ``meshes`` now, in one message (JoinGroups), instead of one
        join each at its first random op: for a rank's root mesh and the sub-meshes it
        draws on, e.g. ``tracker.join(mesh, mesh["tp"])``. Every rank of each group must do
        the same (each group's barrier waits for all its ranks). Groups already joined are
        skipped; a group never drawn on holds its epoch and costs nothing more.
        """
        with self._join_lock:
            groups: dict[str, GroupSpec] = {}
            for mesh in meshes:
                group = self._group_of(mesh)
                if group.name not in self._managers:
                    groups.setdefault(group.name, group)
            if len(groups) == 1:
                self._join(*groups.values())
            elif groups:
                specs = list(groups.values())
                results = self._joined(
                    lambda: self.client.join_groups(
                        self.job,
                        [(g.name, g.rank, g.world_size, self._position(g.name)) for g in specs],
                        member_id=self.member_id,
                        job_seed=self._job_seed,
                        timeout_s=self.join_timeout_s,
                    )
                )
                for group, joined in zip(specs, results, strict=True):
                    self._start(group, joined)

    def _join(self, group: GroupSpec) -> LeaseManager:
        joined = self._joined(
            lambda: self.client.join_group(
                self.job,
                group.name,
                rank=group.rank,
                world_size=group.world_size,
                member_id=self.member_id,
                job_seed=self._job_seed,
                timeout_s=self.join_timeout_s,
                position=self._position(group.name),
            )
        )
        return self._start(group, joined)

    def _position(self, group: str) -> int:
        """Where this rank knows ``group``'s grants reach (JoinGroupRequest.position): the
        cursor of this job's checkpoint it loaded, so that a store which lost grants since
        (a database failover) starts the epoch past them; 0 when it loaded none."""
        pending = self._pending.get(group)
        if pending is None or not isinstance(pending.get("epoch"), int):
            return 0
        return int(pending["offset"])

    def _joined(self, join: Callable[[], _T]) -> _T:
        """`join()`, its timeout told in terms of manual_seed's base when one is set."""
        try:
            return join()
        except JoinTimeoutError as e:
            if self._scope is None:
                raise
            raise JoinTimeoutError(
                f"{e}; this rank draws from the streams of base seed {self._scope} "
                f"(manual_seed): ranks that passed manual_seed another base (after their "
                "stage offset) wait in another group",
                code=e.code,
                reason=e.reason,
                metadata=e.metadata,
            ) from e

    def _start(self, group: GroupSpec, joined: JoinResult) -> LeaseManager:
        """The lease manager of `group`, just joined as `joined`."""
        self._scopes[group.name] = self._scope
        self._job_seed = joined.job_seed
        resume = None
        pending = self._pending.pop(group.name, None)
        if pending is not None:
            _check_seed(group.name, pending["seed"], joined.seed)
            _check_forward(group.name, pending, joined, self.client.store_id)
            resume = StreamState(
                pending["offset"], pending["digest"], pending["origin"], pending["largest_op"]
            )
        manager = LeaseManager(
            self.client,
            self.job,
            group.name,
            rank=group.rank,
            member_id=self.member_id,
            joined=joined,
            schedule=self.schedule,
            resume=resume,
            restore_timeout_s=self.join_timeout_s,
            attest_min_s=self.attest_min_s,
            resume_from=self._pending_from.pop(group.name, ""),
        )
        self._managers[group.name] = manager
        self._streams[group.name] = manager
        if self._recording:
            manager.record_ops()
        self._record_resizes()
        return manager

    def _record_resizes(self) -> None:
        """Audit the resizes :meth:`load_state_dict` found, once their group is joined: its
        rank 0 sends one RecordResize per saved group (the coordinator keeps one record per
        epoch and saved group, so a repeat is harmless)."""
        for current in [name for name in self._resized if name in self._managers]:
            manager = self._managers[current]
            for saved, cursor in self._resized.pop(current):
                if manager.rank == 0:
                    self.client.record_resize(
                        self.job,
                        current,
                        epoch=manager.epoch,
                        saved_group=saved,
                        saved_cursor=cursor,
                        rank=manager.rank,
                        member_id=self.member_id,
                    )

    def set_seed(self, tag: str, seed: int) -> None:
        """Refused: group seeds are derived by the coordinator from the job's root seed."""
        raise InvalidRequest(
            f"the seed of group {tag!r} comes from the coordinator: pass seed= (the job's "
            "root seed) to rngcoord.client.install() instead"
        )

    def set_offset(self, tag: str, offset: int) -> None:
        """Move group ``tag`` to ``offset`` with a Restore (audited by the coordinator).

        Every rank of the group must do the same at the same point of its op sequence.
        """
        manager = self._managers.get(tag)
        if manager is None:
            raise InvalidRequest(
                f"group {tag!r} is not joined on rank {self.rank} (joined: "
                f"{sorted(self._managers)}): run a random op on its mesh first, or use "
                "load_state_dict()"
            )
        manager.restore(offset, manager.digest)

    def manual_seed(self, seed: int, mesh: DeviceMesh) -> None:
        """DTensor's ``manual_seed(seed, mesh)`` (rngcoord.client.install routes it here):
        the draws that follow are those of a fresh job with the root seed and the seed's
        *base*, from their start.

        - The base is ``seed`` less this rank's stage offset: its coordinates on the install
          mesh's split dims (``pp*`` by default), mixed radix in the mesh's dim order. So
          torchtitan's ``set_determinism`` and upstream's tests, which pass ``seed + pp_rank``
          on stage ``pp_rank``, give every rank the same base. Stages need no seeds of their
          own: they already draw from separate streams (split dims, docs/design.md §5.4).
        - No group joined and no root seed yet: the base becomes the job's root seed.
        - The base is the root seed: every group goes back to offset 0.
        - Any other base selects the base's streams: every group is then joined under the
          name of the root-seed group with ``/seed:<base>`` appended, so the coordinator
          derives other seeds for them. A group of the base that has already drawn goes back
          to offset 0.

        Going back to offset 0 is an audited Restore that every rank of the group must make at
        the same point, as upstream requires of ``manual_seed``; it is the one way a draw
        repeats, and only when asked for. Before any draw (torchtitan calls it at start-up)
        nothing is sent. The same root seed and base reproduce the same values in any job.

        Raises:
            InvalidRequest: the rank is not in ``mesh``, or ``seed`` is not a uint64.
        """
        _check_in_mesh(mesh, self.rank, "manual_seed")
        if not 0 <= seed < 1 << 64:
            raise InvalidRequest(f"seed must be a uint64, got {seed}")
        base = (seed - self.stage_offset()) % (1 << 64)
        if self._job_seed is None and not self._managers:
            self._job_seed = base
            self._set_scope(None)
            return
        self._set_scope(None if base == self._job_seed else base)
        for name, manager in self._managers.items():
            if self._scopes.get(name) == self._scope:
                manager.restore(0, INITIAL_DIGEST)

    def stage_offset(self) -> int:
        """What a per-stage seed adds to the base seed on this rank: its coordinates on the
        install mesh's split dims, mixed radix in dim order (torchtitan's
        ``distinct_seed_mesh_dims``; ``pp_rank`` with one ``pp`` dim). 0 without split dims."""
        coordinate = self.device_mesh.get_coordinate()
        assert coordinate is not None
        names = self.device_mesh.mesh_dim_names or (None,) * self.device_mesh.ndim
        offset, radix = 0, 1
        for dim, name in enumerate(names):
            if is_split_dim(name, self.split_dims):
                offset += coordinate[dim] * radix
                radix *= self.device_mesh.size(dim)
        return offset

    @property
    def seed_scope(self) -> int | None:
        """The base seed whose streams the rank draws from, ``None`` for the root seed's."""
        return self._scope

    def _set_scope(self, scope: int | None) -> None:
        if scope != self._scope:
            self._scope = scope
            # Meshes map to the scope's groups from now on.
            self._groups.clear()
            self._plans.clear()

    def record_ops(self) -> None:
        """Record every group's ops from now on, those of groups joined later included (a
        later call starts over): :meth:`LeaseManager.recorded_ops` of ``leases[group]``."""
        self._recording = True
        for manager in self._managers.values():
            manager.record_ops()

    def state_dict(self) -> dict[str, Any]:
        """The position of every group: ``{"format", "job", "job_seed", "store_id",
        "audit_head", "seed_scope", "streams": {group: {"seed", "offset", "digest", "origin",
        "largest_op", "epoch"}}}``, groups loaded but not joined yet included. ``seed_scope``
        is the base seed whose streams ops draw from (:meth:`manual_seed`), loaded with the
        streams.

        ``store_id`` is the coordinator store the streams came from: loading the state into
        the same job where another store answers raises
        :class:`~rngcoord.client.errors.StoreMismatchError`, as does a group whose epoch or
        high-water mark is behind the state's.
        ``audit_head`` is the latest audit chain head the coordinator sent (for
        ``rngcoord verify --anchor``).
        """
        state = super().state_dict()
        for tag, manager in self._managers.items():
            state["streams"][tag]["epoch"] = manager.epoch
        state["streams"].update({tag: dict(entry) for tag, entry in self._pending.items()})
        state["job"] = self.job
        state["job_seed"] = self._job_seed
        state["store_id"] = self.client.store_id or self._expected_store
        state["audit_head"] = self.client.audit_head or self._saved_head
        state["seed_scope"] = self._scope
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue every group of ``state`` bitwise where it was saved.

        A joined group sends a Restore at once, for the first lease seq this rank has not
        requested; a group not joined yet restores when it joins. Every rank of a group must
        load at the same point of its op sequence. If no root seed was given and no group
        is joined, the job adopts the state's root seed (a new job then draws the same
        values as the saved one). Groups absent from ``state`` (they had not drawn when it
        was saved) are left alone: they start at their high-water mark when joined, so save
        once every mesh has drawn for a bitwise resume of everything.

        Raises:
            InvalidRequest: the state is malformed, or it was saved under another root seed
                than this job's (a stream's seed is not its group's seed here), found when the
                state is loaded, before anything is restored: pass the saved job's root seed
                to install().
            StoreMismatchError: the state is this job's, and another store answers, or a
                group's epoch or high-water mark is behind the state's.
            RestoreTimeoutError: the group's other members did not load it too in time.

        Under the offsets policy a group is its mesh's shape and ranks: a state saved on
        another mesh (a job resized from 4 ranks to 2) names groups this mesh never joins,
        whose cursors cannot be restored. Such streams are listed in :attr:`unrestorable`
        (saved group -> this mesh's group), warned about (:func:`resize_message`) and audited
        (kind ``resize``, sent by the group's rank 0 once it is joined); this mesh's groups
        then start at their own high-water mark. The sharding_invariant
        policy's streams do not depend on the mesh and resume across a resize.
        """
        streams = _streams_of(state)
        self._check_root_seed(state, streams)
        self.unrestorable = {} if self.policy != "offsets" else self._foreign_streams(streams)
        for saved, current in self.unrestorable.items():
            warnings.warn(resize_message(saved, current), RuntimeWarning, stacklevel=2)
            self._resized.setdefault(current, []).append((saved, int(streams[saved]["offset"])))
        self._record_resizes()
        if state.get("job") == self.job:
            # The same job continues: its streams must come from the same store, and move
            # only forward. A state loaded into another job continues that job's groups of
            # the same names at the saved cursors (an audited Restore each, under this job's
            # seeds, which _check_root_seed made sure are the state's); the other job's
            # epochs and store say nothing about this one.
            store_id, head = state.get("store_id"), state.get("audit_head")
            if isinstance(store_id, str) and store_id:
                self.client.expect_store(store_id)
                self._expected_store = store_id
            if isinstance(head, str):
                self._saved_head = head
        else:
            for entry in streams.values():
                entry.pop("epoch", None)
        saved_seed = state.get("job_seed")
        if self._job_seed is None and not self._managers and isinstance(saved_seed, int):
            self._job_seed = saved_seed
        scope = state.get("seed_scope")
        if "seed_scope" in state and (scope is None or isinstance(scope, int)):
            # The saved streams are the scope's: continue drawing from them.
            self._set_scope(scope)
        source = state.get("job")
        from_job = source if isinstance(source, str) and source != self.job else ""
        for tag, entry in streams.items():
            manager = self._managers.get(tag)
            if manager is None:
                self._pending[tag] = entry
                self._pending_from[tag] = from_job
                continue
            manager.restore(entry["offset"], entry["digest"], from_job=from_job)

    def _check_root_seed(self, state: Mapping[str, Any], streams: Mapping[str, Any]) -> None:
        """Refuse, before anything is restored, a state whose streams were drawn under
        another root seed than this job's: each stream's seed must be the seed its group has
        here (`rngcoord.v1.seeds.group_seed`), joined or not. The job's root seed is the one
        given to install() or met in a join; else the coordinator's, read with one GetGroup
        of a saved group; else (a new job) the state's own, which the job then adopts."""
        if not streams:
            return
        saved = state.get("job_seed")
        root = self._job_seed
        if root is None:
            # A new job or group (not found), or no coordinator now: the join checks it.
            with contextlib.suppress(NotFoundError, CoordinatorUnavailable):
                known = self.client.get_group(self.job, next(iter(streams)), members_limit=1)
                root = known.job_seed
        if root is None:
            root = saved if isinstance(saved, int) else None
        if root is None:
            return
        for tag, entry in streams.items():
            here = group_seed(root, tag)
            if entry["seed"] != here:
                named = f", root seed {saved}" if isinstance(saved, int) and saved != root else ""
                raise InvalidRequest(
                    f"the state was saved under another root seed (job {state.get('job')!r}"
                    f"{named}) than job {self.job!r} has ({root}): group {tag!r} was saved "
                    f"with seed {entry['seed']} but has seed {here} here. Pass the saved "
                    "job's root seed to install() (state_dict()['job_seed']), or load a state "
                    "of this job's root seed; nothing was restored"
                )

    def _foreign_streams(self, streams: Mapping[str, Any]) -> dict[str, str]:
        """The saved offsets-policy streams whose mesh is not this job's: ranks outside the
        install mesh, or the install mesh's dims with another shape. Maps each to the install
        mesh's group."""
        current = self._unscoped_group(self.device_mesh).name
        now = mesh_of_name(current)
        ours = {int(r) for r in self.device_mesh.mesh.flatten().tolist()}
        foreign = {}
        for tag in streams:
            saved = mesh_of_name(tag) if policy_of(tag) == "offsets" else None
            if saved is None or tag in self._managers:
                continue
            names, shape, ranks = saved
            resized = now is not None and names == now[0] and shape != now[1]
            if resized or not set(ranks) <= ours:
                foreign[tag] = current
        return foreign

    def close(self) -> None:
        """Leave every joined group, stop the prefetch threads, unregister from DTensor and
        close the client if this tracker owns it."""
        unregister(self)
        if self._trace is not None:
            self._trace.close()
        errors = []
        for manager in self._managers.values():
            try:
                manager.close()
            except RNGCoordError as e:
                errors.append(e)
        self._managers.clear()
        if self._owns_client:
            self.client.close()
        if errors:
            logger.warning("rngcoord: leaving groups failed: %s", "; ".join(map(str, errors)))


def resize_message(saved: str, current: str) -> str:
    """What a resume across a resize under the offsets policy does to the random stream."""
    return (
        f"the checkpoint's random stream cannot rewind onto another mesh: it was saved in "
        f"group {saved!r}, and this mesh draws from group {current!r}. Under the offsets "
        "policy a stream belongs to its mesh's shape and ranks, so the draws continue from "
        f"{current!r}'s own position (offset 0 if it is new), not from the saved cursor, and "
        "differ from an uninterrupted run's. Model and optimizer state are unaffected. For "
        'random streams that survive a resize, run the job with policy="sharding_invariant" '
        "(install(policy=...)) from its start"
    )


def scoped_name(name: str, scope: int) -> str:
    """The name of group ``name``'s counterpart among the streams of base seed ``scope``
    (:meth:`OffsetBasedRNGTracker.manual_seed`): ``name`` with ``/seed:<scope>`` appended, or
    a digest of ``name`` where that would be too long for the contract's name rule."""
    return with_suffix(name, f"/seed:{scope}")


def _check_forward(
    group: str, saved: Mapping[str, Any], joined: JoinResult, store_id: str | None
) -> None:
    """Refuse a join whose epoch or high-water mark is behind what a checkpoint of this job
    saw (its streams carry their epoch): the store went back in time (restored from an older
    backup), and offsets would repeat."""
    epoch = saved.get("epoch")
    if not isinstance(epoch, int):
        return  # another job's state, or one saved before epochs were kept
    behind = []
    if joined.epoch <= epoch:
        behind.append(f"epoch {joined.epoch}, not after the saved epoch {epoch}")
    if joined.start < saved["offset"]:
        behind.append(f"high-water mark {joined.start}, below the saved cursor {saved['offset']}")
    if behind:
        raise StoreMismatchError(
            f"group {group!r} came back with {' and '.join(behind)}: the coordinator's store "
            f"(id {store_id}) went back in time, e.g. restored from an older backup, and "
            "continuing could hand out offsets that were already used. Restore the latest "
            "store, or recover with `rngcoord serve --init --floor-from AUDIT_EXPORT`",
            reason="STORE_MISMATCH",
            metadata={"group": group},
        )


def _check_seed(group: str, saved: int, current: int) -> None:
    if saved != current:
        raise InvalidRequest(
            f"group {group!r} was saved with seed {saved} but has seed {current} in this "
            "job: its root seed differs; pass the saved job's root seed (state_dict()"
            "['job_seed']) to install(), or resume the same job"
        )
