"""End to end: torchft replica groups that die and heal keep their exact random streams.

examples/train_torchft.py runs as 2 replica groups, each a torchrun of 2 gloo ranks with a
"tp" mesh, under a real torchft Lighthouse and Managers (with the synchronous quorum, and with
the asynchronous one), against a real coordinator. A reference job trains without a failure.
Beside it, a second job with the same root seed loses all of replica 1 (SIGKILL of torchrun
and its workers) mid-run; replica 0 trains on alone, and replica 1, started again, heals from
it, while the coordinator is down (SIGKILLed, restarted on its store 3 s later), and trains
to the end. Masks are compared step by step (torchft's committed step count)
with the reference's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import CoordinatorProcess, run_cli, side_by_side
from lighthouse import Lighthouse

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

pytest.importorskip("torchft", reason="the torchft extra (pip install 'rngcoord[torchft]')")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_torchft.py"
STEPS, KILL_AFTER, SEED = 14, 4, 0x7F7
FAIL_COMMIT_AT = 2  # the failure job's step that fails to commit once, on both replicas
# Long enough a step that replica 0 is mid-run when replica 1 dies and when it returns.
STEP_S = 0.4
# How long the coordinator stays down while replica 1 heals: past replica 1's first quorum,
# and longer than replica 0's leases last.
OUTAGE_S = 3.0


@pytest.fixture
def lighthouses(tmp_path: Path) -> Iterator[list[Lighthouse]]:
    """One Lighthouse per job (a quorum is per Lighthouse): the reference's waits for both
    replicas, so that both train from step 0; the failure job's trains on with one."""
    started = [Lighthouse(tmp_path, min_replicas=2), Lighthouse(tmp_path, min_replicas=1)]
    yield started
    for lighthouse in started:
        lighthouse.stop()


class Replica:
    """One replica group's torchrun of 2 ranks, in a session of its own."""

    def __init__(
        self,
        job: str,
        name: str,
        coordinator: str,
        lighthouse: str,
        out: Path,
        hold: Path | None = None,
        quorum: str = "sync",
        fail_commit_at: int | None = None,
    ) -> None:
        self.out = out
        out.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RNGCOORD_")}
        env.update(
            REPLICA_GROUP_ID=name,
            TORCHFT_LIGHTHOUSE=lighthouse,
            RNGCOORD_ADDR=coordinator,
            RNGCOORD_JOB=job,
            RNGCOORD_SEED=str(SEED),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        )
        self.log = (out / "torchrun.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1",
             "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
             f"--rdzv-id={job}-{name}", str(EXAMPLE), f"--steps={STEPS}",
             f"--step-seconds={STEP_S}", "--advertise=127.0.0.1", f"--record-masks={out}",
             *([f"--hold-while={hold}"] if hold else []),
             *(["--async-quorum"] if quorum == "async" else []),
             *([f"--fail-commit-at-step={fail_commit_at}"] if fail_commit_at is not None else [])],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait(self, timeout_s: float = 200) -> None:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            self.log.close()
        assert code == 0, self.tail()

    def kill(self) -> None:
        """SIGKILL torchrun and both workers (torchrun starts them in sessions of their own)."""
        pids = [int((self.out / f"rank-{r}" / "pid").read_text()) for r in (0, 1)]
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def wait_started(self, timeout_s: float = 120) -> None:
        """Until both ranks have their Manager (each writes its pid file then)."""
        deadline = time.monotonic() + timeout_s
        while not all((self.out / f"rank-{r}" / "pid").exists() for r in (0, 1)):
            assert self.proc.poll() is None, self.tail()
            assert time.monotonic() < deadline, f"not started in {timeout_s} s\n{self.tail()}"
            time.sleep(0.05)

    def wait_step(self, step: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not all((self.out / f"rank-{r}" / f"step-{step:04d}.json").exists() for r in (0, 1)):
            assert self.proc.poll() is None, self.tail()
            assert time.monotonic() < deadline, f"no step {step} in {timeout_s} s\n{self.tail()}"
            time.sleep(0.05)

    def records(self) -> dict[int, list[dict[str, Any]]]:
        """step -> each rank's record of it."""
        steps: dict[int, list[dict[str, Any]]] = {}
        for rank in (0, 1):
            for path in sorted((self.out / f"rank-{rank}").glob("step-*.json")):
                record = json.loads(path.read_text())
                steps.setdefault(record["step"], []).append(record)
        return {step: ranks for step, ranks in steps.items() if len(ranks) == 2}

    def tail(self) -> str:
        text = (self.out / "torchrun.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-40:])


def _quorums(coordinator: CoordinatorProcess, job: str) -> dict[str, list[dict[str, Any]]]:
    """The details of `job`'s quorum records, by replica, oldest first."""
    audit = run_cli("audit", "--db", coordinator.db_url, "--job", job, "--kind", "quorum",
                    "--json")  # fmt: skip
    assert audit.returncode == 0, audit.stderr
    by_replica: dict[str, list[dict[str, Any]]] = {"0": [], "1": []}
    for line in audit.stdout.splitlines():
        detail = json.loads(line)["detail"]
        by_replica[detail["replica"]].append(detail)
    return by_replica


def _masks(record: dict[str, Any]) -> dict[str, str]:
    masks: dict[str, str] = record["masks"]
    return masks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("quorum", ["sync", "async"])
def test_a_killed_replica_heals_with_the_streams_of_a_run_without_the_failure(
    coordinator: CoordinatorProcess, lighthouses: list[Lighthouse], tmp_path: Path, quorum: str
) -> None:
    hold = tmp_path / "hold"
    restarted: list[float] = []

    def reference() -> tuple[Replica, Replica]:
        lighthouse = lighthouses[0].address
        both = tuple(
            Replica(
                "ft-reference",
                r,
                coordinator.address,
                lighthouse,
                tmp_path / f"ref-{r}",
                quorum=quorum,
            )
            for r in ("0", "1")
        )
        for replica in both:
            replica.wait()
        return both  # type: ignore[return-value]

    def failure() -> tuple[Replica, Replica, Replica]:
        lighthouse = lighthouses[1].address
        # Both replicas hold before their first step until both have their Managers, so that
        # the first quorum has both (a replica that starts alone trains step 0 by itself,
        # and the other then joins by a heal).
        hold.touch()
        zero, one = (
            Replica(
                "ft-heal",
                r,
                coordinator.address,
                lighthouse,
                tmp_path / f"heal-{r}",
                hold,
                quorum,
                FAIL_COMMIT_AT,
            )
            for r in ("0", "1")
        )
        zero.wait_started()
        one.wait_started()
        hold.unlink()
        one.wait_step(KILL_AFTER)
        one.kill()
        # Replica 0 trains on alone for a while; then replica 1 comes back and heals. A new
        # process takes seconds to start (longer than replica 0 needs to finish), so
        # replica 0 holds between two steps until the restarted replica has its Manager.
        zero.wait_step(KILL_AFTER + 3)
        hold.touch()
        again = Replica(
            "ft-heal", "1", coordinator.address, lighthouse, tmp_path / "heal-1b", hold, quorum
        )
        again.wait_started()
        # The coordinator dies as replica 1 heals: its Restores (at its first random op) and
        # replica 0's next leases wait out the outage, and go on from the restarted server.
        coordinator.kill()
        hold.unlink()
        time.sleep(OUTAGE_S)
        restarted.append(time.time())
        coordinator.restart()
        zero.wait()
        again.wait()
        return zero, one, again

    (ref0, ref1), (zero, one, again) = side_by_side(reference, failure)
    ref = {"0": ref0.records(), "1": ref1.records()}
    assert sorted(ref["0"]) == sorted(ref["1"]) == list(range(STEPS))

    # The masks are real draws: within a replica the replicated dropout agrees across the tp
    # ranks and the sharded one differs; the two replicas draw differently.
    for step in range(STEPS):
        for name in ("0", "1"):
            r0, r1 = (_masks(rank) for rank in ref[name][step])
            for layer, mask in r0.items():
                sharded = layer in ref[name][step][0]["sharded"]
                assert (mask != r1[layer]) if sharded else (mask == r1[layer]), (step, layer)
        assert _masks(ref["0"][step][0]) != _masks(ref["1"][step][0])

    # Replica 0 never left: every step's masks are the reference's, bit for bit, including
    # a step it redid when its peer died mid-step (its commit failed).
    survived = zero.records()
    assert sorted(survived) == list(range(STEPS))
    # Step FAIL_COMMIT_AT failed to commit on both replicas (an error reported in its first
    # attempt), and each redid it from rewound streams: its masks are still the reference's.
    # (Replica 0 may redo the step replica 1 died in too.)
    assert all(
        r["rewinds"] >= 1
        for ranks in survived.values()
        for r in ranks
        if r["step"] > FAIL_COMMIT_AT
    )
    for step, ranks in survived.items():
        assert [_masks(r) for r in ranks] == [_masks(r) for r in ref["0"][step]], step

    # Replica 1 before its death, and after it healed at a later step: the reference's.
    before, after = one.records(), again.records()
    assert min(before) == 0 and KILL_AFTER in before, sorted(before)
    healed_at = min(after)
    assert healed_at > KILL_AFTER + 1, sorted(after)
    assert sorted(after) == list(range(healed_at, STEPS))
    assert all(r["heals"] >= 1 for ranks in after.values() for r in ranks)
    if quorum == "async":
        # The heal lands in should_commit, after the healing step drew from the new process's
        # fresh streams (torchft zeroes that step's gradients): the steps after it are the
        # reference's.
        del after[healed_at]
    for step, ranks in [*before.items(), *after.items()]:
        assert [_masks(r) for r in ranks] == [_masks(r) for r in ref["1"][step]], step

    # The heal went through the outage: replica 1's ranks waited for the coordinator, and
    # their Restores are the restarted server's.
    assert "coordinator unreachable" in (tmp_path / "heal-1b" / "torchrun.log").read_text()
    audit = run_cli("audit", "--db", coordinator.db_url, "--job", "ft-heal", "--kind", "restore",
                    "--json")  # fmt: skip
    assert audit.returncode == 0, audit.stderr
    restores = [json.loads(line) for line in audit.stdout.splitlines()]
    # (Replica 1's earlier Restores, of its first process, are its rewinds and its step-0
    # heal; the restarted process's are those of its new epoch.)
    replica1 = [r for r in restores if r["group"].endswith("/replica:1")]
    newest: dict[str, int] = {}
    for r in replica1:
        newest[r["group"]] = max(newest.get(r["group"], 0), r["detail"]["epoch"])
    heal_restores = [r for r in replica1 if r["detail"]["epoch"] == newest[r["group"]]]
    assert heal_restores, restores
    assert min(r["ts_us"] for r in heal_restores) / 1e6 > restarted[0], heal_restores

    # The replica timeline in the audit: each replica's rank 0 records every quorum it took
    # part in. In the reference both replicas are in every quorum; in the failure job
    # replica 0 trained alone after the kill, and replica 1 healed from it at its first step
    # back.
    ref_quorums, heal_quorums = (
        _quorums(coordinator, "ft-reference"),
        _quorums(coordinator, "ft-heal"),
    )
    assert ref_quorums["0"] and {q["quorum_id"] for q in ref_quorums["0"]} == {
        q["quorum_id"] for q in ref_quorums["1"]
    }, ref_quorums
    assert all(q["participants"] == 2 for qs in ref_quorums.values() for q in qs), ref_quorums
    assert any(q["participants"] == 1 for q in heal_quorums["0"]), heal_quorums
    # (At step 0 torchft's init_sync heals every replica but one from that one.)
    assert not any(q["healed_from"] for q in heal_quorums["0"] if q["step"] > 0), heal_quorums
    healed = [q for q in heal_quorums["1"] if q["healed_from"]]
    assert [(q["healed_from"], q["step"]) for q in healed][-1:] == [("0", healed_at)], healed
    assert healed[-1]["quorum_id"] in {q["quorum_id"] for q in heal_quorums["0"]}

    verified = run_cli("verify", "--db", coordinator.db_url)
    assert verified.returncode == 0, verified.stdout + verified.stderr
