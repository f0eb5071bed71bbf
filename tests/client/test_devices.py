"""rngcoord.client._devices: the CPU mixing function and generator states, Philox packing,
the dispatchable backend string and device handles. No coordinator or process group needed."""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rngcoord.client import (
    InvalidRequest,
    OffsetsExhausted,
    _devices,
)
from rngcoord.client._devices import CPUStateWriter, cpu_key


def test_docstring_examples() -> None:
    """The worked examples in the module's docstrings hold."""
    result = doctest.testmod(_devices, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


def test_cpu_key_is_splitmix64() -> None:
    # SplitMix64's published first outputs from state 0.
    assert cpu_key(0, 0) == 0xE220A8397B1DCDAF
    assert cpu_key(0, 4) == 0x6E789E6AA1B965F4
    assert cpu_key(0, 8) == 0x06C45D188009454F
    # Offsets count 32-bit draws in fours: offsets within one group of four share a key.
    assert cpu_key(7, 4) == cpu_key(7, 5)


@given(seed=st.integers(0, 2**64 - 1), a=st.integers(0, 2**62), b=st.integers(0, 2**62))
def test_cpu_key_is_injective_in_the_offset(seed: int, a: int, b: int) -> None:
    a, b = a * 4, b * 4
    assert (cpu_key(seed, a) == cpu_key(seed, b)) == (a == b)


def test_cpu_state_uses_all_64_bits_of_the_key() -> None:
    # The reason for CPUStateWriter: manual_seed keeps only 32 bits of the seed.
    g = torch.Generator()
    g.manual_seed(5)
    low = torch.rand(4, generator=g)
    g.manual_seed(5 + (1 << 32))
    assert torch.equal(low, torch.rand(4, generator=g))

    writer = CPUStateWriter()
    g.set_state(writer.write(5))
    first = torch.rand(4, generator=g)
    assert g.initial_seed() == 5
    g.set_state(writer.write(5 + (1 << 32)))
    assert not torch.equal(first, torch.rand(4, generator=g))
    g.set_state(writer.write(5))
    assert torch.equal(first, torch.rand(4, generator=g))
    g.set_state(writer.write((1 << 64) - 1))
    assert g.initial_seed() == (1 << 64) - 1
    # The writer's states behave like seeded ones for normal draws too (no stale cache).
    g.set_state(writer.write(9))
    normal = torch.randn(3, generator=g)
    g.set_state(writer.write(9))
    assert torch.equal(normal, torch.randn(3, generator=g))


def test_philox_packing() -> None:
    state = _devices.pack_philox((1 << 64) - 1, (1 << 63) - 4)
    assert len(state) == 16
    tensor = torch.frombuffer(bytearray(state), dtype=torch.uint8)
    assert _devices.unpack_philox(tensor) == ((1 << 64) - 1, (1 << 63) - 4)
    # _PhiloxState's view of the same bytes: seed uint64 at [0:8], offset int64 at [8:16].
    assert int(tensor[8:].view(torch.int64)) == (1 << 63) - 4
    with pytest.raises(OffsetsExhausted, match="signed 64-bit"):
        _devices.pack_philox(1, 1 << 63)


def test_dispatchable_backend_from_torch_registry() -> None:
    assert _devices.dispatchable_backend(["cpu"]) == "cpu:gloo"
    assert _devices.dispatchable_backend(["cuda"]) == "cpu:gloo,cuda:nccl"
    assert _devices.dispatchable_backend(["cuda", "cpu", "cuda"]) == "cpu:gloo,cuda:nccl"
    assert _devices.dispatchable_backend(["xpu"]) == "cpu:gloo,xpu:xccl"
    with pytest.raises(InvalidRequest, match="register_backend"):
        _devices.dispatchable_backend(["nosuchdevice"])


def test_device_handles() -> None:
    assert _devices.device_handle("cpu") is None
    assert _devices.device_handle("cuda") is torch.cuda
    assert _devices.device_handle("nosuchdevice") is None
