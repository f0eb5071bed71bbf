"""The ``sharding_invariant`` policy: DTensor random ops that draw the same numbers whatever the
mesh, from :mod:`rngcoord.client._portable`'s counter-based Philox.

Under this policy a DTensor random op gives each shard exactly the slice of the tensor that
one device would have drawn with the stream's seed at the stream's cursor, on any device and
for any mesh shape and placement; and the stream itself does not depend on the mesh:

- **Streams.** One stream per job and pipeline stage, named ``invariant`` (no split dims) or
  ``invariant[pp:1]`` (the stage's coordinates on the split dims, see
  :func:`rngcoord.client._groups.invariant_group`). Every rank with the same split coordinates
  joins it, whatever mesh or sub-mesh an op runs on, so a job resized from 4 ranks to 2 joins
  the same stream in a new epoch, and ``--resume`` (``load_state_dict``) continues it at the
  saved cursor: the same numbers as the uninterrupted run.
- **Offsets.** An op of ``n`` Philox blocks (``_portable.offsets_consumed``: ``ceil(numel /
  E)``, ``E`` values per 128-bit block) moves the cursor by ``4 n``: the cursor still counts
  32-bit words, a multiple of 4, and block ``b`` of the op sits at ``cursor / 4 + b``.
  Example: ``rand(8, 16)`` (float32, 4 values per block) at cursor 0 consumes 32 blocks and
  moves the cursor to 128 on every rank; a ``[Shard(1)]`` shard of columns 8..15 on one rank
  of two draws blocks ``2 r + 2`` and ``2 r + 3`` of row ``r``, which is what one device drew.

How an op reaches it: the tracker's region pushes :class:`_InvariantMode`, a
TorchDispatchMode that catches the local random op DTensor runs inside the region (the
factories ``rand``/``randn``, and, through the router's custom op handler
``rngcoord.client._router.random_op``, every dispatched random op, on CUDA too, where DTensor
would otherwise take the ``run_dtensor_rng_op`` path), and returns the portable values
instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from rngcoord.client import _portable
from rngcoord.client._compiling import not_compiled
from rngcoord.client._errors import RNGCoordError


class Stream(Protocol):
    """The stream an op draws from (the tracker's): its seed, and ``advance(size, op_key)``,
    which accounts an op of ``size`` offsets and returns its base."""

    seed: int

    def advance(self, size: int, op_key: bytes) -> int: ...


_aten = torch.ops.aten
#: The random ops the policy handles (DTensor's random ops, and ``random_``).
INVARIANT_OPS = (
    _aten.uniform_.default,
    _aten.normal_.default,
    _aten.bernoulli_.float,
    _aten.bernoulli.default,
    _aten.native_dropout.default,
    _aten.rand_like.default,
    _aten.randn_like.default,
    _aten.randint_like.default,
    _aten.randint_like.low_dtype,
    _aten.random_.default,
    getattr(_aten.random_, "from"),  # a Python keyword
    _aten.random_.to,
)
# What the mode catches inside a region: the ops above plus the factories that DTensor's
# rand/randn call on the local shape.
_CAUGHT = frozenset(op.overloadpacket.__name__ for op in INVARIANT_OPS) | {"rand", "randn"}


def local_ranges(spec: DTensorSpec) -> list[tuple[int, int]]:
    """``(start, length)`` per dim of the global tensor that this rank's shard holds."""
    for placement in spec.placements:
        if isinstance(placement, Partial | _StridedShard):
            raise RNGCoordError(
                f"the sharding_invariant policy cannot draw for placement {placement} (a "
                "partial sum, or a strided shard, is not a box of the global tensor): "
                "redistribute to Shard or Replicate first"
            )
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return [(int(o), int(n)) for o, n in zip(offset, shape, strict=True)]


class _InvariantMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Replaces the local random op of one DTensor op with its portable values."""

    def __init__(self, stream: Stream, spec: DTensorSpec, op_key: Callable[[], bytes]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._stream = stream
        self._spec = spec
        self._op_key = op_key

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in _CAUGHT:
            return func(*args, **kwargs)
        bound = _portable.bind_op_args(func, args, kwargs)
        first = args[0]
        output: torch.Tensor
        mask = None
        if name in ("rand", "randn"):
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            output = torch.empty(tuple(first), dtype=dtype, device=kwargs.get("device"))
        elif name.endswith("_like") or name == "bernoulli":
            output = torch.empty_like(first, dtype=kwargs.get("dtype") or first.dtype)
        elif name == "native_dropout":
            output = first.clone()
            mask = torch.empty_like(first, dtype=torch.bool)
            bound["mask_out"] = mask
        else:
            output = first  # in place
        spec = self._spec
        blocks = _portable.offsets_consumed(name, spec.shape, output.dtype, **bound)
        base = self._stream.advance(4 * blocks, self._op_key())
        _portable.portable_fill_(
            name,
            output,
            seed=self._stream.seed,
            base_offset=base // 4,
            global_shape=spec.shape,
            local_ranges=local_ranges(spec),
            **bound,
        )
        return (output, mask) if mask is not None else output


class InvariantRegion:
    """The region in which DTensor runs the local op of ``spec``: its random op draws the
    portable values from ``stream`` (which moves when the op is dispatched).

    Its entry and exit are hidden from Dynamo, like the tracker's other regions."""

    def __init__(self, stream: Stream, spec: DTensorSpec, op_key: Callable[[], bytes]) -> None:
        self._mode = _InvariantMode(stream, spec, op_key)

    @not_compiled
    def __enter__(self) -> None:
        self._mode.__enter__()  # type: ignore[no-untyped-call]

    @not_compiled
    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
