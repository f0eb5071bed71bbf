"""DTensor random ops inside traced graphs: the opaque custom op ``rngcoord::draw``.

A traced graph (torch.compile, make_fx, export) runs long after DTensor's dispatch, and so
the tracker, ran; a graph that holds the plain random op reads the device generator when it
runs, outside the leases. So while DTensor's dispatch is traced, the tracker's region pushes
:class:`TracedRegion`, a TorchDispatchMode that catches the local random op and records
``torch.ops.rngcoord.draw(tensors, recipe)`` in its place. At run time that op does what the
eager op would: it enters the calling rank's tracker region (the lease's (seed, offset) on the
device generator, or the CPU stream key, or the portable values) and runs the aten op there.
Compiled and eager draws are therefore the same draws, bit for bit, and move the cursors
alike, on every backend, with ``fullgraph=True`` or not: the graph never breaks.

What keeps the op in place (docs/design.md §5.5):

- It is registered with an ORDERED effect (``torch._library.effects``): functionalization
  threads an effect token through every effectful op (``with_effects(token, op, ...)``), so
  the graph holds a data dependency from each draw to the next and to the graph's output.
  Nothing can reorder two draws, nor drop one whose values go unused (the cursor must move
  as in eager), and Inductor lowers ``with_effects`` to kernels it keeps in token order.
- It is tagged ``nondeterministic_seeded``: CSE never merges two draws, and the min-cut
  partitioner never recomputes one in the backward pass (which would draw again).
- It is opaque: Inductor calls it as an extern kernel and never generates its own random
  numbers for it, so ``fallback_random`` does not matter for DTensor draws.
- It is functional (``mutates_args=()``): an in-place random op (``uniform_``) is recorded as
  a draw into a copy followed by ``copy_``, which functionalization handles as any copy.

The recipe (a JSON string, the op's only non-tensor argument) names the aten op, its
non-tensor arguments, the name the tracker fingerprints it by, and the DTensorSpec through a
key that holds no rank: Inductor's and AOTAutograd's caches share a compiled graph between
ranks (their keys do not hold the rank either), so each rank finds its own spec under the
key. Every trace of the op, Dynamo's fake-tensor pass included, files the spec under its key,
so a graph loaded from those caches in a fresh process still finds it: Dynamo traces the
frame, and so runs DTensor's dispatch, before it looks in the caches.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations of
# `draw` to build its schema.

import json
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.distributed.tensor._random as dtensor_random
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils._python_dispatch import TorchDispatchMode

from rngcoord.client._compiling import not_compiled
from rngcoord.client._errors import RNGCoordError

#: Random ops the mode catches: DTensor's random ops, the distributions the router handles
#: (router.EXTRA_RANDOM_OPS), random_, and the factories DTensor's rand/randn call.
RANDOM_OP_NAMES = frozenset(
    {
        "native_dropout",
        "normal_",
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint_like",
        "uniform_",
        "bernoulli",
        "bernoulli_",
        "exponential_",
        "log_normal_",
        "geometric_",
        "cauchy_",
        "random_",
    }
)
# Factories take a size and no tensor: they are recorded with an empty tensor of the local
# shape as input, whose shape, dtype and device the run reads (a device index would
# otherwise be burnt into a graph that other ranks may load from the caches).
_FACTORIES = frozenset({"rand", "randn"})

_specs: dict[str, DTensorSpec] = {}
_specs_lock = threading.Lock()


class UntraceableRandomOp(RNGCoordError):
    """A DTensor random op whose arguments a graph cannot carry (symbolic sizes, an
    unknown argument type)."""


def spec_key(spec: DTensorSpec) -> str:
    """A key of ``spec`` that is equal on every rank: its mesh's identity as DeviceMesh
    compares and hashes it (the root's ranks and the mesh's layout, not this rank's slice),
    placements, global shape, stride and dtype."""
    mesh = spec.mesh
    stable = getattr(mesh, "_stable_hash", None)
    mesh_id = (
        stable()
        if callable(stable)
        else repr((mesh.device_type, mesh.mesh_dim_names, mesh.mesh.tolist()))
    )
    meta = spec.tensor_meta
    for size in (*spec.shape, *spec.stride):
        if not isinstance(size, int):
            raise UntraceableRandomOp(
                f"a DTensor random op on a tensor of symbolic shape {tuple(spec.shape)}: "
                "rngcoord places its offsets by the global shape when the graph runs, and "
                "a symbolic one is not known then; mark the shapes static "
                "(torch.compile(dynamic=False)) for random ops"
            )
    dtype = None if meta is None else str(meta.dtype)
    return json.dumps(
        [mesh_id, [str(p) for p in spec.placements], list(spec.shape), list(spec.stride), dtype]
    )


def file_spec(spec: DTensorSpec) -> str:
    """File ``spec`` under its key for the draws that run later; return the key."""
    key = spec_key(spec)
    with _specs_lock:
        # The latest: an equal spec of a mesh built again (new process groups) replaces it.
        _specs[key] = spec
    return key


def _encode(value: object, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return {"seq": [_encode(v, tensors) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        if tensors and value == tensors[0].device:
            return {"device_of": 0}
        return {"device": str(value)}
    raise UntraceableRandomOp(
        f"a DTensor random op with an argument of type {type(value).__name__} ({value!r}) "
        "cannot be recorded in a graph"
    )


def _decode(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if not isinstance(value, dict):
        return value
    if "t" in value:
        return tensors[value["t"]]
    if "seq" in value:
        return [_decode(v, tensors) for v in value["seq"]]
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    if "layout" in value:
        return getattr(torch, value["layout"])
    if "memory_format" in value:
        return getattr(torch, value["memory_format"])
    if "device_of" in value:
        return tensors[value["device_of"]].device
    if "shape_of" in value:
        return list(tensors[value["shape_of"]].shape)
    return torch.device(value["device"])


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, packet, overload = name.split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    assert isinstance(op, torch._ops.OpOverload)
    return op


def _caller_name(op: object) -> str | None:
    """How the recipe names the op the tracker fingerprints (what DTensor's frame held)."""
    if isinstance(op, torch._ops.OpOverload):
        return f"op:{op}"
    name = getattr(op, "__name__", None)
    if isinstance(name, str) and getattr(torch, name, None) is op:
        return f"torch:{name}"
    return None


def _caller_object(name: str | None) -> object | None:
    if name is None:
        return None
    kind, _, rest = name.partition(":")
    return _overload(rest) if kind == "op" else getattr(torch, rest)


@dataclass(frozen=True)
class _Recipe:
    op: torch._ops.OpOverload
    args: list[Any]
    kwargs: dict[str, Any]
    inplace: bool
    spec: str
    caller: object | None


@lru_cache(maxsize=4096)
def _parse(recipe: str) -> _Recipe:
    raw = json.loads(recipe)
    return _Recipe(
        _overload(raw["op"]),
        raw["args"],
        raw["kwargs"],
        raw["inplace"],
        raw["spec"],
        _caller_object(raw["caller"]),
    )


def _run(tensors: Sequence[torch.Tensor], recipe: str) -> list[torch.Tensor]:
    """The draw, when a graph runs: the aten op in the calling rank's tracker region."""
    r = _parse(recipe)
    spec = _specs.get(r.spec)
    if spec is None:
        raise RNGCoordError(
            "a compiled graph runs a DTensor random op whose DTensorSpec this process never "
            "traced (a graph from another process's cache, for a mesh this process does not "
            f"have): {r.spec}"
        )
    router = dtensor_random._rng_tracker
    get_tracker: Callable[[], Any] | None = getattr(router, "tracker", None)
    if get_tracker is None:
        raise RNGCoordError(
            "a compiled graph draws a DTensor random op from rngcoord's leases, but rngcoord "
            "is not installed on this rank (anymore): call rngcoord.client.install() before "
            "running graphs compiled under it"
        )
    args = [_decode(a, tensors) for a in r.args]
    kwargs = {k: _decode(v, tensors) for k, v in r.kwargs.items()}
    if r.inplace:
        args[0] = args[0].clone()  # the op is functional: draw into a copy
    # The tracker fingerprints the op by this local (callers._CALLERS names this frame).
    op_call = r.caller  # noqa: F841
    with get_tracker().region(spec, None, sys._getframe()):
        out = r.op(*args, **kwargs)
    if r.inplace:
        return [args[0]]
    return list(out) if isinstance(out, tuple) else [out]


@torch.library.custom_op(
    "rngcoord::draw", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def draw(tensors: list[torch.Tensor], recipe: str) -> list[torch.Tensor]:
    """Run the recipe's random op from the calling rank's tracker (see the module docstring)."""
    return _run(tensors, recipe)


@draw.register_fake
def _draw_fake(tensors: list[torch.Tensor], recipe: str) -> list[torch.Tensor]:
    # Shapes only: the aten op on fake tensors, outside any region (no stream moves).
    r = _parse(recipe)
    args = [_decode(a, tensors) for a in r.args]
    kwargs = {k: _decode(v, tensors) for k, v in r.kwargs.items()}
    if r.inplace:
        args[0] = args[0].clone()
        r.op(*args, **kwargs)
        return [args[0]]
    out = r.op(*args, **kwargs)
    return list(out) if isinstance(out, tuple) else [out]


def _register_ordered_effect() -> None:
    from torch._library.effects import EffectType

    draw.register_effect(EffectType.ORDERED)


_register_ordered_effect()


class _TraceMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the region's random op as ``rngcoord::draw``; other ops pass through."""

    def __init__(self, spec: str, caller: str | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._spec = spec
        self._caller = caller
        self._recorded = False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in RANDOM_OP_NAMES:
            return func(*args, **kwargs)
        if self._recorded:
            # DTensor runs one local op per region; a second would read the device
            # generator in the graph, outside the leases.
            raise RNGCoordError(f"a second random op ({func}) in one DTensor random op's region")
        self._recorded = True
        return record(func, args, kwargs, self._spec, self._caller)


def record(
    func: torch._ops.OpOverload,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    spec: str,
    caller: str | None,
) -> Any:
    """Call ``rngcoord::draw`` for ``func(*args, **kwargs)`` (under the tracer, which records
    it) and give back what ``func`` would."""
    tensors: list[torch.Tensor] = []
    name = func.overloadpacket.__name__
    local_args: list[Any] = list(args)
    local_kwargs = dict(kwargs)
    if name in _FACTORIES:
        template = torch.empty(
            args[0],
            dtype=kwargs.get("dtype") or torch.get_default_dtype(),
            device=kwargs.get("device"),
        )
        tensors.append(template)
        encoded_args: list[Any] = [{"shape_of": 0}, *(_encode(a, tensors) for a in args[1:])]
        local_kwargs.pop("device", None)
        encoded_kwargs = {k: _encode(v, tensors) for k, v in local_kwargs.items()}
        encoded_kwargs["device"] = {"device_of": 0}
    else:
        encoded_args = [_encode(a, tensors) for a in local_args]
        encoded_kwargs = {k: _encode(v, tensors) for k, v in local_kwargs.items()}
    inplace = func._schema.is_mutable
    recipe = json.dumps(
        {
            "op": str(func),
            "args": encoded_args,
            "kwargs": encoded_kwargs,
            "inplace": inplace,
            "spec": spec,
            "caller": caller,
        },
        sort_keys=True,
    )
    outs = torch.ops.rngcoord.draw(tensors, recipe)
    if inplace:
        target = args[0]
        target.copy_(outs[0])
        return target
    return tuple(outs) if len(func._schema.returns) > 1 else outs[0]


class TracedRegion:
    """The region of a DTensor random op that is being traced: files its spec, and records
    its local random op as ``rngcoord::draw``. Its entry and exit are hidden from Dynamo,
    like the tracker's other regions."""

    def __init__(self, spec: DTensorSpec, caller_op: object | None) -> None:
        self._mode = _TraceMode(file_spec(spec), _caller_name(caller_op))

    @not_compiled
    def __enter__(self) -> None:
        self._mode.__enter__()  # type: ignore[no-untyped-call]

    @not_compiled
    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]


# DTensor's CUDA path calls the tracker's _compute_rng_offsets and then, in the same frame,
# run_dtensor_rng_op: the tracker leaves the traced region here for the router's
# replacement of run_dtensor_rng_op to enter around the op.
_pending = threading.local()


def set_pending(region: TracedRegion | None) -> None:
    _pending.region = region


def take_pending() -> TracedRegion | None:
    region: TracedRegion | None = getattr(_pending, "region", None)
    _pending.region = None
    return region
