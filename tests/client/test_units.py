"""Unit tests of the client's pure parts: mixing function, generator states, Philox packing,
backend strings, group names, the torch check, error mapping and client configuration.

Nothing here needs a coordinator or torch.distributed.
"""

from __future__ import annotations

import doctest
import socket
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rngcoord.client import (
    CoordinatorClient,
    CoordinatorUnavailable,
    InvalidRequest,
    OffsetsExhausted,
    UnsupportedTorchError,
    compat,
    connection,
    devices,
    groups,
)
from rngcoord.client.devices import CPUStateWriter, cpu_key


@pytest.mark.parametrize("module", [devices, groups])
def test_docstring_examples(module: types.ModuleType) -> None:
    """The worked examples in the docstrings (the CPU mixing function's, group names) hold."""
    result = doctest.testmod(module, raise_on_error=False)
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
    state = devices.pack_philox((1 << 64) - 1, (1 << 63) - 4)
    assert len(state) == 16
    tensor = torch.frombuffer(bytearray(state), dtype=torch.uint8)
    assert devices.unpack_philox(tensor) == ((1 << 64) - 1, (1 << 63) - 4)
    # _PhiloxState's view of the same bytes: seed uint64 at [0:8], offset int64 at [8:16].
    assert int(tensor[8:].view(torch.int64)) == (1 << 63) - 4
    with pytest.raises(OffsetsExhausted, match="signed 64-bit"):
        devices.pack_philox(1, 1 << 63)


def test_dispatchable_backend_from_torch_registry() -> None:
    assert devices.dispatchable_backend(["cpu"]) == "cpu:gloo"
    assert devices.dispatchable_backend(["cuda"]) == "cpu:gloo,cuda:nccl"
    assert devices.dispatchable_backend(["cuda", "cpu", "cuda"]) == "cpu:gloo,cuda:nccl"
    assert devices.dispatchable_backend(["xpu"]) == "cpu:gloo,xpu:xccl"
    with pytest.raises(InvalidRequest, match="register_backend"):
        devices.dispatchable_backend(["nosuchdevice"])


def test_device_handles() -> None:
    assert devices.device_handle("cpu") is None
    assert devices.device_handle("cuda") is torch.cuda
    assert devices.device_handle("nosuchdevice") is None


@given(
    names=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3),
    ranks=st.lists(st.integers(0, 4096), min_size=1, max_size=80, unique=True),
)
def test_group_names_follow_the_coordinators_rule(names: list[str], ranks: list[int]) -> None:
    shape = [len(ranks)] + [1] * (len(names) - 1)
    name = groups.group_name(names, shape, ranks)
    assert groups.NAME_RE.match(name), name
    assert name != groups.group_name(names, shape, ranks[::-1]) or len(ranks) == 1


def test_group_names_are_readable_and_distinct() -> None:
    assert groups.group_name(("dp", "tp"), (2, 2), [0, 1, 2, 3]) == "dp:2,tp:2[0-3]"
    assert groups.group_name(("dp", "tp"), (1, 4), [0, 1, 2, 3]) == "dp:1,tp:4[0-3]"
    assert groups.group_name(("pp",), (3,), [4, 5, 9]) == "pp:3[4.5.9]"
    assert groups.group_name(("x y",), (2,), [0, 1]).startswith("mesh[sha:")


def test_torch_check() -> None:
    compat.check_torch()
    assert compat.missing_internals() == []
    assert compat.torch_version("2.14.0a0+git1234") == (2, 14)
    with pytest.raises(UnsupportedTorchError, match=r"supported: 2\.13, 2\.14"):
        compat.check_torch("2.12.1")


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_coordinator_gives_bounded_retries_and_advice() -> None:
    targets = [_closed_port(), _closed_port()]
    client = CoordinatorClient(targets, deadline_s=1.0, retries=3, backoff_s=0.01)
    with client, pytest.raises(CoordinatorUnavailable) as raised:
        client.get_group("job", "group")
    message = str(raised.value)
    assert f"[{targets[0]}, {targets[1]}] after 4 attempts" in message
    assert "rngcoord serve" in message and "RNGCOORD_ADDR" in message


def test_client_configuration_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RNGCOORD_ADDR", "a:1, b:2")
    monkeypatch.setenv("RNGCOORD_TOKEN", "secret")
    with CoordinatorClient() as client:
        assert client.targets == ("a:1", "b:2")
        assert client._metadata == (("authorization", "Bearer secret"),)
    monkeypatch.delenv("RNGCOORD_ADDR")
    monkeypatch.delenv("RNGCOORD_TOKEN")
    with CoordinatorClient() as client:
        assert client.targets == (connection.DEFAULT_ADDR,)
        assert client._metadata == ()
    with pytest.raises(InvalidRequest, match="RNGCOORD_ADDR"):
        CoordinatorClient(" , ")
    with pytest.raises(InvalidRequest, match="CA bundle"):
        CoordinatorClient("a:1", tls_ca="/nonexistent/ca.pem")
