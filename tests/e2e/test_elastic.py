"""End to end: an elastic job loses a rank, re-forms in a new epoch, and resumes bitwise.

examples/train_tp.py runs as 4 gloo ranks on CPU under torchrun (c10d rendezvous,
--max-restarts=1) against a real coordinator subprocess, launched and checked through the
functions that `rngcoord demo` uses (rngcoord.demo), so the demo and this test exercise
one flow. A reference job runs uninterrupted; beside it, a second job with the same root seed
crashes a rank mid-run, and torchelastic restarts it with --resume.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import CoordinatorProcess, run_cli, side_by_side
from rngcoord import demo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKERS, STEPS = 4, 6
SEED = 0x5EED_0F_E2E


@pytest.mark.timeout(240)
def test_restart_fences_the_old_epoch_and_resume_is_bitwise(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    fail_rank, fail_at_step, every = demo.plan(WORKERS, STEPS)
    checkpoint_step = demo.last_checkpoint_before(fail_at_step, every)
    # The two jobs run side by side: torchelastic's restart of the failed one waits, and the
    # reference's work fills that wait. Their groups are their jobs' own.
    reference, resumed = side_by_side(
        lambda: demo.run_job(
            demo.JobSpec("e2e-reference", WORKERS, STEPS, seed=SEED, checkpoint_every=every),
            coordinator.address,
            tmp_path / "reference",
        ),
        lambda: demo.run_job(
            demo.JobSpec(
                "e2e-resume",
                WORKERS,
                STEPS,
                seed=SEED,
                fail_at_step=fail_at_step,
                fail_rank=fail_rank,
                resume=True,
                checkpoint_every=every,
            ),
            coordinator.address,
            tmp_path / "resumed",
        ),
    )
    assert reference.returncode == 0, reference.log_tail()
    assert resumed.returncode == 0, resumed.log_tail()
    first, second = demo.members(resumed.records, 0), demo.members(resumed.records, 1)
    assert [m.rank for m in first] == [m.rank for m in second] == list(range(WORKERS))
    assert not {m.member_id for m in first} & {m.member_id for m in second}

    stub = coordinator.stub()
    # Both incarnations are in the audit log; the second epoch starts at the high-water mark.
    reformed = demo.check_group_reformed(stub, "e2e-resume")
    assert reformed.ok, reformed.detail
    assert {m.epoch for m in first} == {1} and {m.epoch for m in second} == {2}
    restores = demo.audit(stub, "e2e-resume", ("restore",))
    assert [(d["epoch"], d["seq"]) for _, d in restores] == [(2, 0)]

    fenced = demo.check_fenced(stub, first)
    assert fenced.ok, fenced.detail
    assert "stale" in fenced.detail

    # The masks are real draws (replicas agree, shards differ, some dropped, some kept), so
    # equality below is evidence, not a coincidence of empty records.
    agree = demo.check_ranks_agree(reference.records)
    assert agree.ok, agree.detail
    bitwise = demo.check_bitwise_resume(reference.records, resumed.records, checkpoint_step)
    assert bitwise.ok, bitwise.detail

    verify = run_cli("verify", "--db", coordinator.db_url)
    assert verify.returncode == 0, verify.stdout + verify.stderr
