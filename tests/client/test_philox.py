"""The portable Philox4x32-10 and the sharding-invariant distributions on it.

Known answers come from Random123's kat_vectors (``philox4x32 10`` lines); a plain-Python
Philox written from the paper's description checks random counters and keys, both int64
paths and the carry into the counter's high word. The slice property (a shard equals the
same slice of the whole draw, bit for bit) is checked on fixed cases here and swept with
hypothesis over random shapes (primes, sizes below 4, empty) and boxes in the slow tier.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

from rngcoord.client import _converters, _philox, _portable
from rngcoord.client._philox import KNOWN_ANSWERS, philox4x32, philox_blocks
from rngcoord.client._portable import (
    SUPPORTED_OPS,
    bernoulli,
    bernoulli_tensor,
    bind_op_args,
    dropout,
    normal,
    offsets_consumed,
    portable_fill_,
    randint,
    uniform,
)

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SEED = 0x9E3779B97F4A7C15

Ranges = list[tuple[int, int]]
Drawer = Callable[[tuple[int, ...], Ranges | None], _portable.Draw]


def reference_philox(ctr: Sequence[int], key: Sequence[int]) -> tuple[int, ...]:
    """Philox4x32-10 on Python ints, from the published round function."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & 0xFFFFFFFF,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & 0xFFFFFFFF,
        )
        if r < 9:
            k0 = (k0 + 0x9E3779B9) & 0xFFFFFFFF
            k1 = (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c0, c1, c2, c3


def words_at(seed: int, position: int) -> tuple[int, ...]:
    """The reference block at a 64-bit position, with the documented counter and key."""
    return reference_philox(
        (position & 0xFFFFFFFF, position >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32)
    )


# -- the generator ----------------------------------------------------------------------


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("case", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_known_answers(
    case: tuple[tuple[int, ...], tuple[int, int], tuple[int, ...]], exact: bool
) -> None:
    ctr, key, expected = case
    out = philox4x32([torch.tensor([w]) for w in ctr], key, exact=exact)
    assert tuple(int(w) for w in out) == expected
    assert reference_philox(ctr, key) == expected


def test_the_known_answers_are_random123s() -> None:
    # Transcribed from Random123's examples/kat_vectors, not from this module's own table.
    lines = """
    philox4x32 10 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
    philox4x32 10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
    philox4x32 10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
    """  # noqa: E501
    parsed = []
    for line in lines.strip().splitlines():
        words = [int(w, 16) for w in line.split()[2:]]
        parsed.append((tuple(words[:4]), tuple(words[4:6]), tuple(words[6:])))
    assert tuple(parsed) == KNOWN_ANSWERS


def test_both_paths_match_the_reference_on_random_counters() -> None:
    rng = random.Random(7)
    ctrs = [[rng.getrandbits(32) for _ in range(300)] for _ in range(4)]
    key = (rng.getrandbits(32), rng.getrandbits(32))
    tensors = [torch.tensor(c, dtype=torch.int64) for c in ctrs]
    fast = philox4x32(tensors, key)
    exact = philox4x32(tensors, key, exact=True)
    for j in range(300):
        expected = reference_philox([c[j] for c in ctrs], key)
        assert tuple(int(w[j]) for w in fast) == expected
        assert tuple(int(w[j]) for w in exact) == expected
    assert _philox.fast_path_ok(torch.device("cpu"))


@pytest.mark.parametrize("base", [0, 5, (1 << 32) - 3, (1 << 63) + 11, (1 << 64) - 8])
def test_blocks_use_the_documented_counter_and_key(base: int) -> None:
    # (1 << 32) - 3 carries into the counter's high word within the op.
    got = philox_blocks(SEED, base, torch.arange(8))
    for q in range(8):
        assert tuple(got[q].tolist()) == words_at(SEED, base + q)


def test_blocks_are_the_same_in_small_chunks() -> None:
    blocks = torch.tensor([5, 0, 9, 9, 1000, 3])
    assert torch.equal(philox_blocks(SEED, 17, blocks), philox_blocks(SEED, 17, blocks, chunk=4))


@pytest.mark.parametrize(("seed", "base"), [(-1, 0), (1 << 64, 0), (0, -1), (0, 1 << 64)], ids=str)
def test_blocks_reject_out_of_range_seed_and_offset(seed: int, base: int) -> None:
    with pytest.raises(ValueError, match="must be an int in"):
        philox_blocks(seed, base, torch.arange(2))


# -- the layout ------------------------------------------------------------------------


def test_worked_example() -> None:
    """_philox.py's docstring: element (1, 3) of a (3, 5) float32 uniform_ at offset 10."""
    seed = 0x0000000500000007
    draw = uniform(seed, 10, (3, 5), [(0, 3), (2, 2)])
    assert words_at(seed, 12) == (0x53141B03, 0xB4116E67, 0x46BC994D, 0x4DEC45A4)
    assert draw.values[1, 1].item() == (0x53141B03 >> 8) * 2.0**-24 == 0.32452553510665894
    assert draw.offsets == 4


def test_layout_of_each_distribution() -> None:
    """Element i uses block i // E and words (4 // E) * (i % E).. of it."""
    n = 10
    blocks = [words_at(SEED, 3 + q) for q in range(n)]
    w = [word for block in blocks for word in block]
    u32 = uniform(SEED, 3, (n,)).values
    assert u32.tolist() == [(w[i] >> 8) * 2.0**-24 for i in range(n)]
    u64 = uniform(SEED, 3, (n,), dtype=torch.float64).values
    expected = [((w[2 * i] >> 5) * 2**26 + (w[2 * i + 1] >> 6)) * 2.0**-53 for i in range(n)]
    assert u64.tolist() == expected
    bits = bernoulli(SEED, 3, (n,), p=0.3, dtype=torch.int64).values
    assert bits.tolist() == [int(w[i] * 2.0**-32 < 0.3) for i in range(n)]
    ints = randint(SEED, 3, (n,), low=-4, high=9).values
    assert ints.tolist() == [-4 + w[i] % 13 for i in range(n)]
    wide = randint(SEED, 3, (n,), low=0, high=(1 << 40) + 1).values
    expected = [
        ((w[2 * i] & 0x7FFFFFFF) * 2**32 + w[2 * i + 1]) % ((1 << 40) + 1) for i in range(n)
    ]
    assert wide.tolist() == expected
    # Normal pairs of one Box-Muller draw share a radius and give the documented angle.
    z = normal(SEED, 3, (8,), dtype=torch.float64).values
    u1 = ((w[0] >> 5) * 2**26 + (w[1] >> 6) + 1) * 2.0**-53
    t = ((w[2] & 0x3FFFFFFF) * 2**21 + (w[3] >> 11)) * 2.0**-51 * math.pi / 2 - math.pi / 4
    a = (w[2] >> 30) * math.pi / 2 + t
    r = math.sqrt(-2 * math.log(u1))
    assert math.isclose(z[0], r * math.cos(a), rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(z[1], r * math.sin(a), rel_tol=1e-12, abs_tol=1e-12)
    z32 = normal(SEED, 3, (8,)).values.double()
    r = math.sqrt(-2 * math.log(float(torch.tensor(w[2] + 1, dtype=torch.float32)) * 2.0**-32))
    a = (w[3] >> 30) * math.pi / 2 + (w[3] & 0x3FFFFFFF) * 2.0**-30 * math.pi / 2 - math.pi / 4
    assert math.isclose(z32[2], r * math.cos(a), rel_tol=1e-5, abs_tol=1e-5)
    assert math.isclose(z32[3], r * math.sin(a), rel_tol=1e-5, abs_tol=1e-5)


def draws(dtype: torch.dtype, device: str = "cpu") -> dict[str, Drawer]:
    """Every distribution of ``dtype`` on ``device``, as (global shape, box) -> Draw."""
    on: dict[str, Any] = {"dtype": dtype, "device": device}
    out: dict[str, Drawer] = {
        "uniform": lambda s, r: uniform(SEED, 7, s, r, **on),
        "uniform[-3, 5)": lambda s, r: uniform(SEED, 7, s, r, **on, low=-3, high=5),
        "normal": lambda s, r: normal(SEED, 7, s, r, **on, mean=1.5, std=2.0),
        "bernoulli": lambda s, r: bernoulli(SEED, 7, s, r, p=0.25, **on),
    }
    if dtype == torch.float32:
        out["randint"] = lambda s, r: randint(SEED, 7, s, r, low=-5, high=1000, device=device)
        out["randint wide"] = lambda s, r: randint(SEED, 7, s, r, high=1 << 50, device=device)
        out["dropout"] = lambda s, r: dropout_draw(s, r, device)
    return out


def dropout_draw(shape: tuple[int, ...], ranges: Ranges | None, device: str) -> _portable.Draw:
    full = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32).reshape(shape)
    local = full[tuple(slice(a, a + n) for a, n in ranges)] if ranges is not None else full
    output, _, offsets = dropout(SEED, 7, shape, ranges, local.to(device), p=0.4)
    return _portable.Draw(output, offsets)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor: comparing them tells -0.0 from 0.0 and NaN payloads apart."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_slice(draw: Drawer, shape: tuple[int, ...], ranges: Ranges) -> None:
    whole = draw(shape, None)
    part = draw(shape, ranges)
    view = whole.values[tuple(slice(a, a + n) for a, n in ranges)]
    assert part.values.dtype == whole.values.dtype
    assert part.values.shape == view.shape
    assert torch.equal(raw(part.values), raw(view))
    assert part.offsets == whole.offsets


FIXED_CASES: list[tuple[tuple[int, ...], Ranges]] = [
    ((), []),
    ((1,), [(0, 1)]),
    ((3,), [(1, 2)]),
    ((13,), [(5, 7)]),
    ((7, 11), [(2, 3), (0, 11)]),
    ((7, 11), [(0, 7), (3, 5)]),
    ((5, 3, 2), [(1, 3), (1, 1), (1, 1)]),
    ((4, 0, 3), [(1, 2), (0, 0), (0, 3)]),
    ((2, 17), [(1, 1), (16, 1)]),
]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("shape", "ranges"), FIXED_CASES, ids=str)
def test_a_slice_equals_the_slice_of_the_whole_draw(
    dtype: torch.dtype, shape: tuple[int, ...], ranges: Ranges
) -> None:
    for draw in draws(dtype).values():
        check_slice(draw, shape, ranges)


SIZES = st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 11, 13, 16, 17, 31])


@st.composite
def boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Ranges]:
    shape = tuple(draw(st.lists(SIZES, min_size=0, max_size=4)))
    ranges = []
    for size in shape:
        start = draw(st.integers(0, size))
        ranges.append((start, draw(st.integers(0, size - start))))
    return shape, ranges


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=boxes())
def test_random_slices_equal_the_slice_of_the_whole_draw(
    dtype: torch.dtype, case: tuple[tuple[int, ...], Ranges]
) -> None:
    shape, ranges = case
    for draw in draws(dtype).values():
        check_slice(draw, shape, ranges)


@settings(max_examples=40, deadline=None)
@given(case=boxes(), op=st.sampled_from(sorted(SUPPORTED_OPS)))
def test_offsets_consumed_do_not_depend_on_the_slice(
    case: tuple[tuple[int, ...], Ranges], op: str
) -> None:
    shape, ranges = case
    kwargs: dict[str, dict[str, Any]] = {
        "randint_like": {"high": 10},
        "native_dropout": {"p": 0.5},
        "dropout": {"p": 0.5},
    }
    args = kwargs.get(op, {})
    expected = offsets_consumed(op, shape, torch.float32, **args)
    assert expected == -(-math.prod(shape) // 4)
    local = torch.zeros([n for _, n in ranges])
    assert portable_fill_(op, local, seed=SEED, base_offset=0, global_shape=shape,
                          local_ranges=ranges, **args) == expected  # fmt: skip


def test_offsets_consumed_per_dtype_and_range() -> None:
    assert offsets_consumed("uniform_", (10,), torch.float64) == 5
    assert offsets_consumed("normal_", (3, 3), torch.float64) == 5
    assert offsets_consumed("normal_", (3, 3), torch.bfloat16) == 3
    assert offsets_consumed("random_", (10,), torch.int64, to=1 << 32) == 3
    assert offsets_consumed("random_", (10,), torch.int64, to=(1 << 32) + 1) == 5
    assert offsets_consumed("random_", (10,), torch.int64) == 5  # [0, 2^63 - 1]
    assert offsets_consumed("random_", (10,), torch.int32) == 3
    assert offsets_consumed("native_dropout", (10,), torch.float32, p=0.1, train=False) == 0
    assert offsets_consumed("aten.uniform_.default", (0, 4), torch.float32) == 0


PLACEMENTS = [
    (Shard(0), Replicate()),
    (Shard(1), Shard(0)),
    (Shard(1), Shard(1)),
    (Replicate(), Shard(2)),
    (Shard(0), Shard(0)),
]


@pytest.mark.parametrize("placements", PLACEMENTS, ids=str)
def test_dtensor_shards_tile_the_single_device_draw(placements: tuple[Placement, ...]) -> None:
    """The recipe for the tracker: ranges from DTensor's own shard arithmetic, on a 2x3 mesh.

    Uneven (7 over 2 and 3) and empty shards included; replicas get identical values.
    """
    shape = (7, 5, 3)
    whole = normal(SEED, 11, shape, dtype=torch.float64).values
    tiled = torch.full(shape, math.nan, dtype=torch.float64)
    for coordinate in itertools.product(range(2), range(3)):
        local_shape, offset = _compute_local_shape_and_global_offset(
            shape, (2, 3), list(coordinate), placements
        )
        ranges = list(zip(offset, local_shape, strict=True))
        local = torch.empty(local_shape, dtype=torch.float64)
        consumed = portable_fill_("aten.normal_.default", local, seed=SEED, base_offset=11,
                                  global_shape=shape, local_ranges=ranges)  # fmt: skip
        assert consumed == offsets_consumed("normal_", shape, torch.float64) == 53
        box = tuple(slice(a, a + n) for a, n in ranges)
        assert torch.equal(local, whole[box])
        tiled[box] = local
    assert torch.equal(tiled, whole)


# -- the distributions -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_uniform_is_in_zero_one(dtype: torch.dtype) -> None:
    values = uniform(SEED, 0, (1 << 18,), dtype=dtype).values
    assert values.min().item() >= 0.0
    assert values.max().item() < 1.0
    # The largest word gives the largest value below 1.
    _, convert = _converters.uniform_converter(dtype)
    top = torch.tensor([0xFFFFFFFF], dtype=torch.int64)
    assert convert((top, top, top, top)).max().item() < 1.0
    assert 0.45 < values.double().mean().item() < 0.55


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_uniform_never_reaches_high(dtype: torch.dtype) -> None:
    # A coarse grid near 1000 makes rounding up to `high` likely for 16-bit dtypes.
    values = uniform(SEED, 0, (1 << 16,), dtype=dtype, low=0, high=1000).values
    assert values.max().item() < 1000
    assert values.min().item() >= 0
    same = uniform(SEED, 0, (8,), dtype=dtype, low=2.5, high=2.5).values
    assert (same == 2.5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_normal_moments(dtype: torch.dtype) -> None:
    z = normal(SEED, 0, (1 << 18,), dtype=dtype).values.double()
    assert abs(z.mean().item()) < 0.01
    assert abs(z.std().item() - 1) < 0.01
    assert abs(((z - z.mean()) ** 3).mean().item()) < 0.03
    assert abs(((z - z.mean()) ** 4).mean().item() - 3) < 0.06
    shifted = normal(SEED, 0, (1 << 16,), dtype=dtype, mean=-2.0, std=0.5).values.double()
    assert abs(shifted.mean().item() + 2) < 0.01
    assert abs(shifted.std().item() - 0.5) < 0.01


def test_portable_log_and_angles_are_accurate() -> None:
    gen = torch.Generator().manual_seed(1)
    u = torch.rand(1 << 14, dtype=torch.float64, generator=gen).clamp_min(1e-300)
    quadrant = torch.randint(0, 4, (1 << 14,), generator=gen)
    t = (torch.rand(1 << 14, dtype=torch.float64, generator=gen) - 0.5) * (math.pi / 2)
    for dtype, log_terms, trig_terms, tol in (
        (torch.float64, 11, 8, 4e-15),
        (torch.float32, 5, 5, 4e-7),
    ):
        x = u.to(dtype)
        exact = torch.log(x.double())
        assert ((_converters.log(x, log_terms).double() - exact).abs() <= tol * exact.abs()).all()
        cos, sin = _converters.angle(quadrant, t.to(dtype), trig_terms)
        angle = quadrant.double() * (math.pi / 2) + t.to(dtype).double()
        assert (sin.double() - torch.sin(angle)).abs().max().item() < tol
        assert (cos.double() - torch.cos(angle)).abs().max().item() < tol


def numpy_normal(words: Any, dtype: Any) -> Any:
    """_portable.py's Box-Muller table row, in numpy (whose float ops are IEEE), [m, 4] -> [m, E].

    If torch's CPU ops were not all exactly rounded (torch.sqrt is not), torch's result would
    differ from this one, and from CUDA's.
    """
    f = dtype
    wide = f == np.float64
    ints: Any
    ints, shift, bias, mantissa, sqrt_half, guess = (
        (np.int64, 52, 0x3FF, 0x000FFFFFFFFFFFFF, 0x3FE6A09E667F3BCD, 0x1FF7A3BEA91D9B1B)
        if wide
        else (np.int32, 23, 0x7F, 0x007FFFFF, 0x3F3504F3, 0x1FBD1DF5)
    )

    def horner(x: Any, coefficients: list[float]) -> Any:
        acc = x * f(coefficients[-1])
        for c in reversed(coefficients[1:-1]):
            acc = (acc + f(c)) * x
        return acc + f(coefficients[0])

    def sqrt(x: Any, half_to_one: bool = False) -> Any:
        if half_to_one:
            y = x * f(0.5858) + f(0.4185)
        else:
            y = ((x.view(ints) >> 1) + ints(guess)).view(f)
        for _ in range((4 if wide else 3) - half_to_one):
            y = (x / y + y) * f(0.5)
        return y

    def log(u: Any) -> Any:
        bits = u.view(ints) + ints((bias << shift) - sqrt_half)
        k = ((bits >> shift) - ints(bias)).astype(f)
        m = ((bits & ints(mantissa)) + ints(sqrt_half)).view(f)
        s = (m - f(1)) / (m + f(1))
        terms = 11 if wide else 5
        log_m = horner(s * s, [2.0 / (2 * j + 1) for j in range(terms)]) * s
        if wide:
            return k * f(6.93147180369123816490e-01) + (k * f(1.90821492927058770002e-10) + log_m)
        return k * f(math.log(2.0)) + log_m

    w = words.astype(np.int64)
    if wide:
        u1 = ((w[:, 0] >> 5) * 2**26 + (w[:, 1] >> 6)).astype(f) * f(2.0**-53) + f(2.0**-53)
        frac = ((w[:, 2] & 0x3FFFFFFF) * 2**21 + (w[:, 3] >> 11)).astype(f)
        t = frac * f(math.pi / 2 * 2.0**-51) - f(math.pi / 4)
        quadrant = w[:, 2] >> 30
    else:
        u1 = (np.concatenate((w[:, 0], w[:, 2])) + 1).astype(f) * f(2.0**-32)
        angle = np.concatenate((w[:, 1], w[:, 3]))
        t = (angle & 0x3FFFFFFF).astype(f) * f(math.pi / 2 * 2.0**-30) - f(math.pi / 4)
        quadrant = angle >> 30
    r = sqrt(np.abs(log(u1) * f(-2)))
    terms = 8 if wide else 5
    sin_t = horner(t * t, [(-1) ** j / math.factorial(2 * j + 1) for j in range(terms)]) * t
    cos_t = sqrt(-(sin_t * sin_t) + f(1), half_to_one=True)
    q = quadrant.astype(f)
    cos_q = np.abs(q - f(2)) - f(1)
    sin_q = -np.abs(q - f(1)) + f(1)
    z_cos = (cos_t * cos_q - sin_t * sin_q) * r
    z_sin = (sin_t * cos_q + cos_t * sin_q) * r
    if wide:
        return np.stack((z_cos, z_sin), axis=1)
    m = len(w)
    return np.stack((z_cos[:m], z_sin[:m], z_cos[m:], z_sin[m:]), axis=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_normal_uses_only_exactly_rounded_ops(dtype: torch.dtype) -> None:
    per_block = 4 if dtype == torch.float32 else 2
    words = philox_blocks(SEED, 5, torch.arange(4096)).numpy()
    expected = numpy_normal(words, np.float32 if dtype == torch.float32 else np.float64)
    got = normal(SEED, 5, (4096 * per_block,), dtype=dtype).values.numpy()
    assert expected.shape == (4096, per_block)
    assert np.array_equal(got.view(np.uint8), expected.reshape(-1).view(np.uint8))


def test_bernoulli_rate_and_edges() -> None:
    bits = bernoulli(SEED, 0, (1 << 16,), p=0.3).values
    assert abs(bits.mean().item() - 0.3) < 0.01
    assert not bernoulli(SEED, 0, (100,), p=0.0).values.any()
    assert bernoulli(SEED, 0, (100,), p=1.0).values.all()
    p = torch.full((6, 7), 0.3)
    assert torch.equal(
        bernoulli_tensor(SEED, 4, (9, 7), [(2, 6), (0, 7)], p).values,
        bernoulli(SEED, 4, (9, 7), [(2, 6), (0, 7)], p=0.3).values,
    )


def test_randint_bounds() -> None:
    ints = randint(SEED, 0, (1 << 14,), low=-3, high=4).values
    assert ints.min().item() == -3 and ints.max().item() == 3
    wide = randint(SEED, 0, (1 << 12,), low=-(1 << 62), high=1 << 62).values
    assert wide.min().item() >= -(1 << 62) and wide.max().item() < 1 << 62
    assert wide.min().item() < -(1 << 60) < (1 << 60) < wide.max().item()
    default = randint(SEED, 0, (1 << 12,), dtype=torch.float16).values
    assert default.min().item() >= 0 and default.max().item() <= 2048
    assert set(randint(SEED, 0, (64,), dtype=torch.bool).values.tolist()) == {False, True}


def test_dropout() -> None:
    x = torch.linspace(-1, 1, 40).reshape(4, 10)
    output, mask, offsets = dropout(SEED, 0, (4, 10), None, x, p=0.25)
    assert mask.dtype == torch.bool and offsets == 10
    assert torch.equal(output, x.mul(mask.float()).mul_(1 / 0.75))
    assert torch.equal(mask, bernoulli(SEED, 0, (4, 10), p=0.75, dtype=torch.bool).values)
    zeros, none, _ = dropout(SEED, 0, (4, 10), None, x, p=1.0)
    assert not none.any() and not zeros.any()
    same, ones, used = dropout(SEED, 0, (4, 10), None, x, p=0.5, train=False)
    assert torch.equal(same, x) and ones.all() and used == 0
    assert torch.equal(dropout(SEED, 0, (4, 10), None, x, p=0.25, train=None)[0], output)


# -- the entry point -------------------------------------------------------------------


def test_portable_fill_matches_the_distributions() -> None:
    shape, ranges = (6, 10), [(1, 4), (5, 5)]
    where: dict[str, Any] = {
        "seed": SEED,
        "base_offset": 9,
        "global_shape": shape,
        "local_ranges": ranges,
    }
    local = torch.empty(4, 5, dtype=torch.float64)
    assert portable_fill_("aten.uniform_.default", local, **where, from_=-1, to=3) == 30
    assert torch.equal(
        local, uniform(SEED, 9, shape, ranges, dtype=torch.float64, low=-1, high=3).values
    )
    assert portable_fill_("normal_", local, **where, mean=2.0, std=3.0) == 30
    assert torch.equal(
        local, normal(SEED, 9, shape, ranges, dtype=torch.float64, mean=2, std=3).values
    )
    ints = torch.empty(4, 5, dtype=torch.int32)
    assert portable_fill_("random_", ints, **where, to=50) == 15
    assert torch.equal(ints, randint(SEED, 9, shape, ranges, high=50, dtype=torch.int32).values)
    assert portable_fill_("aten.randint_like.low_dtype", ints, **where, low=3, high=9) == 15
    assert torch.equal(
        ints, randint(SEED, 9, shape, ranges, low=3, high=9, dtype=torch.int32).values
    )
    floats = torch.empty(4, 5)
    portable_fill_("bernoulli_", floats, **where, p=0.6, generator=None)
    assert torch.equal(floats, bernoulli(SEED, 9, shape, ranges, p=0.6).values)
    portable_fill_("aten.bernoulli.default", floats, **where, p=torch.full((4, 5), 0.6))
    assert torch.equal(floats, bernoulli(SEED, 9, shape, ranges, p=0.6).values)
    x = torch.randn(4, 5)
    mask = torch.empty(4, 5, dtype=torch.bool)
    expected, expected_mask, _ = dropout(SEED, 9, shape, ranges, x, p=0.3)
    assert portable_fill_("native_dropout", x, **where, p=0.3, train=True, mask_out=mask) == 15
    assert torch.equal(x, expected) and torch.equal(mask, expected_mask)


def test_bind_op_args_names_aten_arguments() -> None:
    aten = torch.ops.aten
    x = torch.empty(3)
    assert bind_op_args(aten.uniform_.default, (x, -1.0, 2.0), {"generator": None}) == {
        "from": -1.0,
        "to": 2.0,
    }
    assert bind_op_args(aten.normal_.default, (x,), {"std": 3.0}) == {"std": 3.0}
    assert bind_op_args(aten.native_dropout.default, (x, 0.1, None), {}) == {
        "p": 0.1,
        "train": None,
    }
    assert bind_op_args(aten.randint_like.low_dtype, (x, 2, 9), {"dtype": torch.int64}) == {
        "low": 2,
        "high": 9,
    }
    assert bind_op_args(aten.rand.default, ([2, 3],), {"device": "cpu"}) == {}
    assert bind_op_args(aten.bernoulli.default, (x,), {})["p"] is x
    assert bind_op_args(getattr(aten.random_, "from"), (x, 0, 5), {}) == {"from": 0, "to": 5}
    local = torch.empty(4, 3)
    where: dict[str, Any] = {
        "seed": SEED,
        "base_offset": 2,
        "global_shape": (8, 3),
        "local_ranges": [(4, 4), (0, 3)],
    }
    portable_fill_(
        str(aten.uniform_.default),
        local,
        **where,
        **bind_op_args(aten.uniform_.default, (local, -1.0, 2.0), {}),
    )
    assert torch.equal(local, uniform(SEED, 2, (8, 3), [(4, 4), (0, 3)], low=-1.0, high=2.0).values)


def test_portable_fill_rejects_what_it_cannot_do() -> None:
    where: dict[str, Any] = {
        "seed": SEED,
        "base_offset": 0,
        "global_shape": (4,),
        "local_ranges": [(0, 4)],
    }
    local = torch.empty(4)
    with pytest.raises(NotImplementedError, match="'exponential_' has no sharding-invariant"):
        portable_fill_("aten.exponential_.default", local, **where)
    with pytest.raises(TypeError, match="user generators"):
        portable_fill_("uniform_", local, **where, generator=torch.Generator())
    with pytest.raises(TypeError, match="'lambd'"):
        portable_fill_("uniform_", local, **where, lambd=2.0)
    with pytest.raises(NotImplementedError, match=r"not torch\.int64"):
        portable_fill_("normal_", torch.empty(4, dtype=torch.int64), **where)
    with pytest.raises(ValueError, match=r"shape \(3,\) but local_ranges"):
        portable_fill_("uniform_", torch.empty(3), **where)
    with pytest.raises(ValueError, match="outside dimension 0 of size 4"):
        uniform(SEED, 0, (4,), [(2, 3)])
    with pytest.raises(ValueError, match="1 \\(start, length\\) pairs for a 2-dimensional"):
        uniform(SEED, 0, (4, 4), [(0, 4)])
    with pytest.raises(ValueError, match=r"the seed must be an int in \[0, 2\^64\)"):
        uniform(-1, 0, (4, 0))
    with pytest.raises(ValueError, match="past the 64-bit Philox position space"):
        uniform(SEED, (1 << 64) - 1, (5,))
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        bernoulli(SEED, 0, (4,), p=1.5)
    with pytest.raises(ValueError, match="from < to"):
        randint(SEED, 0, (4,), low=3, high=3)
    with pytest.raises(ValueError, match="std >= 0"):
        normal(SEED, 0, (4,), std=-1.0)


def test_the_last_positions_of_the_space_are_usable() -> None:
    draw = uniform(SEED, (1 << 64) - 2, (8,))
    assert draw.offsets == 2
    w = words_at(SEED, (1 << 64) - 1)
    assert draw.values[4].item() == (w[0] >> 8) * 2.0**-24


# -- devices ---------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cuda_equals_cpu_bitwise(dtype: torch.dtype) -> None:
    shape, ranges = (33, 65), [(3, 20), (7, 50)]
    on_cpu, on_cuda = draws(dtype), draws(dtype, "cuda")
    for name, draw in on_cpu.items():
        cpu = draw(shape, ranges)
        gpu = on_cuda[name](shape, ranges)
        assert gpu.values.device.type == "cuda"
        assert gpu.offsets == cpu.offsets
        same = torch.equal(raw(cpu.values), raw(gpu.values.cpu()))
        assert same, f"{name} {dtype}: CUDA and CPU values differ"
