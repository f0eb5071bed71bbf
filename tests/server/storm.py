"""The storm of tests/server/test_replicas.py and test_failover.py: client processes that reserve
leases from coordinator replicas until told to stop, and the checks of what they received.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from replica_client import FINGERPRINT, lease_size

from harness import CoordinatorProcess, run_cli
from rngcoord.client import CoordinatorClient
from rngcoord.client._connection import adopt_member_secret

WORKER = Path(__file__).with_name("replica_client.py")

JOB = "replicas"
GROUPS = ("g0", "g1", "g2", "g3")
MEMBERS = [(group, rank) for group in GROUPS for rank in (0, 1)]
LEASES_PER_PHASE = 15
"""How many more leases every member must get before the storm moves to its next phase."""


class Storm:
    """Client processes: process p holds rank p % 2 of two groups, preferring replica p % 2.

    Args:
        replicas: the two coordinator processes (A, B).
        workdir: where the stop file and the processes' outputs go.
    """

    def __init__(self, replicas: list[CoordinatorProcess], workdir: Path) -> None:
        self.replicas = replicas
        self.stop_file = workdir / "stop"
        self.outputs = [workdir / f"client-{p}.jsonl" for p in range(4)]
        self.errors = [workdir / f"client-{p}.err" for p in range(4)]
        self.ready = [workdir / f"client-{p}.ready" for p in range(4)]
        self.processes: list[subprocess.Popen[bytes]] = []
        for p in range(4):
            rank = p % 2
            preferred, other = replicas[rank], replicas[1 - rank]
            pair = GROUPS[2 * (p // 2) : 2 * (p // 2) + 2]
            cmd = [sys.executable, str(WORKER), "--job", JOB, "--world-size", "2"]
            cmd += ["--targets", f"{preferred.address},{other.address}"]
            cmd += ["--stop", str(self.stop_file), "--ready", str(self.ready[p])]
            for group in pair:
                cmd += ["--member", f"{group}:{rank}"]
            with self.outputs[p].open("wb") as out, self.errors[p].open("wb") as err:
                self.processes.append(subprocess.Popen(cmd, stdout=out, stderr=err))

    def lease_counts(self) -> dict[tuple[str, int], int]:
        """Leases each member (group, rank) has received so far."""
        counts = dict.fromkeys(MEMBERS, 0)
        for output in self.outputs:
            text = output.read_text()
            # The last line may be half written; only complete lines count.
            for line in text[: text.rfind("\n") + 1].splitlines():
                record = json.loads(line)
                counts[record["group"], record["rank"]] += 1
        return counts

    def wait_for_progress(
        self, baseline: dict[tuple[str, int], int], timeout_s: float = 60
    ) -> None:
        """Block until every member has LEASES_PER_PHASE more leases than in `baseline`,
        within `timeout_s` of every client having joined."""
        self.wait_joined()
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.lease_counts()
            if all(counts[m] >= baseline.get(m, 0) + LEASES_PER_PHASE for m in MEMBERS):
                return
            dead = [p.args for p in self.processes if p.poll() is not None]
            assert not dead, f"a client exited early: {self.diagnostics()}"
            if time.monotonic() >= deadline:
                raise AssertionError(f"no progress: {counts}; {self.diagnostics(stacks=True)}")
            time.sleep(0.05)

    def wait_joined(self, timeout_s: float = 300) -> None:
        """Block until every client has joined all its groups. Starting one imports torch
        (under rngcoord.client), which takes seconds alone and over a minute on 2 cores
        beside a full suite: the phases' clocks start after it."""
        deadline = time.monotonic() + timeout_s
        while not all(ready.exists() for ready in self.ready):
            dead = [p.args for p in self.processes if p.poll() is not None]
            assert not dead, f"a client exited early: {self.diagnostics()}"
            if time.monotonic() >= deadline:
                stacks = self.diagnostics(stacks=True)
                raise AssertionError(f"not joined in {timeout_s} s: {stacks}")
            time.sleep(0.05)

    def finish(self, *, clean: bool = True) -> list[dict[str, Any]]:
        """Stop the clients and return every lease they got; with `clean`, check that each
        one exited cleanly (without, some may have stopped on an error first)."""
        self.stop_file.touch()
        for process in self.processes:
            process.wait(60)
        if clean:
            assert all(p.returncode == 0 for p in self.processes), self.diagnostics()
        records = []
        for output in self.outputs:
            records += [json.loads(line) for line in output.read_text().splitlines()]
        return records

    def __enter__(self) -> Storm:
        return self

    def __exit__(self, *exc: object) -> None:
        """Kill the clients that still run (after a failed assertion)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    def diagnostics(self, *, stacks: bool = False) -> str:
        """Each client's stderr; with `stacks`, after asking the live ones for every thread's
        stack, and with the tail of each coordinator's log."""
        if stacks:
            for process in self.processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGUSR1)
            time.sleep(1.0)  # faulthandler writes at once; let the files catch up
        limit = 6000 if stacks else 2000
        parts = [f"client {p}: {e.read_text()[-limit:]}" for p, e in enumerate(self.errors)]
        if stacks:
            for name, replica in zip("AB", self.replicas, strict=False):
                parts.append(f"coordinator {name}: {replica.output()[-3000:]}")
        return "\n".join(parts)


def check_agreement(
    records: list[dict[str, Any]], *, one_grant_each: bool, lost_grants: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Both ranks of a group got the same lease for every seq they both asked for, never were
    both told it was new, and each group's leases are contiguous. Returns, per group, the
    leases of the rank that got further, by seq.

    `one_grant_each`: also require that one of the two was told it was new. A replica killed
    after its commit but before its reply breaks that: the retry elsewhere reads the lease
    back, so both ranks see `existing`.

    `lost_grants`: the store lost grants (a lossy failover), so a lease one rank was told was
    new may be granted anew to the other: the same range, from its predecessor's end.
    """
    by_member: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_member[record["group"], record["rank"]].append(record)
    chains = {}
    for group in GROUPS:
        rank0, rank1 = by_member[group, 0], by_member[group, 1]
        assert [r["seq"] for r in rank0] == list(range(len(rank0)))
        assert [r["seq"] for r in rank1] == list(range(len(rank1)))
        for a, b in zip(rank0, rank1, strict=False):
            assert (a["epoch"], a["seed"], a["start"], a["end"]) == (
                b["epoch"],
                b["seed"],
                b["start"],
                b["end"],
            )
            assert a["existing"] or b["existing"] or lost_grants, (a, b)
            if one_grant_each:
                assert a["existing"] != b["existing"], (a, b)
        longer = rank0 if len(rank0) >= len(rank1) else rank1
        expected_start = longer[0]["start"]
        for record in longer:
            assert record["start"] == expected_start
            assert record["end"] == record["start"] + lease_size(record["seq"])
            expected_start = record["end"]
        chains[group] = longer
    return chains


def check_read_back(target: str, chains: dict[str, list[dict[str, Any]]]) -> None:
    """Every lease a client received is stored: asking again returns it, as a hit."""
    with CoordinatorClient([target], deadline_s=10, outage_s=2.0) as client:
        for chain in chains.values():
            for r in chain:
                adopt_member_secret(r["member_id"], bytes.fromhex(r["secret"]))
                lease = client.reserve(
                    JOB,
                    r["group"],
                    epoch=r["epoch"],
                    seq=r["seq"],
                    size=lease_size(r["seq"]),
                    fingerprint=FINGERPRINT,
                    rank=r["rank"],
                    member_id=r["member_id"],
                )
                assert (lease.seed, lease.start, lease.end, lease.existing) == (
                    r["seed"],
                    r["start"],
                    r["end"],
                    True,
                )


def check_verify(db_url: str) -> None:
    done = run_cli("verify", "--db", db_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "chain intact, no overlaps" in done.stdout
