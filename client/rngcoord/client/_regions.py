"""The regions a DTensor random op runs in: the device's generator set to the op's stream
position, and put back after it.

``CPURegion`` gives the default CPU generator one stream key's state and restores the user's;
``PhiloxRegion`` sets a Philox device's generator to (seed, offset) and leaves it at
(seed, post), as upstream does; ``UserPhiloxRegion`` keeps upstream's semantics for an op
given a user generator. One generator per device serves every thread-rank of a process, so
each region holds ``GENERATOR_LOCK``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from rngcoord.client._compiling import not_compiled
from rngcoord.client._devices import CPUStateWriter, check_philox_offset, pack_philox, unpack_philox

if TYPE_CHECKING:
    from rngcoord.client._tracker import RNGStateTracker

__all__ = ["GENERATOR_LOCK", "CPURegion", "PhiloxRegion", "UserPhiloxRegion"]

# One generator per device (and one CPU generator) serves every thread-rank of a process:
# a region holds this lock so that thread-ranks do not interleave their states.
GENERATOR_LOCK = threading.RLock()


class CPURegion:
    """Runs the region on the default CPU generator set to one stream key, then restores
    the user's CPU state."""

    __slots__ = ("_key", "_saved", "_writer")

    def __init__(self, writer: CPUStateWriter, key: int) -> None:
        self._writer = writer
        self._key = key

    @not_compiled
    def __enter__(self) -> None:
        GENERATOR_LOCK.acquire()
        generator = torch.default_generator
        self._saved = generator.get_state()
        generator.set_state(self._writer.write(self._key))

    @not_compiled
    def __exit__(self, *exc: object) -> None:
        try:
            torch.default_generator.set_state(self._saved)
        finally:
            GENERATOR_LOCK.release()


class PhiloxRegion:
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
        GENERATOR_LOCK.acquire()
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
            GENERATOR_LOCK.release()


class UserPhiloxRegion:
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
        GENERATOR_LOCK.acquire()
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
            GENERATOR_LOCK.release()
