"""rngcoord.client.torchft.attach on a real rank, with real torchft Managers and Lighthouse:
every refusal says what to change and restores nothing; a peer's state continues this
replica's own group at the peer's position, under this replica's seed.

The heal itself, between two torchrun replicas, is tests/e2e/test_torchft.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from programs import start_gloo

from harness import CoordinatorProcess
from lighthouse import Lighthouse
from rngcoord.v1.seeds import group_seed

pytestmark = pytest.mark.slow

pytest.importorskip("torchft", reason="the torchft extra (pip install 'rngcoord[torchft]')")

TAG0, TAG1 = "tp:1[0]/replica:0", "tp:1[0]/replica:1"


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[Lighthouse]:
    started = Lighthouse(tmp_path)
    yield started
    started.stop()


@pytest.fixture
def attached(coordinator: CoordinatorProcess, lighthouse: Lighthouse, tmp_path: Path) -> Any:
    job = start_gloo(
        "torchft_attach", 1, tmp_path / "ranks", addr=coordinator.address, job="attach",
        lighthouse=lighthouse.address,
    )  # fmt: skip
    (result,) = job.wait()
    return result


def test_attach_refuses_a_tracker_it_cannot_follow(attached: dict[str, Any]) -> None:
    assert "install(..., replica=NAME)" in attached["no_replica"]
    assert "REPLICA_GROUP_ID" in attached["no_replica"]
    assert "before the first random op" in attached["after_first_op"]
    assert "'tp:1[0]/replica:0'" in attached["after_first_op"]
    # Either quorum, read from the Manager.
    assert attached["asynchronous"] == [True, False]
    assert "attached already" in attached["twice"]


def test_a_peer_state_that_is_not_this_jobs_replica_restores_nothing(
    attached: dict[str, Any],
) -> None:
    assert "not an attached peer's" in attached["not_attached"]
    assert "job 'attach-other'" in attached["other_job"]
    assert "same job name" in attached["other_job"]
    assert f"{TAG1!r} of replica '2'" in attached["not_a_replica"]
    assert "not its group's seed under the state's root seed 5" in attached["seed_not_the_roots"]
    assert "another root seed" in attached["other_root_seed"]
    assert "root seed 6" in attached["other_root_seed"]
    for message in (v for k, v in attached.items() if k in {"not_attached", "other_job"}):
        assert message.endswith("nothing was restored")
    assert attached["unchanged"] is True


def test_a_peer_that_drew_other_ops_is_refused(attached: dict[str, Any]) -> None:
    """A replica that heals with streams drawn already compares its fingerprint chains at its
    step boundary with the peer's at that step: other ops are refused, restoring nothing; the
    same ops heal."""
    message = attached["other_ops"]
    assert message is not None, "a peer that drew other ops was restored"
    assert "drew other ops than this replica up to step 0" in message
    assert f"{TAG0!r} differ" in message
    assert message.endswith("nothing was restored")
    assert attached["other_ops_unchanged"] is True
    assert attached["same_ops_heals"] == 1


def test_a_heal_continues_this_replicas_group_at_the_peers_position(
    attached: dict[str, Any],
) -> None:
    sent, healed = attached["sent"], attached["healed"]
    assert attached["heals"] == 1
    assert set(healed) == {TAG0}
    # The peer drew 3 ops of 8 elements (4 offsets each after rounding); one more op here.
    assert healed[TAG0]["seed"] == group_seed(5, TAG0) != sent["seed"] == group_seed(5, TAG1)
    assert healed[TAG0]["offset"] > sent["offset"] > 0
