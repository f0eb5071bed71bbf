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

:class:`rngcoord.client.OffsetBasedRNGTracker` is the default policy, built on it:
one stream per group (by default one per (sub)mesh), whose seed, epoch and leases come from
the coordinator.

How a draw reaches the device:

- Philox devices (cuda and cuda-like): the device's default generator is set to
  ``(seed, base + shard start)`` before the op and left at ``(seed, base + end)`` after it,
  as upstream leaves it. On CUDA, DTensor's dispatch runs the op through
  ``torch._prims.rng_prims.run_dtensor_rng_op`` and calls only ``_compute_rng_offsets``:
  the tracker sets ``(seed, base)`` there and the higher-order op adds the shard start.
- CPU: the default CPU generator is given the state of the stream
  ``cpu_key(seed, base + shard start)`` (:mod:`rngcoord.client._devices`) for the op, and the
  user's CPU state is restored afterwards.

torch.compile: DTensor's dispatch, and so the tracker, runs when a graph is traced, not when
it runs, and upstream's graph reads the device generator *at run time*
(``run_dtensor_rng_op``'s CUDA impl, or the plain op). While it is traced, the tracker's
region therefore records the local random op as the custom op ``rngcoord::draw``
(:mod:`rngcoord.client._traced`), which enters this region when the graph runs: compiled
graphs draw from the leases, with ``fullgraph=True`` too, on every backend and for other
tracers (make_fx, export) alike, and compiled and eager values and cursors are equal bit for
bit. A trace never plans or joins a group. What cannot be recorded (a user generator,
symbolic shapes) breaks Dynamo's graph before the op, which then runs eagerly from its
lease, or is refused under other tracers. ``compiled_random_ops="device"`` opts out: traced
ops then draw from the device generator as it stands, outside the leases, as upstream's do.
The tracker's own code is ``torch.compiler.disable``d: after a graph break, DTensor's
dispatch runs from a resumed frame and Dynamo would otherwise compile the _regions.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import struct
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.tensor._random as dtensor_random
from torch.distributed._functional_collectives import _are_we_tracing
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from rngcoord.client import _callers, _invariant, _regions, _traced
from rngcoord.client._compiling import not_compiled
from rngcoord.client._devices import (
    CPUStateWriter,
    DeviceHandle,
    check_philox_offset,
    cpu_key,
    device_handle,
)
from rngcoord.client._errors import (
    InvalidRequest,
    RNGCoordError,
)
from rngcoord.client._groups import (
    GroupSpec,
    invariant_group,
    stream_group,
)
from rngcoord.client._leases import (
    INITIAL_DIGEST,
    StreamState,
)
from rngcoord.client._router import random_op
from rngcoord.client._trace import OpTrace

logger = logging.getLogger("rngcoord.client.tracker")
_T = TypeVar("_T")

#: ``format`` of the dicts :meth:`RNGStateTracker.state_dict` returns.
STATE_FORMAT = "rngcoord.tracker/1"
_MAX_PLANS = 4096
_STATE16 = struct.Struct("<QQ")

#: What a traced (compiled) DTensor random op does: see the module docstring.
CompiledOps = Literal["eager", "device"]
#: How a DTensor random op draws: DTensor's offsets on the device generator ("offsets"), or
#: the portable, mesh-independent values of rngcoord.client._invariant.
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


class Stream(Protocol):
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

    stream: Stream | None  # None: this rank is not part of the spec's mesh
    start: int
    end: int
    shape: str
    op_keys: dict[object, bytes]


class RNGStateTracker:
    """Named random streams of one rank, applied to the device around DTensor random ops.

    Each stream has a tag, a seed (uint64) and an offset (the cursor: where the next op's
    offsets start). The streams of this class live in this process: set them with
    :meth:`set_seed` and :meth:`set_offset`. A mesh's stream is the one tagged with the mesh's
    group name (:func:`rngcoord.client._groups.group_name`). With the same seeds and start
    offsets it draws exactly what :class:`OffsetBasedRNGTracker` draws.

    Args:
        device_type: The device of the DTensors' local shards: ``"cpu"`` (default),
            ``"cuda"``, or a cuda-like device with a ``torch.<device_type>`` module.
        rank: This rank's global rank. Default ``None``: ``torch.distributed.get_rank()``.
        root: The job's root mesh, whose sub-meshes' copies share streams along replicate
            dims (:func:`rngcoord.client._groups.stream_group`). Default ``None``: every mesh
            is its own stream.
        split_dims: Names of ``root``'s dims whose sub-mesh copies draw separately. Default
            ``None``: dims named ``pp*`` or ``pipe*``.
        policy: ``"offsets"`` (default): DTensor's offset semantics on the device's own
            generator (the shard layout above). ``"sharding_invariant"``: every shard gets
            the slice of what one device would draw, from a stream named independently of
            the mesh (:mod:`rngcoord.client._invariant`).
        compiled_random_ops: ``"eager"`` (default): a traced DTensor random op (torch.compile,
            make_fx, export) draws from the streams when the graph runs, exactly as the eager
            op would (``rngcoord::draw``); ``"device"``: traced ops draw from the device
            generator as it stands (upstream's behaviour), outside the streams. See the
            module docstring.
        trace: Write a JSON line per op drawn from the streams to this path (``{rank}`` is
            replaced by the rank; :mod:`rngcoord.client._trace`), for ``rngcoord replay
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
        self._streams: dict[str, Stream] = {}
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

    def _stream(self, tag: str) -> Stream:
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
        check_in_mesh(mesh, self.rank, "manual_seed")
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

    def _stream_states(self) -> Mapping[str, Stream]:
        return self._streams

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue every stream of ``state`` where it was saved."""
        for tag, entry in streams_of(state).items():
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
            return dict.fromkeys(_invariant.INVARIANT_OPS, random_op)
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
            stream = _callers.TracedStream(
                stream, self._trace, self._stream_tag(spec), spec, caller
            )
        if self.policy == "sharding_invariant":
            return _invariant.InvariantRegion(stream, spec, lambda: self._op_key(plan, caller))
        if self._cpu_writer is not None:
            base = stream.advance(plan.end, self._op_key(plan, caller))
            return _regions.CPURegion(self._cpu_writer, cpu_key(stream.seed, base + plan.start))
        check_philox_offset(stream.cursor + plan.end)
        base = stream.advance(plan.end, self._op_key(plan, caller))
        return _regions.PhiloxRegion(self, stream.seed, base + plan.start, base + plan.end)

    def _traced_region(
        self,
        spec: DTensorSpec,
        generator: torch.Generator | None,
        caller: types.FrameType | None,
    ) -> contextlib.AbstractContextManager[None]:
        """The region of a DTensor random op that is being traced (torch.compile, make_fx,
        export): the graph gets ``rngcoord::draw``, which draws from the leases when it runs
        (rngcoord.client._traced). Nothing is planned or joined here: a trace never talks to
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
            return _traced.TracedRegion(spec, _callers.caller_op(caller))
        except _traced.UntraceableRandomOp as e:
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
                "outside rngcoord.client._invariant.INVARIANT_OPS took DTensor's CUDA path"
            )
        if _are_we_tracing():
            check_in_mesh(spec.mesh, self.rank, "a DTensor random op")
            start, end = shard_offsets(spec)
            if self.compiled_random_ops == "device":
                _warn_tracing_once()
            else:
                # run_dtensor_rng_op follows in DTensor's frame; the router's replacement
                # runs the op inside this region, which records rngcoord::draw instead, and
                # the draw's region sets the generator when the graph runs. Nothing is
                # planned (joined) here: a trace never talks to the coordinator.
                _traced.set_pending(_traced.TracedRegion(spec, _callers.caller_op(caller)))
            return start, end
        _traced.set_pending(None)
        plan = self._plans.get(spec) or self._plan(spec)
        if plan.stream is None:
            raise RNGCoordError(f"rank {self.rank} is not part of the mesh of {spec}")
        stream = plan.stream
        if self._trace is not None:
            stream = _callers.TracedStream(
                stream, self._trace, self._stream_tag(spec), spec, caller
            )
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

    def _stream_for(self, mesh: DeviceMesh) -> Stream:
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
        op = _callers.caller_op(caller)
        key = plan.op_keys.get(op)
        if key is None:
            name = "<unknown op>" if op is None else _callers.op_name(op)
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
            return _regions.CPURegion(
                self._cpu_writer or CPUStateWriter(), cpu_key(drawn, plan.start)
            )
        return _regions.UserPhiloxRegion(self, generator, plan.start, plan.end)


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


def check_in_mesh(mesh: DeviceMesh, rank: int, what: str) -> None:
    if mesh.get_coordinate() is None:
        # Upstream's manual_seed raises RuntimeError with this text; keep it matchable.
        raise InvalidRequest(
            f"{what} requires the current rank to be a part of the device mesh: rank {rank} "
            f"is not in {mesh}"
        )


def streams_of(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
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
