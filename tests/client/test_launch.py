"""What names a launch (rngcoord.client._install.launch_id), against a real coordinator.

The case that matters is the container restart of docker-compose.yml: Docker restarts a
crashed trainer container, whose torchrun --standalone draws a new run id and counts restarts
from 0 again. Without RNGCOORD_LAUNCH that is another launch, refused (JOB_IN_USE) until the
crashed one has been idle for 180 s; with it, the same launch, which rejoins at once.
"""

from __future__ import annotations

import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import CoordinatorProcess
from rngcoord.client._connection import CoordinatorClient
from rngcoord.client._errors import FailedPreconditionError, StaleEpochError
from rngcoord.client._install import launch_id
from rngcoord.v1.types import JoinResult

JOB = "launch-names"


def _reserve(
    client: CoordinatorClient, group: str, joined: JoinResult, member: str, seq: int
) -> None:
    client.reserve(
        JOB, group, epoch=joined.epoch, seq=seq, size=64, fingerprint=b"f", rank=0, member_id=member
    )


def _form(client: CoordinatorClient, env: dict[str, str], group: str) -> tuple[JoinResult, str]:
    """Two ranks of the launch that `env` describes join `group`, then rank 0 takes a lease
    (recorded activity: the epoch is live). Rank 0's result and member id."""
    launch, restarts = launch_id(env)
    members = [f"m{rank}-{uuid.uuid4().hex[:6]}" for rank in range(2)]

    def join(rank: int) -> JoinResult:
        return client.join_group(
            JOB,
            group,
            rank=rank,
            world_size=2,
            member_id=members[rank],
            timeout_s=10,
            launch=launch,
            restart_count=restarts,
        )

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(join, range(2)))
    _reserve(client, group, results[0], members[0], 0)
    return results[0], members[0]


def _restart(name: str | None, run_id: str, restarts: int) -> dict[str, str]:
    env = {"TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restarts)}
    if name is not None:
        env["RNGCOORD_LAUNCH"] = name
    return env


def test_a_named_launch_is_one_launch_across_supervisors() -> None:
    host = socket.gethostname()
    assert launch_id(_restart("trainer@{host}", "a", 2)) == (f"named:trainer@{host}", 0)
    assert launch_id(_restart("trainer@{host}", "b", 0)) == launch_id(
        _restart("trainer@{host}", "a", 2)
    )
    assert launch_id(_restart(" ", "b", 1)) == ("torchelastic:b", 1)  # blank: not named


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_a_restarted_container_rejoins_at_once_only_when_named(
    coordinator: CoordinatorProcess, named: bool
) -> None:
    client = CoordinatorClient(coordinator.address, deadline_s=10, outage_s=0)
    name = "trainer-cpu@{host}" if named else None
    group = f"tp-{named}"
    # The first container: torchrun already restarted its ranks twice.
    first = _form(client, _restart(name, uuid.uuid4().hex, 2), group)
    # Docker restarts the container: a new run id, restarts counted from 0 again.
    again = _restart(name, uuid.uuid4().hex, 0)
    if not named:
        with pytest.raises(FailedPreconditionError) as caught:
            _form(client, again, group)
        assert caught.value.reason == "JOB_IN_USE"
        return
    second, _ = _form(client, again, group)
    assert second.epoch == first[0].epoch + 1
    # The crashed container's epoch is fenced: a straggler of it draws nothing more.
    with pytest.raises(StaleEpochError):
        _reserve(client, group, *first, seq=1)
    client.close()
