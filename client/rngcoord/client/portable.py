"""Sharding-invariant, device-invariant random numbers on :mod:`rngcoord.client.philox`.

This module is responsible for the distributions of rngcoord's ``sharding_invariant`` policy
and for the entry points the tracker calls. A draw is a pure function of (seed, base offset,
global shape, distribution, dtype): each rank computes only its shard, and the shard equals,
bit for bit, the same slice of the whole tensor drawn on one device, on any device (CPU,
CUDA...). The offsets an op consumes depend only on the global shape, never on the sharding.

Layout
------
Element ``i`` (row-major linear index in the global shape) of a distribution packing ``E``
elements per Philox block uses block ``i // E`` at position ``base_offset + i // E`` and the
words ``(4 // E) * (i % E) ..`` of it (:mod:`rngcoord.client.philox` has a worked example).
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

import torch

from rngcoord.client.philox import POSITION_LIMIT, Words, philox_blocks, split_key

_MASK32 = 0xFFFFFFFF
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# ln 2 split so that e * _LN2_HI is exact for |e| < 2^11 (Cody and Waite).
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10

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


# A converter maps the four words of m blocks (int64 tensors of shape [m]) to the m * E
# element values of those blocks, in block order, as a [m, E] tensor.
Converter = Callable[[Words], torch.Tensor]


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


def _next_below(x: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` below ``x`` (a value of ``dtype``)."""
    t = torch.tensor([x], dtype=dtype)
    if dtype.itemsize > 2:
        return float(torch.nextafter(t, torch.tensor([-math.inf], dtype=dtype)).item())
    # 16-bit floats: step the bit pattern (sign and magnitude) one unit toward -inf.
    bits = int(t.view(torch.int16).item())
    bits = -32767 if x == 0 else bits - 1 if x > 0 else bits + 1
    return float(torch.tensor([bits], dtype=torch.int16).view(dtype).item())


def _unit53(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``((hi >> 5) * 2^26 + (lo >> 6)) * 2^-53`` in float64: 53 bits, in [0, 1), exact."""
    return ((hi >> 5) * (1 << 26) + (lo >> 6)).to(torch.float64) * 2.0**-53


_UNIT_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
# Significand bits (std::numeric_limits<T>::digits): random_()'s default top for floats.
_DIGITS = {**_UNIT_BITS, torch.float64: 53}


def _uniform_converter(dtype: torch.dtype) -> tuple[int, Converter]:
    if dtype == torch.float64:
        return 2, lambda w: torch.stack((_unit53(w[0], w[1]), _unit53(w[2], w[3])), dim=1)
    bits = _UNIT_BITS[dtype]
    scale = 2.0**-bits

    def convert(w: Words) -> torch.Tensor:
        # Integers below 2^bits, then a power-of-two scale: exact in the target dtype.
        return torch.stack([(x >> (32 - bits)).to(dtype) for x in w], dim=1).mul_(scale)

    return 4, convert


# Bit layouts of the floats: (int view dtype, exponent shift, bias, mantissa mask, the bits
# of sqrt(1/2), the bits of a first guess at sqrt: half the exponent bias, tuned).
_FLOAT_BITS = {
    torch.float32: (torch.int32, 23, 0x7F, 0x007FFFFF, 0x3F3504F3, 0x1FBD1DF5),
    torch.float64: (
        torch.int64,
        52,
        0x3FF,
        0x000FFFFFFFFFFFFF,
        0x3FE6A09E667F3BCD,
        0x1FF7A3BEA91D9B1B,
    ),
}


def _sqrt(x: torch.Tensor, *, half_to_one: bool = False) -> torch.Tensor:
    """sqrt x for x >= 0 (float32 or float64) by Newton's method.

    torch.sqrt is not exactly rounded on every device (on CPU torch 2.13 differs from IEEE
    sqrt in the last bit for ~17% of float32 inputs), so sqrt is built from exactly rounded
    division, addition and multiplication: the same bits everywhere, within 1 ulp of the
    true root. Each step squares the relative error of the first guess: a bit-level one
    (within 4%), or for ``half_to_one`` (x in [1/2, 1]) a line (within 1%, a step less).
    """
    wide = x.dtype == torch.float64
    if half_to_one:
        y = x * 0.5858 + 0.4185
        steps = 3 if wide else 2
    else:
        int_dtype, *_, guess = _FLOAT_BITS[x.dtype]
        y = (x.view(int_dtype) >> 1).add_(guess).view(x.dtype)
        steps = 4 if wide else 3
    for _ in range(steps):
        y = (x / y).add_(y).mul_(0.5)
    return y


def _horner(x: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    """``c0 + c1 x + c2 x^2 + ...``, highest power first, one rounding per step."""
    acc = x * coefficients[-1]
    for c in reversed(coefficients[1:-1]):
        acc.add_(c).mul_(x)
    return acc.add_(coefficients[0])


def _log(u: torch.Tensor, terms: int) -> torch.Tensor:
    """ln u for normal positive u (float32 or float64), from exactly rounded operations only."""
    int_dtype, shift, bias, mantissa, sqrt_half, _ = _FLOAT_BITS[u.dtype]
    # u = 2^k m with m in [sqrt(1/2), sqrt(2)), read off the bits: offsetting them by
    # (1.0 - sqrt(1/2)) carries into the exponent exactly when m would fall below sqrt(1/2).
    bits = u.view(int_dtype) + ((bias << shift) - sqrt_half)
    k = (bits >> shift).sub_(bias).to(u.dtype)
    m = bits.bitwise_and_(mantissa).add_(sqrt_half).view(u.dtype)
    # s = (m - 1) / (m + 1) is within +-0.1716; ln m = 2 atanh s = 2 s + 2 s^3/3 + ...
    s = (m - 1.0).div_(m + 1.0)
    log_m = _horner(s * s, [2.0 / (2 * j + 1) for j in range(terms)]).mul_(s)
    if u.dtype == torch.float64:
        return k * _LN2_HI + (k * _LN2_LO + log_m)
    return k.mul_(math.log(2.0)).add_(log_m)


def _sincos(t: torch.Tensor, terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin t, cos t) for t in [-pi/4, pi/4], in t's dtype, from exactly rounded operations."""
    # sin t = t (1 - t^2/3! + t^4/5! - ...); cos t >= 0.7 here, so sqrt(1 - sin^2) loses
    # nothing and saves a second series.
    series = [(-1) ** j / math.factorial(2 * j + 1) for j in range(terms)]
    sin_t = _horner(t * t, series).mul_(t)
    cos_t = _sqrt((sin_t * sin_t).neg_().add_(1.0), half_to_one=True)
    return sin_t, cos_t


def _angle(
    quadrant: torch.Tensor, t: torch.Tensor, terms: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``quadrant * pi/2 + t``, quadrant an int64 tensor in 0..3."""
    sin_t, cos_t = _sincos(t, terms)
    # cos(q pi/2) = |q - 2| - 1 and sin(q pi/2) = 1 - |q - 1| for q in 0..3: values in
    # {-1, 0, 1}, so the rotation below is exact (and cheaper than torch.where on CPU).
    q = quadrant.to(t.dtype)
    cos_q = (q - 2.0).abs_().sub_(1.0)
    sin_q = (q - 1.0).abs_().neg_().add_(1.0)
    cos_v = (cos_t * cos_q).sub_(sin_t * sin_q)
    sin_v = (sin_t * cos_q).add_(cos_t * sin_q)
    return cos_v, sin_v


def _box_muller(
    u1: torch.Tensor, quadrant: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard normals ``(r cos a, r sin a)``, ``r = sqrt(-2 ln u1)``, ``a = quadrant pi/2 + t``.

    u1 in (0, 1], t in [-pi/4, pi/4). float64 inputs use series accurate to ~1e-16, float32
    ones to ~1e-9 (both below the dtype's rounding).
    """
    precise = u1.dtype == torch.float64
    # abs_ turns ln 1 * -2 = -0.0 into +0.0, which _sqrt's bit-level guess needs.
    r = _sqrt(_log(u1, 11 if precise else 5).mul_(-2.0).abs_())
    cos_a, sin_a = _angle(quadrant, t, 8 if precise else 5)
    return cos_a.mul_(r), sin_a.mul_(r)


def _normal_converter(dtype: torch.dtype, mean: float, std: float) -> tuple[int, Converter]:
    def affine(z: torch.Tensor) -> torch.Tensor:
        if std != 1.0:
            z = z.mul_(std)
        if mean != 0.0:
            z = z.add_(mean)
        return z

    if dtype == torch.float64:

        def convert64(w: Words) -> torch.Tensor:
            u1 = _unit53(w[0], w[1]).add_(2.0**-53)
            # 51 bits of angle within the quadrant: the low 30 of w2, the high 21 of w3.
            frac = ((w[2] & 0x3FFFFFFF) * (1 << 21) + (w[3] >> 11)).to(torch.float64)
            t = frac.mul_(math.pi / 2 * 2.0**-51).sub_(math.pi / 4)
            return affine(torch.stack(_box_muller(u1, w[2] >> 30, t), dim=1))

        return 2, convert64

    def convert32(w: Words) -> torch.Tensor:
        m = w[0].numel()
        # (w + 1) * 2^-32 in (0, 1] rounds to 24 bits but keeps the tail out to 6.66 sigma.
        # Both pairs of the blocks in one pass: [first pairs | second pairs].
        u1 = torch.cat((w[0], w[2])).add_(1).to(torch.float32).mul_(2.0**-32)
        angle = torch.cat((w[1], w[3]))
        t = (angle & 0x3FFFFFFF).to(torch.float32).mul_(math.pi / 2 * 2.0**-30)
        z_cos, z_sin = _box_muller(u1, angle >> 30, t.sub_(math.pi / 4))
        # Block order: words (0, 1) give elements 0, 1 and words (2, 3) elements 2, 3.
        z = torch.stack((z_cos[:m], z_sin[:m], z_cos[m:], z_sin[m:]), dim=1)
        return affine(z).to(dtype)

    return 4, convert32


def _threshold(p: float) -> int:
    """``ceil(p * 2^32)``: a word ``w`` is below it exactly when ``w * 2^-32 < p``."""
    return math.ceil(Fraction(p) * (1 << 32))


def _bernoulli_converter(p: float, dtype: torch.dtype) -> tuple[int, Converter]:
    limit = _threshold(p)
    return 4, lambda w: torch.stack([x < limit for x in w], dim=1).to(dtype)


def _random_converter(low: int, span: int, dtype: torch.dtype) -> tuple[int, Converter]:
    if span <= 1 << 32:
        return 4, lambda w: torch.stack(w, dim=1).remainder_(span).add_(low).to(dtype)

    def value(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        v = (hi & 0x7FFFFFFF) * (1 << 32) + lo
        # 63 bits are already below a 2^63 span (which int64 cannot hold as a divisor).
        return (v if span == 1 << 63 else v.remainder_(span)).add_(low)

    def convert(w: Words) -> torch.Tensor:
        return torch.stack((value(w[0], w[1]), value(w[2], w[3])), dim=1).to(dtype)

    return 2, convert


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
    per_block, convert = _uniform_converter(dtype)
    draw = _draw(seed, base_offset, _box(global_shape, local_ranges), per_block, convert,
                 dtype, torch.device(device))  # fmt: skip
    if (lo, hi) == (0.0, 1.0):
        return draw
    v = draw.values.to(torch.float64) * (hi - lo) + lo
    if dtype != torch.float64:
        v = v.to(torch.float32).to(dtype)
    if lo < hi:
        top = torch.tensor(hi, dtype=dtype).item()
        v = torch.where(v >= top, _next_below(top, dtype), v)
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
    per_block, convert = _normal_converter(dtype, mu, sigma)
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
    per_block, convert = _bernoulli_converter(_probability(p), dtype)
    return _draw(seed, base_offset, _box(global_shape, local_ranges), per_block, convert,
                 dtype, torch.device(device))  # fmt: skip


def _random_bounds(low: int, high: int | None, dtype: torch.dtype) -> tuple[int, int]:
    """``(low, span)`` of ``random_(low, high)`` with torch's default upper bound."""
    if high is None:
        if dtype == torch.bool:
            top = 1
        elif dtype.is_floating_point:
            top = 1 << _DIGITS[dtype]
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
    per_block, convert = _random_converter(lo, span, dtype)
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
