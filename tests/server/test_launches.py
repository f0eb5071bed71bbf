"""Two launches under one job name (docs/design.md §7.1): a join of another launch does not
replace an epoch whose members are active; a takeover or a torchelastic restart of the same
launch does, and the replaced launch's members are fenced at their next call, or within a
heartbeat on rank 0 when they hold leases enough to make none. Real server subprocess, real
client.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import CoordinatorProcess
from rngcoord.client._connection import CoordinatorClient
from rngcoord.client._errors import FailedPreconditionError, StaleEpochError
from rngcoord.client._leases import LeaseManager, LeaseSchedule
from rngcoord.v1.types import JoinResult

JOB = "launches"


def _launch(
    client: CoordinatorClient,
    launch: str,
    world_size: int = 2,
    *,
    restart_count: int = 0,
    takeover: bool = False,
    group: str = "g",
) -> list[tuple[JoinResult, str]]:
    """Join every rank of one launch; (result, member id) by rank."""

    def join(rank: int) -> tuple[JoinResult, str]:
        member = f"{launch}-{restart_count}-{rank}-{uuid.uuid4().hex[:6]}"
        result = client.join_group(
            JOB,
            group,
            rank=rank,
            world_size=world_size,
            member_id=member,
            timeout_s=10,
            launch=launch,
            restart_count=restart_count,
            takeover=takeover,
        )
        return result, member

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(join, range(world_size)))


def _reserve(client: CoordinatorClient, joined: tuple[JoinResult, str], rank: int) -> None:
    result, member = joined
    client.reserve(
        JOB, "g", epoch=result.epoch, seq=0, size=64, fingerprint=b"f", rank=rank, member_id=member
    )


@pytest.fixture
def client(coordinator: CoordinatorProcess) -> CoordinatorClient:
    return CoordinatorClient(coordinator.address, deadline_s=10, outage_s=0)


def test_a_second_launch_is_refused_while_the_first_is_active(
    client: CoordinatorClient,
) -> None:
    first = _launch(client, "torchelastic:a")
    _reserve(client, first[0], 0)
    with pytest.raises(FailedPreconditionError) as caught:
        _launch(client, "torchelastic:b", world_size=1)
    error = caught.value
    assert error.reason == "JOB_IN_USE"
    assert error.metadata["launch"] == "torchelastic:a"
    assert error.metadata["epoch"] == "1"
    assert "127.0.0.1" in error.metadata["hosts"]
    assert "takeover=True" in str(error)
    # The first launch was not disturbed.
    _reserve(client, first[1], 1)


def test_takeover_replaces_and_fences_the_first_launch(client: CoordinatorClient) -> None:
    first = _launch(client, "torchelastic:a")
    second = _launch(client, "torchelastic:b", takeover=True)
    assert second[0][0].epoch == 2
    with pytest.raises(StaleEpochError):
        _reserve(client, first[0], 0)
    _reserve(client, second[0], 0)
    # And the first launch, in turn, cannot come back without a takeover of its own.
    with pytest.raises(FailedPreconditionError) as caught:
        _launch(client, "torchelastic:a")
    assert caught.value.reason == "JOB_IN_USE"


def test_a_torchelastic_restart_takes_over_at_once(client: CoordinatorClient) -> None:
    first = _launch(client, "torchelastic:r")
    restarted = _launch(client, "torchelastic:r", restart_count=1)
    assert restarted[0][0].epoch == 2
    with pytest.raises(StaleEpochError):
        _reserve(client, first[1], 1)
    # A straggler of the earlier attempt does not replace the restart.
    with pytest.raises(FailedPreconditionError) as caught:
        _launch(client, "torchelastic:r", restart_count=0)
    assert caught.value.reason == "JOB_IN_USE"
    assert "older than restart 1" in str(caught.value)


def test_the_same_launch_rejoins_and_old_clients_are_not_checked(
    client: CoordinatorClient,
) -> None:
    _launch(client, "master:h:1")
    assert _launch(client, "master:h:1")[0][0].epoch == 2  # its own launch, re-formed
    assert _launch(client, "")[0][0].epoch == 3  # no launch: as before
    assert _launch(client, "master:h:2", group="other")[0][0].epoch == 1  # another group


def test_a_replaced_rank_0_learns_within_a_heartbeat_without_a_lease_call(
    client: CoordinatorClient,
) -> None:
    """The first launch holds leases for far more ops than it runs here, so only the
    heartbeat can tell it: its rank 0's next op raises StaleEpochError within about one
    heartbeat of the takeover, and rank 1 (no heartbeat) is fenced at its next call."""
    first = _launch(client, "torchelastic:h")
    managers = [
        LeaseManager(
            client,
            JOB,
            "g",
            rank=rank,
            member_id=member,
            joined=joined,
            schedule=LeaseSchedule(fixed=2**40),
            heartbeat_s=0.3 if rank == 0 else 0,
        )
        for rank, (joined, member) in enumerate(first)
    ]
    try:
        for manager in managers:
            manager.advance(64, b"dropout(8)")
        # The first op sends the prefetch of lease 1 in the background: let it arrive.
        deadline = time.monotonic() + 5
        while any(m.stats.received < 2 for m in managers) and time.monotonic() < deadline:
            time.sleep(0.02)
        reserves = [m.stats.reserves for m in managers]
        assert reserves == [2, 2]
        _launch(client, "torchelastic:other", takeover=True)
        deadline = time.monotonic() + 5
        with pytest.raises(StaleEpochError) as caught:
            while time.monotonic() < deadline:
                managers[0].advance(64, b"dropout(8)")
                time.sleep(0.05)
        assert "epoch 1 of group 'g' was replaced" in str(caught.value)
        assert "current epoch is 2" in str(caught.value)
        assert caught.value.reason == "STALE_EPOCH"
        # Learned from the heartbeat: no lease request was made meanwhile.
        assert [m.stats.reserves for m in managers] == reserves
        # Rank 1 sends no heartbeat: it draws on from its lease until its next call.
        managers[1].advance(64, b"dropout(8)")
    finally:
        for manager in managers:
            manager.close(leave=False)
