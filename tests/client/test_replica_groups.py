"""Replicas of one job (torchft's replica groups): each draws from groups of its own.

Two replicas of job "replicas", each a gloo job of 2 processes with a 1-D "tp" mesh, run side
by side on one coordinator; replica 1 is then started again as a new process, the way a
replica that died comes back, with another rendezvous port (so another launch by
torchelastic's rules) while its previous epoch is still fresh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from programs import start_gloo

from harness import CoordinatorProcess, run_cli

pytestmark = pytest.mark.slow


def _run(coordinator: CoordinatorProcess, outdir: Path, **args: Any) -> list[dict[str, Any]]:
    job = start_gloo("replica", 2, outdir, addr=coordinator.address, job="replicas", **args)
    results: list[dict[str, Any]] = job.wait()
    return results


def test_replicas_draw_from_groups_of_their_own_and_a_new_process_takes_its_own_over(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    first = [
        start_gloo("replica", 2, tmp_path / f"r{n}", addr=coordinator.address, job="replicas",
                   replica=str(n))
        for n in (0, 1)
    ]  # fmt: skip
    zero, one = (job.wait() for job in first)
    assert [set(r["groups"]) for r in zero] == [{"tp:2[0-1]/replica:0"}] * 2
    assert [set(r["groups"]) for r in one] == [{"tp:2[0-1]/replica:1"}] * 2
    for ranks in (zero, one):
        # Within a replica: replicated draws equal, shards of one op distinct.
        assert torch.equal(ranks[0]["replicated"][0], ranks[1]["replicated"][0])
        for op in range(3):
            assert not torch.equal(ranks[0]["sharded"][op], ranks[1]["sharded"][op])
    # Across replicas: seeds of their own, so other masks, with one root seed.
    for op in range(3):
        assert not torch.equal(zero[0]["sharded"][op], one[0]["sharded"][op])
    assert not torch.equal(zero[0]["replicated"][0], one[0]["replicated"][0])

    # Replica 1 comes back as a new process, at once: its own groups, a new epoch, and no
    # JOB_IN_USE from its previous process's fresh epoch, nor from replica 0's.
    again = _run(coordinator, tmp_path / "r1-again", replica="1")
    assert [r["groups"] for r in again] == [{"tp:2[0-1]/replica:1": 2}] * 2
    # It continues past its earlier grants: nothing it drew before is drawn again.
    for op in range(3):
        assert all(
            not torch.equal(again[0]["sharded"][op], earlier)
            for earlier in one[0]["sharded"]
        )  # fmt: skip
    verified = run_cli("verify", "--db", coordinator.db_url)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_the_replica_comes_from_torchfts_environment_and_is_checked(
    coordinator: CoordinatorProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPLICA_GROUP_ID", "3")
    (result, _) = _run(coordinator, tmp_path / "env")
    assert set(result["groups"]) == {"tp:2[0-1]/replica:3"}
    monkeypatch.setenv("REPLICA_GROUP_ID", "no spaces")
    with pytest.raises(AssertionError, match="replica must be 1 to 48 letters"):
        _run(coordinator, tmp_path / "bad")
