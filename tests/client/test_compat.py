"""rngcoord.client._compat: support decided by probing the DTensor internals rngcoord hooks.

The probe runs against the installed torch (the CI matrix runs this file on each tested
version); the cases where an internal is missing or changed remove or replace the real
torch attribute for the test's duration.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed.tensor._random as dtensor_random

from rngcoord.client import UnsupportedTorchError, _compat
from rngcoord.client._devices import pack_philox


def _state(seed: int, offset: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(pack_philox(seed, offset)), dtype=torch.uint8)


def test_this_torch_has_every_internal(caplog: pytest.LogCaptureFixture) -> None:
    assert _compat.missing_internals() == []
    with caplog.at_level(logging.WARNING, logger="rngcoord.client.compat"):
        _compat.check_torch()
    # CI runs every tested version, so the installed one never warns there.
    assert _compat.torch_version() in _compat.TESTED_TORCH
    assert caplog.records == []


def test_an_untested_version_with_the_internals_is_used_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="rngcoord.client.compat"):
        _compat.check_torch("2.16.0")
    assert [r.getMessage() for r in caplog.records] == [
        "rngcoord: torch 2.16.0 has every DTensor internal rngcoord hooks into, but rngcoord "
        "is tested with torch 2.13, 2.14, 2.15 only"
    ]


def test_a_missing_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dtensor_random, "_calc_shard_info")
    with pytest.raises(UnsupportedTorchError) as raised:
        _compat.check_torch()
    message = str(raised.value)
    assert "_calc_shard_info(mesh_coordinate, spec)" in message
    assert "tested with (2.13, 2.14, 2.15)" in message


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # DTensor calls _distribute_region(spec, generator=...): a rename would reach the router's
    # override as an unexpected keyword at the first random op.
    def renamed(self: Any, spec: Any, rng: Any = None) -> None: ...

    monkeypatch.setattr(dtensor_random.OffsetBasedRNGTracker, "_distribute_region", renamed)
    assert _compat.missing_internals() == [
        "OffsetBasedRNGTracker._distribute_region(self, spec, generator)"
    ]


def test_a_changed_philox_layout_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    class Swapped:
        def __init__(self, state: torch.Tensor) -> None:
            self.seed = state[8:].view(torch.int64)
            self.offset = state[:8].view(torch.int64)

    monkeypatch.setattr(dtensor_random, "_PhiloxState", Swapped)
    missing = _compat.missing_internals()
    assert missing == [
        "torch.distributed.tensor._random._PhiloxState (seed u64 [0:8], offset [8:16])"
    ]


def test_philox_seed_offset_reads_all_64_bits_of_the_seed() -> None:
    # int() of the uint64 tensor _PhiloxState.seed returns raises at 2^63 and above.
    with pytest.raises(RuntimeError, match="overflow"):
        int(dtensor_random._PhiloxState(_state((1 << 64) - 1, 4)).seed)
    assert _compat.philox_seed_offset(_state((1 << 64) - 1, (1 << 63) - 4)) == (
        (1 << 64) - 1,
        (1 << 63) - 4,
    )
    assert _compat.philox_seed_offset(_state(7, 0)) == (7, 0)


def test_philox_seed_offset_reads_the_ints_of_older_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before pytorch#173876 the properties were ints.
    class IntState:
        def __init__(self, state: torch.Tensor) -> None:
            raw = bytes(state.numpy())
            self.seed = int.from_bytes(raw[:8], "little")
            self.offset = int.from_bytes(raw[8:], "little", signed=True)

    monkeypatch.setattr(dtensor_random, "_PhiloxState", IntState)
    assert _compat.philox_seed_offset(_state((1 << 63) + 1, 12)) == ((1 << 63) + 1, 12)


def test_torch_version() -> None:
    assert _compat.torch_version("2.14.0a0+git1234") == (2, 14)
    assert _compat.torch_version("2.15.0+cu132") == (2, 15)
    assert _compat.torch_version("2.13.0+cpu") == (2, 13)
