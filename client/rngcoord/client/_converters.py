"""Converters from Philox output words to element values, for :mod:`rngcoord.client._portable`:
uniform floats of every dtype, normals (Box-Muller, with a sqrt, log, sine and cosine written
in torch integer and float ops so that CPU and CUDA give the same bits), Bernoulli draws and
bounded integers. A converter maps the four words of m blocks (int64 tensors of shape [m]) to
the m * E element values of those blocks, in block order, as an [m, E] tensor, and says E.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch

from rngcoord.client._philox import Words

Converter = Callable[[Words], torch.Tensor]
"""The four words of m blocks to their [m, E] element values."""

# ln 2 split so that e * _LN2_HI is exact for |e| < 2^11 (Cody and Waite).
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10


def next_below(x: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` below ``x`` (a value of ``dtype``)."""
    t = torch.tensor([x], dtype=dtype)
    if dtype.itemsize > 2:
        return float(torch.nextafter(t, torch.tensor([-math.inf], dtype=dtype)).item())
    # 16-bit floats: step the bit pattern (sign and magnitude) one unit toward -inf.
    bits = int(t.view(torch.int16).item())
    bits = -32767 if x == 0 else bits - 1 if x > 0 else bits + 1
    return float(torch.tensor([bits], dtype=torch.int16).view(dtype).item())


def unit53(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``((hi >> 5) * 2^26 + (lo >> 6)) * 2^-53`` in float64: 53 bits, in [0, 1), exact."""
    return ((hi >> 5) * (1 << 26) + (lo >> 6)).to(torch.float64) * 2.0**-53


UNIT_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
# Significand bits (std::numeric_limits<T>::digits): random_()'s default top for floats.
DIGITS = {**UNIT_BITS, torch.float64: 53}


def uniform_converter(dtype: torch.dtype) -> tuple[int, Converter]:
    if dtype == torch.float64:
        return 2, lambda w: torch.stack((unit53(w[0], w[1]), unit53(w[2], w[3])), dim=1)
    bits = UNIT_BITS[dtype]
    scale = 2.0**-bits

    def convert(w: Words) -> torch.Tensor:
        # Integers below 2^bits, then a power-of-two scale: exact in the target dtype.
        return torch.stack([(x >> (32 - bits)).to(dtype) for x in w], dim=1).mul_(scale)

    return 4, convert


# Bit layouts of the floats: (int view dtype, exponent shift, bias, mantissa mask, the bits
# of sqrt(1/2), the bits of a first guess at sqrt: half the exponent bias, tuned).
FLOAT_BITS = {
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


def sqrt(x: torch.Tensor, *, half_to_one: bool = False) -> torch.Tensor:
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
        int_dtype, *_, guess = FLOAT_BITS[x.dtype]
        y = (x.view(int_dtype) >> 1).add_(guess).view(x.dtype)
        steps = 4 if wide else 3
    for _ in range(steps):
        y = (x / y).add_(y).mul_(0.5)
    return y


def horner(x: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    """``c0 + c1 x + c2 x^2 + ...``, highest power first, one rounding per step."""
    acc = x * coefficients[-1]
    for c in reversed(coefficients[1:-1]):
        acc.add_(c).mul_(x)
    return acc.add_(coefficients[0])


def log(u: torch.Tensor, terms: int) -> torch.Tensor:
    """ln u for normal positive u (float32 or float64), from exactly rounded operations only."""
    int_dtype, shift, bias, mantissa, sqrt_half, _ = FLOAT_BITS[u.dtype]
    # u = 2^k m with m in [sqrt(1/2), sqrt(2)), read off the bits: offsetting them by
    # (1.0 - sqrt(1/2)) carries into the exponent exactly when m would fall below sqrt(1/2).
    bits = u.view(int_dtype) + ((bias << shift) - sqrt_half)
    k = (bits >> shift).sub_(bias).to(u.dtype)
    m = bits.bitwise_and_(mantissa).add_(sqrt_half).view(u.dtype)
    # s = (m - 1) / (m + 1) is within +-0.1716; ln m = 2 atanh s = 2 s + 2 s^3/3 + ...
    s = (m - 1.0).div_(m + 1.0)
    log_m = horner(s * s, [2.0 / (2 * j + 1) for j in range(terms)]).mul_(s)
    if u.dtype == torch.float64:
        return k * _LN2_HI + (k * _LN2_LO + log_m)
    return k.mul_(math.log(2.0)).add_(log_m)


def sincos(t: torch.Tensor, terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin t, cos t) for t in [-pi/4, pi/4], in t's dtype, from exactly rounded operations."""
    # sin t = t (1 - t^2/3! + t^4/5! - ...); cos t >= 0.7 here, so sqrt(1 - sin^2) loses
    # nothing and saves a second series.
    series = [(-1) ** j / math.factorial(2 * j + 1) for j in range(terms)]
    sin_t = horner(t * t, series).mul_(t)
    cos_t = sqrt((sin_t * sin_t).neg_().add_(1.0), half_to_one=True)
    return sin_t, cos_t


def angle(quadrant: torch.Tensor, t: torch.Tensor, terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``quadrant * pi/2 + t``, quadrant an int64 tensor in 0..3."""
    sin_t, cos_t = sincos(t, terms)
    # cos(q pi/2) = |q - 2| - 1 and sin(q pi/2) = 1 - |q - 1| for q in 0..3: values in
    # {-1, 0, 1}, so the rotation below is exact (and cheaper than torch.where on CPU).
    q = quadrant.to(t.dtype)
    cos_q = (q - 2.0).abs_().sub_(1.0)
    sin_q = (q - 1.0).abs_().neg_().add_(1.0)
    cos_v = (cos_t * cos_q).sub_(sin_t * sin_q)
    sin_v = (sin_t * cos_q).add_(cos_t * sin_q)
    return cos_v, sin_v


def box_muller(
    u1: torch.Tensor, quadrant: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard normals ``(r cos a, r sin a)``, ``r = sqrt(-2 ln u1)``, ``a = quadrant pi/2 + t``.

    u1 in (0, 1], t in [-pi/4, pi/4). float64 inputs use series accurate to ~1e-16, float32
    ones to ~1e-9 (both below the dtype's rounding).
    """
    precise = u1.dtype == torch.float64
    # abs_ turns ln 1 * -2 = -0.0 into +0.0, which sqrt's bit-level guess needs.
    r = sqrt(log(u1, 11 if precise else 5).mul_(-2.0).abs_())
    cos_a, sin_a = angle(quadrant, t, 8 if precise else 5)
    return cos_a.mul_(r), sin_a.mul_(r)


def normal_converter(dtype: torch.dtype, mean: float, std: float) -> tuple[int, Converter]:
    def affine(z: torch.Tensor) -> torch.Tensor:
        if std != 1.0:
            z = z.mul_(std)
        if mean != 0.0:
            z = z.add_(mean)
        return z

    if dtype == torch.float64:

        def convert64(w: Words) -> torch.Tensor:
            u1 = unit53(w[0], w[1]).add_(2.0**-53)
            # 51 bits of angle within the quadrant: the low 30 of w2, the high 21 of w3.
            frac = ((w[2] & 0x3FFFFFFF) * (1 << 21) + (w[3] >> 11)).to(torch.float64)
            t = frac.mul_(math.pi / 2 * 2.0**-51).sub_(math.pi / 4)
            return affine(torch.stack(box_muller(u1, w[2] >> 30, t), dim=1))

        return 2, convert64

    def convert32(w: Words) -> torch.Tensor:
        m = w[0].numel()
        # (w + 1) * 2^-32 in (0, 1] rounds to 24 bits but keeps the tail out to 6.66 sigma.
        # Both pairs of the blocks in one pass: [first pairs | second pairs].
        u1 = torch.cat((w[0], w[2])).add_(1).to(torch.float32).mul_(2.0**-32)
        angle = torch.cat((w[1], w[3]))
        t = (angle & 0x3FFFFFFF).to(torch.float32).mul_(math.pi / 2 * 2.0**-30)
        z_cos, z_sin = box_muller(u1, angle >> 30, t.sub_(math.pi / 4))
        # Block order: words (0, 1) give elements 0, 1 and words (2, 3) elements 2, 3.
        z = torch.stack((z_cos[:m], z_sin[:m], z_cos[m:], z_sin[m:]), dim=1)
        return affine(z).to(dtype)

    return 4, convert32


def threshold(p: float) -> int:
    """``ceil(p * 2^32)``: a word ``w`` is below it exactly when ``w * 2^-32 < p``."""
    return math.ceil(Fraction(p) * (1 << 32))


def bernoulli_converter(p: float, dtype: torch.dtype) -> tuple[int, Converter]:
    limit = threshold(p)
    return 4, lambda w: torch.stack([x < limit for x in w], dim=1).to(dtype)


def random_converter(low: int, span: int, dtype: torch.dtype) -> tuple[int, Converter]:
    if span <= 1 << 32:
        return 4, lambda w: torch.stack(w, dim=1).remainder_(span).add_(low).to(dtype)

    def value(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        v = (hi & 0x7FFFFFFF) * (1 << 32) + lo
        # 63 bits are already below a 2^63 span (which int64 cannot hold as a divisor).
        return (v if span == 1 << 63 else v.remainder_(span)).add_(low)

    def convert(w: Words) -> torch.Tensor:
        return torch.stack((value(w[0], w[1]), value(w[2], w[3])), dim=1).to(dtype)

    return 2, convert
