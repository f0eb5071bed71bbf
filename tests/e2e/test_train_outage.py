"""End to end: a coordinator outage mid-run costs a training job a wait, never the run
(docs/design.md §6.2).

examples/train_tp.py runs as 2 gloo ranks under torchrun (through rngcoord.client.demo, as
the elastic test does). After step 21 the coordinator is SIGKILLed, and restarted on the same
store 20 s (or 90 s) later. The reference run, on a coordinator of its own, runs meanwhile.
The run completes, its dropout masks and losses equal a reference
run's with the same root seed bit for bit, rank 0 logged the outage once and its end once,
and `rngcoord verify` finds the audit chain intact and no grant reused.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from harness import CoordinatorFactory, run_cli
from rngcoord.client import demo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKERS, STEPS, KILL_AFTER = 2, 120, 21
STEP_S = 0.25
SEED = 0x0_7A6E


def _run_through_outage(
    coordinator_factory: CoordinatorFactory, tmp_path: Path, outage_s: float
) -> demo.JobRun:
    coordinator, other = coordinator_factory(), coordinator_factory()
    # The reference runs on a coordinator of its own, beside the outage run, so that its work
    # overlaps the outage's wait: a group's seed comes from the root seed and the group's name
    # (not the job or the store), and each fresh store starts every stream at offset 0, so the
    # two coordinators hand the two jobs the same streams.
    references: list[demo.JobRun] = []
    reference_job = threading.Thread(
        target=lambda: references.append(
            demo.run_job(
                demo.JobSpec("outage-reference", WORKERS, STEPS, seed=SEED, checkpoint_every=STEPS),
                other.address,
                tmp_path / "reference",
            )
        )
    )
    reference_job.start()
    spec = demo.JobSpec(
        f"outage-{outage_s:g}s",
        WORKERS,
        STEPS,
        seed=SEED,
        checkpoint_every=STEPS,
        step_seconds=STEP_S,
    )
    workdir = tmp_path / "outage"
    done: list[demo.JobRun] = []
    job = threading.Thread(
        target=lambda: done.append(demo.run_job(spec, coordinator.address, workdir))
    )
    job.start()
    marker = workdir / "records" / "incarnation-0" / "rank-0" / f"step-{KILL_AFTER:04d}.json"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert job.is_alive() and time.monotonic() < deadline, "the run never reached the kill"
        time.sleep(0.05)
    coordinator.kill()
    time.sleep(outage_s)
    coordinator.restart()
    job.join()
    reference_job.join()
    (reference,) = references
    assert reference.returncode == 0, reference.log_tail()
    (run,) = done
    assert run.returncode == 0, run.log_tail()
    # The run was still going when the coordinator came back: the outage was mid-run.
    assert run.seconds > outage_s
    bitwise = demo.check_bitwise_resume(reference.records, run.records, 0)
    assert bitwise.ok, bitwise.detail
    agree = demo.check_ranks_agree(run.records)
    assert agree.ok, agree.detail
    log = run.log.read_text(errors="replace")
    assert log.count("rngcoord: coordinator unreachable at") == 1, run.log_tail(80)
    assert log.count("rngcoord: coordinator outage over after") == 1, run.log_tail(80)
    verify = run_cli("verify", "--db", coordinator.db_url)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "no overlaps" in verify.stdout
    return run


@pytest.mark.timeout(400)
def test_a_20_s_outage_mid_run_costs_nothing(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    _run_through_outage(coordinator_factory, tmp_path, 20.0)


@pytest.mark.timeout(500)
def test_a_90_s_outage_mid_run_is_waited_out(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    run = _run_through_outage(coordinator_factory, tmp_path, 90.0)
    # 120 steps of 0.25 s take 30 s: the ops waited for the coordinator.
    assert run.seconds > 90
