"""End to end: a coordinator outage or a database failover mid-run costs a training job a
wait, never the run (docs/design.md §6.2, docs/operations.md).

examples/train_tp.py runs as 2 gloo ranks under torchrun (through rngcoord.demo, as
the elastic test does). After step 21 the coordinator is SIGKILLed, and restarted on the same
store 20 s (or 90 s) later; or the coordinator's PostgreSQL primary is SIGKILLed and its
synchronous standby promoted. A reference run, on a coordinator of its own, runs meanwhile.
The run completes, its dropout masks and losses equal the reference's bit for bit, and
`rngcoord verify` finds the audit chain intact and no grant reused; after a coordinator
outage, rank 0 logged the outage once and its end once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import pg_clusters
from harness import CoordinatorFactory, CoordinatorProcess, run_cli
from rngcoord import demo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKERS, STEPS, KILL_AFTER = 2, 120, 21
STEP_S = 0.25
SEED = 0x0_7A6E


def _run_with_fault(
    run_on: CoordinatorProcess,
    reference_on: CoordinatorProcess,
    tmp_path: Path,
    job: str,
    fault: Callable[[], None],
) -> demo.JobRun:
    """Run `job` on `run_on` and call `fault()` after its step KILL_AFTER; check that it
    completes with the masks and losses of a reference run, bit for bit, and that `verify`
    passes on its store.

    The reference runs on a coordinator of its own (`reference_on`), beside the faulted run,
    so that its work overlaps the fault's wait: a group's seed comes from the root seed and
    the group's name (not the job or the store), and each fresh store starts every stream at
    offset 0, so the two coordinators hand the two jobs the same streams.
    """
    references: list[demo.JobRun] = []
    reference_job = threading.Thread(
        target=lambda: references.append(
            demo.run_job(
                demo.JobSpec(f"{job}-reference", WORKERS, STEPS, seed=SEED, checkpoint_every=STEPS),
                reference_on.address,
                tmp_path / "reference",
            )
        )
    )
    reference_job.start()
    spec = demo.JobSpec(job, WORKERS, STEPS, seed=SEED, checkpoint_every=STEPS, step_seconds=STEP_S)
    workdir = tmp_path / "faulted"
    done: list[demo.JobRun] = []
    faulted = threading.Thread(
        target=lambda: done.append(demo.run_job(spec, run_on.address, workdir))
    )
    faulted.start()
    marker = workdir / "records" / "incarnation-0" / "rank-0" / f"step-{KILL_AFTER:04d}.json"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert faulted.is_alive() and time.monotonic() < deadline, "the run never reached the fault"
        time.sleep(0.05)
    fault()
    faulted.join()
    reference_job.join()
    (reference,) = references
    assert reference.returncode == 0, reference.log_tail()
    (run,) = done
    assert run.returncode == 0, run.log_tail()
    bitwise = demo.check_bitwise_resume(reference.records, run.records, 0)
    assert bitwise.ok, bitwise.detail
    agree = demo.check_ranks_agree(run.records)
    assert agree.ok, agree.detail
    verify = run_cli("verify", "--db", run_on.db_url)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "no overlaps" in verify.stdout
    return run


def _run_through_outage(
    coordinator_factory: CoordinatorFactory, tmp_path: Path, outage_s: float
) -> demo.JobRun:
    coordinator, other = coordinator_factory(), coordinator_factory()

    def outage() -> None:
        coordinator.kill()
        time.sleep(outage_s)
        coordinator.restart()

    run = _run_with_fault(coordinator, other, tmp_path, f"outage-{outage_s:g}s", outage)
    # The run was still going when the coordinator came back: the outage was mid-run.
    assert run.seconds > outage_s
    log = run.log.read_text(errors="replace")
    assert log.count("rngcoord: coordinator unreachable at") == 1, run.log_tail(80)
    assert log.count("rngcoord: coordinator outage over after") == 1, run.log_tail(80)
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


@pytest.mark.timeout(400)
def test_a_synchronous_database_failover_mid_run_costs_nothing(
    pg_pair: Callable[..., pg_clusters.PostgresPair],
    coordinator_factory: CoordinatorFactory,
    tmp_path: Path,
) -> None:
    """The coordinator's PostgreSQL primary is SIGKILLed after step 21 and its synchronous
    standby promoted; the coordinator (on the multi-host URL) goes on without a restart, and
    the run's masks and losses equal the reference's, bit for bit."""
    pair = pg_pair(synchronous=True)
    pair.create_database("rngcoord")
    coordinator = coordinator_factory(pair.database_url("rngcoord"))

    def failover() -> None:
        pair.kill_primary()
        pair.promote()

    _run_with_fault(coordinator, coordinator_factory(), tmp_path, "failover", failover)
    assert coordinator.popen is not None and coordinator.popen.poll() is None
