"""Devices: device handles, the dispatchable backend string, and generator states.

Two kinds of device generator exist for the tracker:

- **Philox devices** (cuda and the cuda-like devices: xpu, hpu, npu, privateuse1 backends...)
  expose ``getattr(torch, device_type)`` as a *device handle* with ``get_rng_state`` and
  ``set_rng_state``. Their state is 16 bytes: the seed as uint64 in ``[0:8]`` and the offset
  as int64 in ``[8:16]``, little-endian (``torch.distributed.tensor._random._PhiloxState``).
  The offset is signed: CUDA cannot represent an offset at or above 2^63, so
  :data:`PHILOX_OFFSET_LIMIT` bounds every offset the tracker sets.
- **CPU**, whose Mersenne Twister has no offset. The tracker seeds it per op from
  (group seed, shard offset) with :func:`cpu_key` and :func:`cpu_generator_state`, which gives
  CPU meshes DTensor's semantics: replicas identical, shards distinct, deterministic.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Protocol, cast

import numpy as np
import torch
import torch.distributed as dist

from rngcoord.client._errors import InvalidRequest, OffsetsExhausted

#: Offsets a Philox device can hold: CUDA keeps the offset as int64.
PHILOX_OFFSET_LIMIT = 1 << 63

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_PHILOX = struct.Struct("<Qq")

# at::CPUGeneratorImplState as torch.Generator.get_state() lays it out (5056 bytes): int64
# the_initial_seed @0, int32 left @8, int32 seeded @12, uint64 next @16, uint64 state[624] @24
# (only the low 32 bits of each word are used), three doubles @5016 and int32 normal_is_valid
# @5040 (Box-Muller cache), float @5048 and bool @5052 (the float normal cache).
CPU_STATE_BYTES = 5056
_MT_WORDS = 624
_MT_HEADER = struct.Struct("<qiiQ")
_MT_WORDS_AT = 24
_MT_WORD_INDEX = np.arange(1, _MT_WORDS + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
_NP_MIX1, _NP_MIX2 = np.uint64(_MIX1), np.uint64(_MIX2)
_NP_30, _NP_27, _NP_31 = np.uint64(30), np.uint64(27), np.uint64(31)


class DeviceHandle(Protocol):
    """The part of a device module (``torch.cuda``, ``torch.xpu``...) the tracker uses."""

    def get_rng_state(self) -> torch.Tensor: ...

    def set_rng_state(self, new_state: torch.Tensor) -> None: ...


def device_handle(device_type: str) -> DeviceHandle | None:
    """The device module ``getattr(torch, device_type)`` when it can hold a Philox state.

    Returns ``None`` for CPU and for devices whose module has no ``get_rng_state`` and
    ``set_rng_state`` (as ``torch.distributed.tensor._random.is_rng_supported_mesh`` decides).

    Args:
        device_type: A device type: ``"cuda"``, ``"xpu"``, a privateuse1 backend's name...
    """
    if device_type == "cpu":
        return None
    handle = getattr(torch, device_type, None)
    if hasattr(handle, "get_rng_state") and hasattr(handle, "set_rng_state"):
        return cast(DeviceHandle, handle)
    return None


def dispatchable_backend(device_types: Iterable[str]) -> str:
    """The backend string of a dispatchable process group for ``device_types``.

    Each device gets its default backend from ``torch.distributed.Backend``'s registry
    (``default_device_backend_map``; a backend registered with
    ``Backend.register_backend(..., devices=[...])`` adds to it). CPU always takes part, since
    DeviceMesh and the tracker need CPU collectives.

    >>> dispatchable_backend(["cuda"])
    'cpu:gloo,cuda:nccl'

    Args:
        device_types: The devices the job's tensors live on; ``"cpu"`` is added.

    Raises:
        InvalidRequest: a device has no default backend.
    """
    mapping = dist.Backend.default_device_backend_map
    devices = ["cpu", *(d for d in dict.fromkeys(device_types) if d != "cpu")]
    parts = []
    for device in devices:
        backend = mapping.get(device)
        if backend is None:
            raise InvalidRequest(
                f"no default process-group backend for device {device!r} (known: "
                f"{sorted(mapping)}): register one with torch.distributed.Backend."
                f"register_backend(name, creator, devices=[{device!r}]) or initialise the "
                "process group yourself"
            )
        parts.append(f"{device}:{backend}")
    return ",".join(parts)


def pack_philox(seed: int, offset: int) -> bytes:
    """The 16-byte Philox state (seed uint64, offset int64, little-endian).

    >>> pack_philox(1, 4).hex()
    '01000000000000000400000000000000'

    Raises:
        OffsetsExhausted: ``offset`` is at or above 2^63, which the device cannot hold.
    """
    check_philox_offset(offset)
    return _PHILOX.pack(seed, offset)


def unpack_philox(state: bytes | bytearray | torch.Tensor) -> tuple[int, int]:
    """(seed, offset) of a 16-byte Philox state, as bytes or a uint8 tensor."""
    raw = bytes(state.cpu().numpy()) if isinstance(state, torch.Tensor) else bytes(state)
    seed, offset = _PHILOX.unpack(raw)
    return int(seed), int(offset)


def check_philox_offset(offset: int) -> None:
    """Raise :class:`OffsetsExhausted` unless a Philox device can hold ``offset``."""
    if offset >= PHILOX_OFFSET_LIMIT:
        raise OffsetsExhausted(
            f"offset {offset} does not fit the device's Philox generator, which stores the "
            "offset as a signed 64-bit integer (limit 2^63): start a new job (a fresh group "
            "starts at 0) or Restore the group to an earlier cursor"
        )


def cpu_key(seed: int, offset: int) -> int:
    """The 64-bit key of the CPU stream for the draw at ``offset`` of the stream ``seed``.

    ``cpu_key(seed, offset)`` is output number ``offset // 4`` of SplitMix64 (Steele, Lea and
    Flood, OOPSLA 2014; Java's ``SplittableRandom``) started at state ``seed``::

        z = seed + (offset // 4 + 1) * 0x9E3779B97F4A7C15          (mod 2^64)
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9                   (mod 2^64)
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB                   (mod 2^64)
        key = z ^ (z >> 31)

    The finaliser is a bijection and the golden-ratio increment is odd, so for one group seed
    distinct offsets always give distinct keys: two DTensor shards, or two ops, never share a
    CPU stream. Offsets are multiples of 4, like CUDA's.

    Worked example, after PyTorch's ``_random.py``: a DTensor of shape [8, 16] on the 2x2x2
    mesh ``[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]`` with placements
    ``[Shard(1), Replicate(), Shard(0)]`` has four [4, 8] shards of 32 elements. Rank 5
    (coordinate (1, 0, 1)) holds shard (z, x) = (1, 1), shard linear index 3, so its shard
    starts at offset ``3 * 32 = 96`` past the op's base. With group seed 1234 and base 0, ranks 5
    and 7 (the two replicas of that shard) both seed their CPU generator from

    >>> cpu_key(1234, 96)
    8232025988594199316

    while rank 0 (shard 0, offset 0) uses

    >>> cpu_key(1234, 0)
    13478418381427711195
    """
    z = (seed + ((offset >> 2) + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


class CPUStateWriter:
    """Builds the CPU generator's state for a stream key, in one reused buffer.

    PyTorch's CPU generator keeps only the low 32 bits of a ``manual_seed`` (its Mersenne
    Twister is seeded from a uint32), so seeding it per op with a 64-bit key would collide after
    about 2^16 ops. Instead the writer fills the whole 624-word state: word ``i`` is SplitMix64
    output ``i`` of the stream started at ``key`` (the generator truncates each to 32 bits),
    with ``left = 1`` and ``next = 0`` as after seeding, so the first draw twists the state.
    ``initial_seed()`` then reports ``key``.

    ``tensor`` aliases the buffer; pass it to ``torch.Generator.set_state`` after
    :meth:`write`. One writer serves one thread at a time.
    """

    def __init__(self) -> None:
        self._buffer = bytearray(CPU_STATE_BYTES)
        self.tensor = torch.frombuffer(self._buffer, dtype=torch.uint8)
        self._words = np.frombuffer(
            self._buffer, dtype=np.uint64, count=_MT_WORDS, offset=_MT_WORDS_AT
        )
        self._scratch = np.empty(_MT_WORDS, dtype=np.uint64)

    def write(self, key: int) -> torch.Tensor:
        """Fill the buffer with the state for ``key`` and return :attr:`tensor`."""
        # Key as a signed int64 for the_initial_seed, whose field is int64.
        _MT_HEADER.pack_into(self._buffer, 0, key - (1 << 64) if key >> 63 else key, 1, 1, 0)
        w, t = self._words, self._scratch
        np.add(_MT_WORD_INDEX, np.uint64(key), out=w)
        np.right_shift(w, _NP_30, out=t)
        np.bitwise_xor(w, t, out=w)
        np.multiply(w, _NP_MIX1, out=w)
        np.right_shift(w, _NP_27, out=t)
        np.bitwise_xor(w, t, out=w)
        np.multiply(w, _NP_MIX2, out=w)
        np.right_shift(w, _NP_31, out=t)
        np.bitwise_xor(w, t, out=w)
        return self.tensor
