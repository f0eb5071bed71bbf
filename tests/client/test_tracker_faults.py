"""Faults a job must survive or report: ranks that diverge, and a coordinator restart.

- Divergence: two thread-ranks run the same rand((16,)) ops, except that rank 1 runs one
  extra randn((16,)). The coordinator sees different fingerprints for the first lease
  requested after the extra op, and both ranks get a DivergenceError naming the group, the
  epoch, the lease and both ranks, with their latest ops by name.
- Restart: two gloo processes keep drawing from their prefetched lease while the coordinator
  is down (killed with SIGKILL), and reconnect once it is back on the same store; the values
  are exactly those of an uninterrupted stream.
- Chaos: four gloo processes keep drawing while the coordinator is stopped (SIGSTOP) for 15 s,
  then killed and restarted; the job finishes (or fails clearly) and `verify` is clean.
- A store restored from an older backup (as a failover that lost commits leaves it): the rank
  that loads the job's checkpoint reports its cursor when it joins, and the new epoch starts
  past it, audited as a failover gap that `verify` names.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from programs import run_threads, run_threads_async, start_gloo, wait_file

from harness import CoordinatorProcess, run_cli
from rngcoord.client import CoordinatorClient
from rngcoord.client._leases import LeaseSchedule
from rngcoord.v1.rules import ATTEST_EVERY

pytestmark = pytest.mark.slow

OP = 16  # offsets per op: rand((16,))
LEASE = 64


def test_extra_op_is_reported_within_one_lease(coordinator: Any, tmp_path: Path) -> None:
    extra_after = 5
    results = run_threads(
        "divergence", 2, tmp_path, addr=coordinator.address, job="div", extra_after=extra_after
    )
    # Rank 1's extra op starts at cursor 96, in lease 1. The requests of leases 0..4 (fixed at
    # the join) and 5 (fixed by the op that first touched lease 1) predate it; lease 6's,
    # fixed when lease 2 becomes current, is the first whose fingerprints differ: the
    # coordinator sees the divergence within lookahead + 1 leases of the op that caused it,
    # whatever the timing.
    extra_cursor = (extra_after + 1) * OP
    first_divergent_seq = extra_cursor // LEASE + 1 + LeaseSchedule().lookahead
    assert first_divergent_seq == 6
    group = "dp:2[0-1]"
    for rank, result in enumerate(results):
        assert result["op"] is not None, f"rank {rank} never saw the divergence"
        message = result["message"]
        assert result["group"] == group
        assert f"divergence in group {group!r} epoch 1 at seq {first_divergent_seq}" in message
        assert "rank 0" in message and "rank 1" in message
        assert f"Latest random ops of rank {rank} in group {group!r}" in message
        assert "torch.rand(16,)" in message
    assert "torch.randn(16,)" in results[1]["message"]
    assert "torch.randn" not in results[0]["message"]
    # The rank whose request for lease 6 was refused raises, at the latest, with the op that
    # needs lease 6; the other one with its next request, which depends on timing.
    assert min(r["cursor"] for r in results) <= first_divergent_seq * LEASE
    with CoordinatorClient(coordinator.address) as client:
        records = client.list_audit(job="div", kinds=["divergence"])
    assert len(records) == 1 and records[0].group == group


def test_extra_op_is_caught_within_1024_ops_with_default_leases(
    coordinator: Any, tmp_path: Path
) -> None:
    """One lease holds all 3,000 ops here, so lease requests alone would never see the extra
    op: the attestation at 1,024 ops does, for the rank that attests second at once and for
    the first at its next attestation (2,048)."""
    results = run_threads("attested_divergence", 2, tmp_path, addr=coordinator.address, job="att")
    for rank, result in enumerate(results):
        assert result["op"] is not None, f"rank {rank} never saw the divergence"
        assert result["op"] < 2 * ATTEST_EVERY + 64, result["op"]
        assert "at anchor_seq 0, ops 1024" in result["message"]
        # At most the leases fixed at the join, all with the join's fingerprint.
        assert result["stats"]["reserves"] <= 1 + LeaseSchedule().lookahead
    # The later attester raises with its next ops, not 1,024 ops later.
    assert min(r["op"] for r in results) < ATTEST_EVERY + 64
    with CoordinatorClient(coordinator.address) as client:
        (record,) = client.list_audit(job="att", kinds=["divergence"])
    assert record.detail["ops"] == ATTEST_EVERY and record.detail["anchor_seq"] == 0
    assert {record.detail["rank"], record.detail["first"]["rank"]} == {0, 1}


def test_job_outlives_a_coordinator_restart(coordinator: Any, tmp_path: Path) -> None:
    job = start_gloo("restart", 2, tmp_path, addr=coordinator.address)
    try:
        wait_file(tmp_path / "phase1")
        coordinator.kill()
        (tmp_path / "go1").touch()
        wait_file(tmp_path / "phase2")
        coordinator.restart()
        (tmp_path / "go2").touch()
    finally:
        results = job.wait()
    for result in results:
        # While the coordinator was down, 28 ops ran on the lease in hand and the prefetched
        # one, without waiting for any lease.
        assert result["offline_stats"]["stalls"] == result["online_stats"]["stalls"]
        assert result["offline_stats"]["received"] == result["online_stats"]["received"] >= 2
        # After the restart the job asked for (and got) the leases it needed next.
        assert result["stats"]["received"] >= 4
        assert result["cursor"] == 52 * OP
        values = result["values"]
        assert len(values) == 52
        # Bitwise what an uninterrupted stream with the group's seed gives.
        for got, expected in zip(values, result["local"], strict=True):
            assert bool((got == expected).all())
    assert all(
        bool((a == b).all())
        for a, b in zip(results[0]["values"], results[1]["values"], strict=True)
    )
    with CoordinatorClient(coordinator.address) as client:
        info = client.get_group("restart", results[0]["group"])
    assert info.epoch == 1 and info.leases >= 4


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_chaos_a_job_through_a_stopped_killed_and_restarted_coordinator(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    job = start_gloo("chaos", 4, tmp_path, addr=coordinator.address, ops=160, pace_s=0.05)
    wait_file(tmp_path / "running", 120)
    assert coordinator.popen is not None
    os.kill(coordinator.popen.pid, signal.SIGSTOP)
    time.sleep(15)
    coordinator.kill()  # SIGKILL reaches a stopped process
    coordinator.restart()
    results = job.wait(300)
    errors = [r["error"] for r in results if r["error"] is not None]
    if errors:  # allowed only as a clear refusal, never a hang or a traceback
        assert all("Unavailable" in e or "unreachable" in e for e in errors), errors
    else:
        assert all(len(r["values"]) == 160 for r in results)
        # Replicas agree, and no op's draw repeats another's: no range was drawn twice (16
        # float32 values each; single values may collide by chance, whole draws do not).
        for op in range(160):
            assert all(r["values"][op].equal(results[0]["values"][op]) for r in results)
        draws = {tuple(t.tolist()) for t in results[0]["values"]}
        assert len(draws) == 160
    report = run_cli("verify", "--db", coordinator.db_url)
    assert report.returncode == 0, report.stdout + report.stderr


def test_a_store_rewound_to_an_older_backup_is_moved_past_the_saved_cursor(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    db = Path(coordinator.db_url.removeprefix("sqlite:///"))
    backup = tmp_path / "backup.db"
    job = run_threads_async("rewound", 1, tmp_path, addr=coordinator.address)
    try:
        wait_file(tmp_path / "drawn")
        with sqlite3.connect(db) as live, sqlite3.connect(backup) as copy:
            live.backup(copy)
        (tmp_path / "backed-up").touch()
        wait_file(tmp_path / "saved")
        coordinator.kill()
        for stale in db.parent.glob(db.name + "*"):
            stale.unlink()
        shutil.copy(backup, db)
        coordinator.restart()
        (tmp_path / "rewound").touch()
    finally:
        (result,) = job.wait()
    assert result["state"]["store_id"] and result["state"]["audit_head"]
    # The rank that loaded the checkpoint reported its cursor when it joined: the new epoch
    # starts there, not at the older copy's high-water mark, and the move is audited.
    # (Before JoinGroupRequest.position the tracker stopped here with StoreMismatchError.)
    assert result["error"] is None
    export = run_cli("audit", "--db", coordinator.db_url, "--json", "--job", "rewound")
    assert export.returncode == 0, export.stderr
    audited = [json.loads(line) for line in export.stdout.splitlines()]
    (gap,) = [r for r in audited if r["kind"] == "failover-gap"]
    assert gap["detail"]["to"] == 704 and gap["detail"]["from"] < 704
    epochs = [r["detail"] for r in audited if r["kind"] == "epoch"]
    assert epochs[-1]["start"] == 704
    report = run_cli("verify", "--db", coordinator.db_url)
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"record {gap['id']}: failover gap" in report.stdout


def test_a_state_of_another_root_seed_is_refused_when_loaded_restoring_nothing(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    (result,) = run_threads("seed_checks", 1, tmp_path, addr=coordinator.address, prefix="sc")
    # Into a job of another root seed: refused by load_state_dict itself, not at the group's
    # first op, naming the saved job and both root seeds.
    refused = result["other_root"]
    assert "the state was saved under another root seed (job 'sc-a', root seed 1)" in refused
    assert "than job 'sc-b' has (2)" in result["other_root"]
    assert "nothing was restored" in result["other_root"]
    assert result["other_root_restored"] == []
    # Into its own job installed without a seed: the coordinator's root seed is read, and a
    # stream whose seed is not its group's there is refused.
    assert "than job 'sc-a' has (1): group 'dp:1[0]' was saved with seed" in result["edited"]
    assert result["edited_restored"] == []
    # The same draw as job a's resumed one: job c continues a's stream where it was saved.
    assert result["faithful"].equal(result["other_job"])
    # Its Restore names the job whose checkpoint the cursor came from.
    export = run_cli("audit", "--db", coordinator.db_url, "--json", "--job", "sc-c")
    assert export.returncode == 0, export.stderr
    (restore,) = [json.loads(x) for x in export.stdout.splitlines() if '"restore"' in x]
    assert restore["detail"]["from_job"] == "sc-a"
    export = run_cli("audit", "--db", coordinator.db_url, "--json", "--job", "sc-a")
    assert all(
        "from_job" not in json.loads(x)["detail"] for x in export.stdout.splitlines()
    )  # a's own resume names no other job
