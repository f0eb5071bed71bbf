"""Philox4x32-10 in plain torch integer ops: the same bits on every device.

This module is responsible for the counter-based generator under rngcoord's
sharding-invariant random numbers (:mod:`rngcoord.client._portable` builds the distributions
on it). It is Random123's Philox4x32 with 10 rounds (Salmon et al., SC'11), bit-exact with
Random123's ``kat_vectors`` (``tests/client/test_philox.py`` checks them), computed with
elementwise int64 tensor ops only, so CPU, CUDA and any other torch device give the same
words for the same (key, counter).

Key, counter and blocks
-----------------------
- The **key** is the 64-bit seed: ``key = (seed & 0xFFFFFFFF, seed >> 32)``.
- The **counter** is 128 bits, ``(c0, c1, c2, c3)``. rngcoord uses a 64-bit position
  ``P = base_offset + q``: ``c0 = P & 0xFFFFFFFF``, ``c1 = P >> 32``, ``c2 = c3 = 0``.
- One counter value gives one **block** of four 32-bit words ``(w0, w1, w2, w3)``. The
  *offset unit* of rngcoord's sharding-invariant ops is one counter value (one block, 128
  random bits): an op that starts at ``base_offset`` and consumes ``k`` offsets uses the
  positions ``base_offset .. base_offset + k - 1`` and the next op starts at
  ``base_offset + k``.

Element layout (what :mod:`rngcoord.client._portable` builds on)
--------------------------------------------------------------
A distribution that takes ``b`` words per element packs ``E = 4 // b`` elements per block
(``E = 4`` for 32-bit draws, ``E = 2`` for 64-bit ones). Element ``i`` of the op's global
tensor (``i`` is the row-major, C-order linear index in the *global* shape, whatever the
sharding) uses block ``q = i // E`` (position ``base_offset + i // E``) and the words
``b * (i % E) .. b * (i % E) + b - 1`` of it. The op consumes ``ceil(numel / E)`` offsets.
Any element, hence any contiguous or strided slice, can thus be computed alone.

Worked example: seed ``0x0000000500000007``, ``base_offset = 10``, a float32 ``uniform_``
(``E = 4``) of global shape ``(3, 5)``, sharded on dim 1 so a rank holds columns 2..3.
Element ``(1, 3)`` has global index ``i = 1 * 5 + 3 = 8``: block ``q = 2`` at position
``P = 12`` with counter ``(12, 0, 0, 0)`` and key ``(7, 5)``, whose block is
``(0x53141b03, 0xb4116e67, 0x46bc994d, 0x4dec45a4)``, and word ``8 % 4 = 0`` of it: the value
is ``(0x53141b03 >> 8) * 2^-24 = 0.32452553510665894``, on that rank (local ``[1, 1]``) as on
one device holding the whole tensor. The op consumes ``ceil(15 / 4) = 4`` offsets: the next
op starts at 14.

Exact arithmetic
----------------
Philox needs the 64-bit product of two 32-bit words. Torch has no unsigned 32x32->64
multiply-high on every device, so the words live in int64 tensors (values in ``[0, 2^32)``)
and the product is taken in int64. It can pass 2^63; the *fast* path relies on the device's
int64 multiply wrapping modulo 2^64 (two's complement, what CPUs and GPUs do), whose high
and low 32-bit halves are then exact. The *exact* path splits the multiplier into 16-bit
halves so that no intermediate passes 2^49. :func:`philox_blocks` checks each device once
(the known-answer vectors and a comparison of both paths on ~1000 counters) and uses the
fast path only where it agrees with the exact one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

#: Philox4x32 round multipliers and Weyl key increments (Random123's PHILOX_M4x32_0/1 and
#: PHILOX_W32_0/1).
M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
ROUNDS = 10

#: Positions are 64-bit: ``base_offset + offsets consumed`` must stay at or below this.
POSITION_LIMIT = 1 << 64

#: Random123 kat_vectors, ``philox4x32 10`` lines: (counter, key, expected words).
KNOWN_ANSWERS: tuple[tuple[tuple[int, int, int, int], tuple[int, int], tuple[int, ...]], ...] = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
)

_MASK32 = 0xFFFFFFFF
# Counters per chunk. On CPU the round's working set (6 int64 tensors, 12 MiB) stays in a
# server's last-level cache while each kernel (and its thread barrier) does enough work; on
# accelerators each op is a kernel launch, so chunks are large (6 x 32 MiB).
_CHUNK_CPU = 1 << 18
_CHUNK_ACCELERATOR = 1 << 22

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

_fast_ok: dict[tuple[str, int | None], bool] = {}
_fast_ok_lock = threading.Lock()


def split_key(seed: int) -> tuple[int, int]:
    """The Philox key ``(seed_lo, seed_hi)`` of a 64-bit seed.

    Args:
        seed: The seed, in ``[0, 2^64)``.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise ValueError(f"the seed must be an int in [0, 2^64), got {seed!r}")
    return seed & _MASK32, seed >> 32


def _rounds_fast(
    c: Sequence[torch.Tensor], p0: torch.Tensor, p1: torch.Tensor, key: tuple[int, int]
) -> Words:
    """The rounds with wrapping int64 products, on six same-shaped buffers it may reuse."""
    c0, c1, c2, c3 = c
    k0, k1 = key
    for r in range(ROUNDS):
        torch.mul(c0, M0, out=p0)
        torch.mul(c2, M1, out=p1)
        # c0' = hi(M1*c2) ^ c1 ^ k0, c1' = lo(M1*c2), c2' = hi(M0*c0) ^ c3 ^ k1, c3' = lo(M0*c0).
        # The products wrap modulo 2^64, so an arithmetic shift leaves their high word in the
        # low 32 bits. c1' and c3' keep the whole product: only their low 32 bits ever reach
        # c0'' and c2'', which are masked before they are multiplied.
        torch.bitwise_right_shift(p1, 32, out=c0)
        c0.bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(_MASK32)
        torch.bitwise_right_shift(p0, 32, out=c2)
        c2.bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(_MASK32)
        c1, p1 = p1, c1
        c3, p0 = p0, c3
        if r + 1 < ROUNDS:
            k0 = (k0 + W0) & _MASK32
            k1 = (k1 + W1) & _MASK32
    return c0, c1.bitwise_and_(_MASK32), c2, c3.bitwise_and_(_MASK32)


def _mulhilo_exact(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    # a < 2^32 and m = mh * 2^16 + ml: every partial product stays below 2^48.
    t = a * (m >> 16)
    u = a * (m & 0xFFFF)
    hi = (t + (u >> 16)) >> 16
    lo = (((t & 0xFFFF) << 16) + u) & _MASK32
    return hi, lo


def _rounds_exact(c: Sequence[torch.Tensor], key: tuple[int, int]) -> Words:
    c0, c1, c2, c3 = c
    k0, k1 = key
    for r in range(ROUNDS):
        hi0, lo0 = _mulhilo_exact(c0, M0)
        hi1, lo1 = _mulhilo_exact(c2, M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if r + 1 < ROUNDS:
            k0 = (k0 + W0) & _MASK32
            k1 = (k1 + W1) & _MASK32
    return c0, c1, c2, c3


def philox4x32(
    counter: Sequence[torch.Tensor], key: tuple[int, int], *, exact: bool = False
) -> Words:
    """Philox4x32-10 of many counters at once, with one key.

    Args:
        counter: The four counter words ``(c0, c1, c2, c3)``: int64 tensors of one shape on one
            device, each value in ``[0, 2^32)``. They are not modified.
        key: The two key words ``(k0, k1)``, each in ``[0, 2^32)``.
        exact: Use the exact path (16-bit split products) rather than the wrapping int64
            multiply. Default ``False``; :func:`philox_blocks` picks the path per device.

    Returns:
        The four output words, int64 tensors of the counters' shape with values in
        ``[0, 2^32)``.
    """
    if len(counter) != 4:
        raise ValueError(f"a Philox4x32 counter has 4 words, got {len(counter)}")
    if not all(0 <= k <= _MASK32 for k in key) or len(key) != 2:
        raise ValueError(f"a Philox4x32 key is two words in [0, 2^32), got {key!r}")
    c = [w.to(torch.int64).clone() for w in counter]
    if exact:
        return _rounds_exact(c, key)
    return _rounds_fast(c, torch.empty_like(c[0]), torch.empty_like(c[0]), key)


def fast_path_ok(device: torch.device) -> bool:
    """Whether the wrapping-multiply path is exact on ``device`` (checked once per device).

    Args:
        device: The device to check.
    """
    ident = (device.type, device.index)
    with _fast_ok_lock:
        if ident in _fast_ok:
            return _fast_ok[ident]
    # Random counters (about half the products pass 2^63) and the extremes; ~1000 of them
    # cover a device's vector loop and its scalar tail.
    gen = torch.Generator().manual_seed(0x5EED)
    probe = [torch.randint(0, 1 << 32, (1031,), generator=gen, dtype=torch.int64) for _ in range(4)]
    for word in probe:
        word[0], word[1] = 0, _MASK32
    probe = [word.to(device) for word in probe]
    key = KNOWN_ANSWERS[2][1]
    fast = philox4x32(probe, key)
    exact = philox4x32(probe, key, exact=True)
    ok = all(torch.equal(a, b) for a, b in zip(fast, exact, strict=True))
    for ctr, key, expected in KNOWN_ANSWERS:
        tensors = [torch.tensor([w], dtype=torch.int64, device=device) for w in ctr]
        got = tuple(int(w.item()) for w in philox4x32(tensors, key, exact=True))
        if got != expected:
            raise RuntimeError(
                f"Philox4x32-10 is not exact on {device}: counter {ctr} key {key} gave "
                f"{got}, Random123 expects {expected}; this device's int64 ops are not usable "
                "for portable random numbers"
            )
    with _fast_ok_lock:
        _fast_ok[ident] = ok
    return ok


def philox_blocks(
    seed: int,
    base_offset: int,
    blocks: torch.Tensor,
    *,
    convert: Callable[[Words], torch.Tensor] | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The Philox blocks at positions ``base_offset + blocks``, for the key of ``seed``.

    Args:
        seed: The 64-bit seed (the key).
        base_offset: The op's first position, in ``[0, 2^64)``.
        blocks: 1-d int64 tensor of block indices relative to ``base_offset`` (values
            ``>= 0`` with ``base_offset + value < 2^64``), on the device to compute on.
        convert: Maps the four words of ``m`` blocks (int64 tensors of shape ``[m]``) to an
            ``[m, E]`` tensor, applied chunk by chunk while the words are in cache. Default
            ``None``: the words themselves (``E = 4``).
        chunk: Counters computed per step, which bounds the working memory. Default
            ``None``: 2^18 on CPU, 2^22 on other devices.

    Returns:
        Tensor of shape ``[len(blocks), E]``: ``convert``'s rows of each block, or the words
        ``w0..w3`` (int64, values in ``[0, 2^32)``).
    """
    key = split_key(seed)
    if not isinstance(base_offset, int) or not 0 <= base_offset < POSITION_LIMIT:
        raise ValueError(f"base_offset must be an int in [0, 2^64), got {base_offset!r}")
    if blocks.dim() != 1:
        raise ValueError(f"blocks must be 1-d, got shape {tuple(blocks.shape)}")
    if chunk is None:
        chunk = _CHUNK_CPU if blocks.device.type == "cpu" else _CHUNK_ACCELERATOR
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    flat = blocks.to(torch.int64)
    to_rows = convert or (lambda w: torch.stack(w, dim=1))
    if flat.numel() == 0:
        empty = torch.zeros(1, dtype=torch.int64, device=flat.device)
        return to_rows((empty, empty, empty, empty))[:0]
    fast = fast_path_ok(flat.device)
    base_lo, base_hi = base_offset & _MASK32, base_offset >> 32
    n = min(chunk, flat.numel())
    c = [torch.empty(n, dtype=torch.int64, device=flat.device) for _ in range(4)]
    p0 = torch.empty_like(c[0])
    p1 = torch.empty_like(c[0])
    out: torch.Tensor | None = None
    for start in range(0, flat.numel(), chunk):
        q = flat[start : start + chunk]
        m = q.numel()
        cw = [w[:m] for w in c]
        # c1 takes the carry of (base_lo + q) past 32 bits: P = base + q as a 64-bit number.
        torch.add(q, base_lo, out=cw[0])
        torch.bitwise_right_shift(cw[0], 32, out=cw[1])
        cw[1].add_(base_hi)
        cw[0].bitwise_and_(_MASK32)
        cw[2].zero_()
        cw[3].zero_()
        words = _rounds_fast(cw, p0[:m], p1[:m], key) if fast else _rounds_exact(cw, key)
        rows = to_rows(words)
        if out is None:
            out = torch.empty((flat.numel(), rows.shape[1]), dtype=rows.dtype, device=flat.device)
        out[start : start + m] = rows
    assert out is not None
    return out
