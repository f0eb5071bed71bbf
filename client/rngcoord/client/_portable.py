"""Sharding-invariant, device-invariant random numbers on :mod:`rngcoord.client._philox`.

This module is responsible for the distributions of rngcoord's ``sharding_invariant`` policy
and for the entry points the tracker calls. A draw is a pure function of (seed, base offset,
global shape, distribution, dtype): each rank computes only its shard, and the shard equals,
bit for bit, the same slice of the whole tensor drawn on one device, on any device (CPU,
CUDA...). The offsets an op consumes depend only on the global shape, never on the sharding.

Layout
------
Element ``i`` (row-major linear index in the global shape) of a distribution packing ``E``
elements per Philox block uses block ``i // E`` at position ``base_offset + i // E`` and the
words ``(4 // E) * (i % E) ..`` of it (:mod:`rngcoord.client._philox` has a worked example).
An op consumes ``ceil(numel / E)`` offsets (one offset = one 128-bit block).

======================  ====  ===========================================================
distribution            E     element from its words
======================  ====  ===========================================================
uniform float32         4     ``(w >> 8) * 2^-24``: 24 bits, in [0, 1)
uniform float16         4     ``(w >> 21) * 2^-11``: 11 bits, in [0, 1)
uniform bfloat16        4     ``(w >> 24) * 2^-8``: 8 bits, in [0, 1)
uniform float64         2     ``((wa >> 5) * 2^26 + (wb >> 6)) * 2^-53``: 53 bits, in [0, 1)
normal float32/16/bf16  4     Box-Muller on a word pair ``(wa, wb) = (w_2j, w_2j+1)``, in
                              float32: elements ``2j, 2j+1`` of a block are
                              ``r cos a, r sin a``, ``r = sqrt(-2 ln u1)``,
                              ``u1 = float32(wa + 1) * 2^-32`` in (0, 1] (tails to 6.66
                              sigma), ``a = (wb >> 30) pi/2 + t``,
                              ``t = (wb & 0x3FFFFFFF) * 2^-30 * pi/2 - pi/4``
normal float64          2     the same in float64 with ``u1`` from ``w0, w1`` (53 bits, plus
                              ``2^-53``), the quadrant ``w2 >> 30`` and ``t`` from 51 bits
                              (the low 30 of ``w2``, the high 21 of ``w3``)
bernoulli(p), dropout   4     ``1`` when ``w < ceil(p * 2^32)``, i.e. ``w * 2^-32 < p``
randint, range <= 2^32  4     ``low + w % range``
randint, range > 2^32   2     ``low + ((wa & 0x7FFFFFFF) * 2^32 + wb) % range`` (range <= 2^63)
======================  ====  ===========================================================

Uniform on ``[low, high)`` is ``low + u * (high - low)`` in float64, rounded to the dtype
(16-bit dtypes: to float32, then to the dtype); a value that rounds up to ``high`` becomes
the largest value of the dtype below it. Normal ``mean + std * z`` is computed in float32
(float64 for float64) and then rounded to the dtype. randint has the modulo bias torch's own
CPU ``random_`` has (below ``range / 2^32``, resp. ``range / 2^63``).

Device invariance needs every step to be exactly rounded IEEE arithmetic, so the logarithm,
sine, cosine and square root are built here from add, subtract, multiply, divide, integer
ops on the floats' bits and conversions, never ``torch.log``/``torch.cos``/``torch.sqrt``,
whose last bits differ between CPU and CUDA libraries (torch 2.13's CPU ``sqrt`` is not
even exactly rounded). They are
accurate to a few units in the last place of the arithmetic's dtype (float64 for float64
output, float32 otherwise).

The local slice
---------------
A shard is described by ``global_shape`` and ``local_ranges``: one ``(start, length)`` per
dimension, the global indices the local tensor covers (what DTensor's
``compute_local_shape_and_global_offset`` gives: ``zip(global_offset, local_shape)``). Any
box of the global tensor works, including empty ones, uneven shards and views of a
replicated tensor. Non-box index sets (``_StridedShard``) are not expressible.

Entry points for the tracker
----------------------------
- :func:`portable_fill_` fills a local tensor for ``uniform_``, ``normal_``, ``bernoulli_``,
  ``bernoulli``, ``random_``, ``rand``, ``rand_like``, ``randn``, ``randn_like``,
  ``randint_like``, ``native_dropout`` and ``dropout`` (:data:`SUPPORTED_OPS`). Names may be
  given as ``"uniform_"`` or as the OpOverload's ``"aten.uniform_.default"``.
- :func:`offsets_consumed` gives an op's offsets without drawing.
- :func:`bind_op_args` turns an aten call's ``(args, kwargs)`` into their keyword arguments.
- :func:`uniform`, :func:`normal`, :func:`bernoulli`, :func:`bernoulli_tensor`,
  :func:`randint` and :func:`dropout` return new local tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rngcoord.client import _converters
from rngcoord.client._converters import Converter
from rngcoord.client._philox import POSITION_LIMIT, philox_blocks, split_key

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

Range = tuple[int, int]


class Draw(NamedTuple):
    """A local draw and the offsets the whole global op consumed.

    Args:
        values: The local tensor, the slice ``local_ranges`` of the global draw.
        offsets: Offsets (Philox blocks) the op consumed for the whole global tensor: the next
            op starts at ``base_offset + offsets``.
    """

    values: torch.Tensor
    offsets: int


@dataclass(frozen=True)
class _Slice:
    """A validated box: the global shape, the local ranges and the local shape."""

    global_shape: tuple[int, ...]
    ranges: tuple[Range, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(length for _, length in self.ranges)


def _box(global_shape: Sequence[int], local_ranges: Sequence[Range] | None) -> _Slice:
    shape = tuple(global_shape)
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"global_shape must be non-negative ints, got {tuple(global_shape)!r}")
    if local_ranges is None:
        return _Slice(shape, tuple((0, s) for s in shape))
    ranges = tuple(tuple(r) for r in local_ranges)
    if len(ranges) != len(shape):
        raise ValueError(
            f"local_ranges has {len(ranges)} (start, length) pairs for a "
            f"{len(shape)}-dimensional global shape {shape}"
        )
    for dim, (r, size) in enumerate(zip(ranges, shape, strict=True)):
        if len(r) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in r):
            raise ValueError(
                f"local_ranges[{dim}] must be a (start, length) pair of ints, got {r!r}"
            )
        start, length = r
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(
                f"local_ranges[{dim}] = ({start}, {length}) is outside dimension {dim} of "
                f"size {size}: need 0 <= start and start + length <= {size}"
            )
    return _Slice(shape, ranges)  # type: ignore[arg-type]


def _check_positions(base_offset: int, offsets: int) -> None:
    if not isinstance(base_offset, int) or isinstance(base_offset, bool) or base_offset < 0:
        raise ValueError(f"base_offset must be a non-negative int, got {base_offset!r}")
    if base_offset + offsets > POSITION_LIMIT:
        raise ValueError(
            f"the op needs offsets {base_offset}..{base_offset + offsets - 1}, past the 64-bit "
            "Philox position space; start a new seed"
        )


def _draw(
    seed: int,
    base_offset: int,
    box: _Slice,
    per_block: int,
    convert: Converter,
    out_dtype: torch.dtype,
    device: torch.device,
) -> Draw:
    """The local slice of the global element sequence ``convert`` makes from the blocks."""
    offsets = -(-box.numel // per_block)
    _check_positions(base_offset, offsets)
    split_key(seed)  # rejects a bad seed on every rank, those with empty shards too
    local_shape = box.local_shape
    if math.prod(local_shape) == 0:
        return Draw(torch.empty(local_shape, dtype=out_dtype, device=device), offsets)
    # The box is a set of runs, each contiguous in the global order: dimensions after `inner`
    # are whole, so a run covers ranges[inner] times their size; runs are indexed by the
    # dimensions before `inner`.
    dims = len(box.global_shape)
    inner = dims - 1
    while inner > 0 and box.ranges[inner] == (0, box.global_shape[inner]):
        inner -= 1
    strides = [math.prod(box.global_shape[d + 1 :]) for d in range(dims)]
    run = box.ranges[inner][1] * strides[inner] if dims else 1
    starts = torch.full((), box.ranges[inner][0] * strides[inner] if dims else 0, dtype=torch.int64)
    for d in range(inner - 1, -1, -1):
        start, length = box.ranges[d]
        index = torch.arange(start, start + length, dtype=torch.int64) * strides[d]
        starts = index.view(-1, *([1] * starts.dim())) + starts
    starts = starts.reshape(-1).to(device)
    # A run of `run` elements starting anywhere in a block spans at most this many blocks.
    span = (run + per_block - 2) // per_block + 1
    first = starts // per_block
    blocks = first[:, None] + torch.arange(span, dtype=torch.int64, device=device)
    # The last run's span may reach past the op's blocks: those are computed, never used.
    blocks.clamp_(max=offsets - 1)
    values = philox_blocks(seed, base_offset, blocks.view(-1), convert=convert)
    values = values.view(starts.numel(), span * per_block)
    lead = starts - first * per_block
    if starts.numel() == 1:
        at = int(lead.item())
        out = values[0, at : at + run]
    else:
        out = torch.empty((starts.numel(), run), dtype=out_dtype, device=device)
        for at in range(per_block):
            rows = (lead == at).nonzero().view(-1)
            if rows.numel():
                out[rows] = values[rows, at : at + run]
    return Draw(out.reshape(local_shape), offsets)


def _check_float(dtype: torch.dtype, what: str) -> None:
    if dtype not in _FLOATS:
        raise NotImplementedError(
            f"{what} supports float32, float64, float16 and bfloat16, not {dtype}"
        )


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return float(value)


def uniform(
    seed: int,
    base_offset: int,
    global_shape: Sequence[int],
    local_ranges: Sequence[Range] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    low: float = 0.0,
    high: float = 1.0,
) -> Draw:
    """Uniform values on ``[low, high)``: the slice ``local_ranges`` of the global draw.

    Args:
        seed: The 64-bit seed (the Philox key).
        base_offset: The op's first Philox position.
        global_shape: The shape of the whole (global) tensor.
        local_ranges: One ``(start, length)`` per dimension: the box of the global tensor to
            return. Default ``None``: the whole tensor.
        dtype: float32 (the default), float64, float16 or bfloat16.
        device: Where to compute and return the values. Default ``"cpu"``.
        low: The lower bound (included). Default 0.
        high: The upper bound (excluded). Default 1.

    Returns:
        The local values and the offsets consumed (``ceil(numel / 4)``, float64:
        ``ceil(numel / 2)``).
    """
    _check_float(dtype, "uniform")
    lo, hi = _number(low, "low"), _number(high, "high")
    if not lo <= hi or math.isinf(lo) or math.isinf(hi):
        raise ValueError(f"uniform needs finite low <= high, got [{low}, {high})")
    per_block, convert = _converters.uniform_converter(dtype)
    draw = _draw(seed, base_offset, _box(global_shape, local_ranges), per_block, convert,
                 dtype, torch.device(device))  # fmt: skip
    if (lo, hi) == (0.0, 1.0):
        return draw
    v = draw.values.to(torch.float64) * (hi - lo) + lo
    if dtype != torch.float64:
        v = v.to(torch.float32).to(dtype)
    if lo < hi:
        top = torch.tensor(hi, dtype=dtype).item()
        v = torch.where(v >= top, _converters.next_below(top, dtype), v)
    return Draw(v, draw.offsets)


def normal(
    seed: int,
    base_offset: int,
    global_shape: Sequence[int],
    local_ranges: Sequence[Range] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    mean: float = 0.0,
    std: float = 1.0,
) -> Draw:
    """Normal values (Box-Muller): the slice ``local_ranges`` of the global draw.

    Args:
        seed: The 64-bit seed (the Philox key).
        base_offset: The op's first Philox position.
        global_shape: The shape of the whole (global) tensor.
        local_ranges: One ``(start, length)`` per dimension: the box of the global tensor to
            return. Default ``None``: the whole tensor.
        dtype: float32 (the default), float64, float16 or bfloat16 (computed as float32, then
            rounded).
        device: Where to compute and return the values. Default ``"cpu"``.
        mean: The mean. Default 0.
        std: The standard deviation, ``>= 0``. Default 1.

    Returns:
        The local values and the offsets consumed (``ceil(numel / 4)``, float64:
        ``ceil(numel / 2)``).
    """
    _check_float(dtype, "normal")
    mu, sigma = _number(mean, "mean"), _number(std, "std")
    if sigma < 0 or math.isinf(sigma) or math.isinf(mu):
        raise ValueError(f"normal needs a finite mean and a finite std >= 0, got {mean}, {std}")
    per_block, convert = _converters.normal_converter(dtype, mu, sigma)
    return _draw(seed, base_offset, _box(global_shape, local_ranges), per_block, convert,
                 dtype, torch.device(device))  # fmt: skip


def _probability(p: Any, name: str = "p") -> float:
    value = _number(p, name)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    return value


def bernoulli(
    seed: int,
    base_offset: int,
    global_shape: Sequence[int],
    local_ranges: Sequence[Range] | None = None,
    *,
    p: float = 0.5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Draw:
    """Bernoulli(p) values, 1 with probability ``p``: the slice ``local_ranges`` of the draw.

    Element ``i`` is 1 exactly when its word ``w`` satisfies ``w * 2^-32 < p``.

    Args:
        seed: The 64-bit seed (the Philox key).
        base_offset: The op's first Philox position.
        global_shape: The shape of the whole (global) tensor.
        local_ranges: One ``(start, length)`` per dimension: the box of the global tensor to
            return. Default ``None``: the whole tensor.
        p: The probability of a 1, in ``[0, 1]``. Default 0.5.
        dtype: The result's dtype (any: bool, integer or floating). Default float32.
        device: Where to compute and return the values. Default ``"cpu"``.

    Returns:
        The local values and the offsets consumed (``ceil(numel / 4)``).
    """
    per_block, convert = _converters.bernoulli_converter(_probability(p), dtype)
    return _draw(seed, base_offset, _box(global_shape, local_ranges), per_block, convert,
                 dtype, torch.device(device))  # fmt: skip


def _random_bounds(low: int, high: int | None, dtype: torch.dtype) -> tuple[int, int]:
    """``(low, span)`` of ``random_(low, high)`` with torch's default upper bound."""
    if high is None:
        if dtype == torch.bool:
            top = 1
        elif dtype.is_floating_point:
            top = 1 << _converters.DIGITS[dtype]
        else:
            top = torch.iinfo(dtype).max
        return low, top - low + 1
    for value, name in ((low, "from"), (high, "to")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"random_ bound {name!r} must be an int, got {value!r}")
    if high <= low:
        raise ValueError(f"random_ needs from < to, got [{low}, {high})")
    return low, high - low


def randint(
    seed: int,
    base_offset: int,
    global_shape: Sequence[int],
    local_ranges: Sequence[Range] | None = None,
    *,
    low: int = 0,
    high: int | None = None,
    dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
) -> Draw:
    """Integers in ``[low, high)``: the slice ``local_ranges`` of the global draw.

    Args:
        seed: The 64-bit seed (the Philox key).
        base_offset: The op's first Philox position.
        global_shape: The shape of the whole (global) tensor.
        local_ranges: One ``(start, length)`` per dimension: the box of the global tensor to
            return. Default ``None``: the whole tensor.
        low: The lower bound (included). Default 0.
        high: The upper bound (excluded), at most ``low + 2^63``. Default ``None``: torch's
            ``random_()`` range for ``dtype`` (``[0, 2^mantissa]`` for floating types, up to
            the type's maximum for integers).
        dtype: The result's dtype. Default int64.
        device: Where to compute and return the values. Default ``"cpu"``.

    Returns:
        The local values and the offsets consumed (``ceil(numel / 4)`` when the range is at
        most 2^32, else ``ceil(numel / 2)``).
    """
    lo, span = _random_bounds(low, high, dtype)
    if span > 1 << 63:
        raise ValueError(f"randint supports ranges up to 2^63 values, got {span}")
    if lo < -(1 << 63) or lo + span - 1 >= 1 << 63:
        raise ValueError(f"randint bounds must fit int64, got [{lo}, {lo + span})")
    per_block, convert = _converters.random_converter(lo, span, dtype)
    return _draw(seed, base_offset, _box(global_shape, local_ranges), per_block, convert,
                 dtype, torch.device(device))  # fmt: skip


def bernoulli_tensor(
    seed: int,
    base_offset: int,
    global_shape: Sequence[int],
    local_ranges: Sequence[Range] | None,
    p: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
) -> Draw:
    """Bernoulli with a probability per element (``torch.bernoulli(p)``), p the local shard.

    Element ``i`` is 1 exactly when its word ``w`` satisfies ``w * 2^-32 < p[i]`` (compared
    in float64, exactly), so a constant ``p`` gives the same values as :func:`bernoulli`.

    Args:
        seed: The 64-bit seed (the Philox key).
        base_offset: The op's first Philox position.
        global_shape: The shape of the whole (global) tensor.
        local_ranges: One ``(start, length)`` per dimension: the box the local ``p`` covers;
            ``None`` for the whole tensor.
        p: Floating tensor of the local shape, values in ``[0, 1]``; its device is used.
        dtype: The result's dtype. Default ``None``: ``p.dtype``.

    Returns:
        The local values and the offsets consumed (``ceil(numel / 4)``).
    """
    box = _box(global_shape, local_ranges)
    if tuple(p.shape) != box.local_shape:
        raise ValueError(f"p has shape {tuple(p.shape)}, the local box is {box.local_shape}")
    if not p.dtype.is_floating_point:
        raise ValueError(f"bernoulli probabilities must be floating, got {p.dtype}")
    words = _draw(seed, base_offset, box, 4, lambda w: torch.stack(w, dim=1), torch.int64, p.device)
    ones = words.values.to(torch.float64) * 2.0**-32 < p.to(torch.float64)
    return Draw(ones.to(p.dtype if dtype is None else dtype), words.offsets)


def dropout(
    seed: int,
    base_offset: int,
    global_shape: Sequence[int],
    local_ranges: Sequence[Range] | None,
    local_input: torch.Tensor,
    *,
    p: float,
    train: bool | None = True,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``torch.native_dropout`` of the local shard: ``(output, mask, offsets consumed)``.

    An element is kept (mask ``True``) when its word ``w`` satisfies ``w * 2^-32 < 1 - p``.
    As in torch, ``output = input * mask * scale`` with ``scale = 1 / (1 - p)`` (0 when
    ``p = 1``), computed in the input's dtype; with ``train=False`` the output is a copy of the
    input, the mask all ``True`` and no offsets are consumed.

    Args:
        seed: The 64-bit seed (the Philox key).
        base_offset: The op's first Philox position.
        global_shape: The shape of the whole (global) tensor.
        local_ranges: One ``(start, length)`` per dimension: the box ``local_input`` covers;
            ``None`` for the whole tensor.
        local_input: The local shard of the input, of the box's shape.
        p: The probability of dropping an element, in ``[0, 1]``.
        train: Whether to drop; ``None`` means ``True``, as in ``native_dropout``. Default
            ``True``.

    Returns:
        The local output, the local bool mask, and the offsets consumed (``ceil(numel / 4)``
        when training, else 0).
    """
    box = _box(global_shape, local_ranges)
    if tuple(local_input.shape) != box.local_shape:
        raise ValueError(
            f"the input has shape {tuple(local_input.shape)}, the local box is {box.local_shape}"
        )
    drop = _probability(p)
    if train is not None and not train:
        return local_input.clone(), torch.ones_like(local_input, dtype=torch.bool), 0
    keep = 1.0 - drop
    mask = bernoulli(seed, base_offset, box.global_shape, box.ranges, p=keep,
                     dtype=torch.bool, device=local_input.device)  # fmt: skip
    scale = 0.0 if keep == 0 else 1.0 / keep
    output = local_input.mul(mask.values.to(local_input.dtype)).mul_(scale)
    return output, mask.values, mask.offsets


def _op_key(op_name: str) -> str:
    """``"aten.uniform_.default"`` and ``"uniform_"`` both name ``uniform_``."""
    parts = str(op_name).split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "aten" else str(op_name)


#: Op names :func:`portable_fill_` and :func:`offsets_consumed` accept, with the keyword
#: arguments each takes.
SUPPORTED_OPS: dict[str, tuple[str, ...]] = {
    "uniform_": ("from", "to"),
    "rand": (),
    "rand_like": (),
    "normal_": ("mean", "std"),
    "randn": (),
    "randn_like": (),
    "bernoulli_": ("p",),
    "bernoulli": ("p",),
    "random_": ("from", "to"),
    "randint_like": ("low", "high"),
    "native_dropout": ("p", "train", "mask_out"),
    "dropout": ("p", "train", "mask_out"),
}
_ALIASES = {"from_": "from", "low": "from", "high": "to", "to": "to", "from": "from"}


def _op_kwargs(op: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    if op not in SUPPORTED_OPS:
        raise NotImplementedError(
            f"{op!r} has no sharding-invariant implementation; supported ops: "
            f"{', '.join(sorted(SUPPORTED_OPS))}"
        )
    allowed = SUPPORTED_OPS[op]
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        key = name
        if "from" in allowed and name in _ALIASES:
            key = _ALIASES[name]
        elif "low" in allowed and name in ("from", "from_", "to"):
            key = {"to": "high"}.get(name, "low")
        if name == "generator" and value is None:
            continue
        if key not in allowed:
            raise TypeError(
                f"{op} takes {', '.join(allowed) or 'no keyword arguments'} here, got {name!r}"
                + (" (user generators keep their own stream)" if name == "generator" else "")
            )
        out[key] = value
    return out


def _plan(op: str, kw: dict[str, Any], dtype: torch.dtype) -> tuple[str, dict[str, Any]]:
    """The distribution of an op and its arguments."""
    if op in ("uniform_", "rand", "rand_like"):
        return "uniform", {"low": kw.get("from", 0.0), "high": kw.get("to", 1.0)}
    if op in ("normal_", "randn", "randn_like"):
        return "normal", {"mean": kw.get("mean", 0.0), "std": kw.get("std", 1.0)}
    if op in ("bernoulli_", "bernoulli"):
        return "bernoulli", {"p": kw.get("p", 0.5)}
    if op == "random_":
        return "randint", {"low": kw.get("from", 0), "high": kw.get("to")}
    if op == "randint_like":
        if "high" not in kw:
            raise TypeError("randint_like needs high")
        return "randint", {"low": kw.get("low", 0), "high": kw["high"]}
    train = kw.get("train")
    return "dropout", {"p": kw.get("p"), "train": train is None or bool(train)}


# TensorOptions arguments of factory and *_like ops: the local tensor already has them.
_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})


def bind_op_args(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments for :func:`portable_fill_` of an aten OpOverload call.

    Binds the positional arguments after the first (``self``, ``input`` or ``size``) to their
    schema names, drops TensorOptions (``dtype``, ``device``...: the local tensor has them)
    and a ``None`` generator, and gives ``bernoulli.default`` its input as ``p``.

    Args:
        op: The OpOverload (``torch.ops.aten.uniform_.default``...), as DTensor dispatches it.
        args: Its positional arguments, the first included (local tensors for tensor args).
        kwargs: Its keyword arguments.
    """
    names = [argument.name for argument in op._schema.arguments]
    if len(args) > len(names):
        raise TypeError(f"{op} takes {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names[1:], args[1:], strict=False))
    bound.update(kwargs)
    for name in _TENSOR_OPTIONS & bound.keys():
        del bound[name]
    if bound.get("generator", 0) is None:
        del bound["generator"]
    if _op_key(str(op)) == "bernoulli" and "p" not in bound and args:
        bound["p"] = args[0]
    return bound


def offsets_consumed(
    op_name: str, global_shape: Sequence[int], dtype: torch.dtype, **op_kwargs: Any
) -> int:
    """The offsets (Philox blocks) an op consumes for a global tensor, without drawing.

    Args:
        op_name: As for :func:`portable_fill_`.
        global_shape: The shape of the whole (global) tensor.
        dtype: The op's result dtype.
        op_kwargs: The op's arguments, as for :func:`portable_fill_`.
    """
    op = _op_key(op_name)
    dist, args = _plan(op, _op_kwargs(op, op_kwargs), dtype)
    numel = _box(global_shape, None).numel
    if dist == "dropout" and not args["train"]:
        return 0
    wide = (dist in ("uniform", "normal") and dtype == torch.float64) or (
        dist == "randint" and _random_bounds(args["low"], args["high"], dtype)[1] > 1 << 32
    )
    return -(-numel // (2 if wide else 4))


def portable_fill_(
    op_name: str,
    local: torch.Tensor,
    *,
    seed: int,
    base_offset: int,
    global_shape: Sequence[int],
    local_ranges: Sequence[Range] | None,
    **op_kwargs: Any,
) -> int:
    """Fill ``local`` (a shard of a global tensor) with the sharding-invariant op's values.

    ``local`` ends up equal, bit for bit, to the slice ``local_ranges`` of the op applied to
    the whole global tensor on one device, on any device; its dtype and device are kept.

    Supported ops (:data:`SUPPORTED_OPS`; ``"aten.<op>.<overload>"`` names work too):

    - ``uniform_`` (``from``/``from_``, ``to``), ``rand``, ``rand_like``: uniform on
      ``[from, to)``, default ``[0, 1)``; floating dtypes.
    - ``normal_`` (``mean``, ``std``), ``randn``, ``randn_like``: floating dtypes.
    - ``bernoulli_`` and ``bernoulli`` (``p``: a float, or a floating tensor of local shape
      with one probability per element; default 0.5): any dtype.
    - ``random_`` (``from``, ``to``; ``to=None`` is torch's default range), ``randint_like``
      (``low``, ``high``): integers in ``[from, to)``.
    - ``native_dropout`` and ``dropout`` (``p``, ``train``; optional ``mask_out``, a bool
      tensor of local shape that receives the keep mask): ``local`` is the input and becomes
      the output, ``input * mask / (1 - p)``.

    A ``generator=None`` argument is ignored; any other generator, and every other op, raise
    (``TypeError`` / ``NotImplementedError``).

    Args:
        op_name: The op: ``"uniform_"`` or ``"aten.uniform_.default"``...
        local: The local tensor to fill, of the shape the ranges give.
        seed: The 64-bit seed (the Philox key).
        base_offset: The op's first Philox position.
        global_shape: The shape of the whole (global) tensor.
        local_ranges: One ``(start, length)`` per dimension: the box of the global tensor that
            ``local`` holds; ``None`` when it holds all of it.
        op_kwargs: The op's arguments (above).

    Returns:
        The offsets the op consumed for the whole global tensor (the same on every rank,
        whatever the sharding): the next op starts at ``base_offset`` plus this.
    """
    op = _op_key(op_name)
    dist, args = _plan(op, _op_kwargs(op, op_kwargs), local.dtype)
    box = _box(global_shape, local_ranges)
    if tuple(local.shape) != box.local_shape:
        raise ValueError(
            f"the local tensor has shape {tuple(local.shape)} but local_ranges "
            f"{box.ranges} give {box.local_shape}"
        )
    dtype, device = local.dtype, local.device
    if dist == "dropout":
        output, mask, offsets = dropout(seed, base_offset, box.global_shape, box.ranges, local,
                                        p=args["p"], train=args["train"])  # fmt: skip
        mask_out = op_kwargs.get("mask_out")
        if mask_out is not None:
            mask_out.copy_(mask)
        local.copy_(output)
        return offsets
    draw: Draw
    if dist == "uniform":
        draw = uniform(
            seed, base_offset, box.global_shape, box.ranges, dtype=dtype, device=device, **args
        )
    elif dist == "normal":
        draw = normal(
            seed, base_offset, box.global_shape, box.ranges, dtype=dtype, device=device, **args
        )
    elif dist == "bernoulli" and isinstance(args["p"], torch.Tensor):
        draw = bernoulli_tensor(seed, base_offset, box.global_shape, box.ranges, args["p"],
                                dtype=local.dtype)  # fmt: skip
    elif dist == "bernoulli":
        draw = bernoulli(
            seed, base_offset, box.global_shape, box.ranges, dtype=dtype, device=device, **args
        )
    else:
        draw = randint(
            seed, base_offset, box.global_shape, box.ranges, dtype=dtype, device=device, **args
        )
    local.copy_(draw.values)
    return draw.offsets
