"""The client rides out coordinator outages (docs/design.md §6.2): lease managers against a
real `rngcoord serve` subprocess that is SIGKILLed and restarted on the same store, two
PostgreSQL replicas of which one dies for good, an outage past the budget, ranks whose
timing differs, and install()'s bounded first contact (in a subprocess, which owns its
torch.distributed group)."""

from __future__ import annotations

import itertools
import json
import logging
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness import CoordinatorProcess, run_cli
from ports import closed_address
from rngcoord.client import CoordinatorClient, CoordinatorUnavailable, LeaseManager
from rngcoord.client._leases import LeaseSchedule
from rngcoord.v1.types import JoinResult

# Small leases, so that the ops below need new ones during the outage.
SCHEDULE = LeaseSchedule(min_size=64, op_factor=2, growth=2, max_size=1 << 9)


def _join(clients: list[CoordinatorClient], job: str, group: str) -> list[JoinResult]:
    results: list[JoinResult | None] = [None] * len(clients)

    def run(rank: int) -> None:
        results[rank] = clients[rank].join_group(
            job, group, rank=rank, world_size=len(clients), member_id=f"m{rank}", job_seed=11
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def _ranks(
    targets: str | list[str],
    job: str,
    *,
    outage_s: float = 60.0,
    prefetch_s: tuple[float, float] = (30.0, 30.0),
    schedule: LeaseSchedule = SCHEDULE,
) -> tuple[list[CoordinatorClient], list[LeaseManager]]:
    """Two ranks, each with a client of its own (as two processes have); rank 0 logs."""
    clients = [
        CoordinatorClient(targets, deadline_s=2.0, outage_s=outage_s, log_outages=rank == 0)
        for rank in range(2)
    ]
    joined = _join(clients, job, "g")
    managers = [
        LeaseManager(
            clients[rank],
            job,
            "g",
            rank=rank,
            member_id=f"m{rank}",
            joined=joined[rank],
            schedule=schedule,
            prefetch_s=prefetch_s[rank],
        )
        for rank in range(2)
    ]
    return clients, managers


def _run_ranks(
    managers: list[LeaseManager], ops: int, pause_s: Callable[[int], float]
) -> tuple[list[list[int]], list[BaseException | None], list[list[float]]]:
    """Each rank runs `ops` ops of 16 offsets in a thread, sleeping pause_s(rank) before
    each; returns the bases, what each raised, and when each op finished."""
    bases: list[list[int]] = [[], []]
    times: list[list[float]] = [[], []]
    raised: list[BaseException | None] = [None, None]

    def main(rank: int) -> None:
        try:
            for i in range(ops):
                time.sleep(pause_s(rank))
                bases[rank].append(managers[rank].advance(16, f"rand(16,)#{i % 3}".encode()))
                times[rank].append(time.monotonic())
        except BaseException as exc:  # the test inspects it
            raised[rank] = exc

    threads = [threading.Thread(target=main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bases, raised, times


def _grants(address: str, job: str) -> list[tuple[int, int, int, str]]:
    with CoordinatorClient(address) as client:
        records = client.list_audit(job=job, kinds=["grant"])
    return sorted(
        (r.detail["seq"], r.detail["start"], r.detail["end"], r.detail["fingerprint"])
        for r in records
    )


def _check_grants(grants: list[tuple[int, int, int, str]], cursor: int) -> None:
    """Granted once each, contiguous from 0, and covering every op."""
    assert [g[0] for g in grants] == list(range(len(grants)))
    assert all(a[2] == b[1] for a, b in itertools.pairwise(grants))
    assert grants[0][1] == 0 and grants[-1][2] >= cursor


@pytest.mark.slow
def test_ops_ride_out_a_killed_and_restarted_coordinator(
    coordinator: CoordinatorProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rngcoord.client.connection")
    clients, managers = _ranks(coordinator.address, "restart")
    outage: dict[str, float] = {}

    def chaos() -> None:
        time.sleep(0.8)
        coordinator.kill()
        outage["began"] = time.monotonic()
        time.sleep(4.0)
        coordinator.restart()
        outage["ended"] = time.monotonic()

    killer = threading.Thread(target=chaos)
    killer.start()
    # Rank 1 runs a little behind and at another pace: timing differs, requests must not.
    bases, raised, times = _run_ranks(
        managers, 500, lambda rank: 0.01 if rank == 0 else random.uniform(0.005, 0.02)
    )
    killer.join()
    assert raised == [None, None]
    assert bases[0] == bases[1] == [16 * i for i in range(500)]
    # The ops went on during the outage, on the leases held, and waited once those ran out.
    during = [t for t in times[0] if outage["began"] < t < outage["ended"]]
    assert during, "no op ran during the outage"
    assert max(m.stats.longest_stall_s for m in managers) > 0.5
    for manager in managers:
        manager.close()
    for client in clients:
        client.close()
    _check_grants(_grants(coordinator.address, "restart"), 500 * 16)
    verify = run_cli("verify", "--db", coordinator.db_url)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "no overlaps" in verify.stdout
    # One warning for the outage, from rank 0 alone, and one line when it ended.
    # (Logged as "rngcoord.client.connection", the documented logger name.)
    warnings = [r.getMessage() for r in caplog.records if r.name == "rngcoord.client.connection"]
    began = [m for m in warnings if "unreachable" in m]
    ended = [m for m in warnings if "outage over" in m]
    assert len(began) == 1 and len(ended) == 1, warnings
    assert coordinator.address in began[0] and "outage budget 60 s" in began[0]


def test_ranks_that_send_at_different_times_ask_the_same(coordinator: CoordinatorProcess) -> None:
    # Rank 0 sends only what it needs and the prefetch; rank 1 sends every fixed lease as
    # early as it may. Both ask for the same (seq, size, fingerprint), or the coordinator
    # would report a divergence.
    clients, managers = _ranks(coordinator.address, "timing", prefetch_s=(0.0, 1e9))
    bases, raised, _ = _run_ranks(managers, 120, lambda rank: 0.0 if rank == 0 else 0.004)
    assert raised == [None, None]
    assert bases[0] == bases[1]
    for manager in managers:
        manager.close()
    assert managers[1].stats.reserves > managers[0].stats.reserves
    grants = _grants(coordinator.address, "timing")
    _check_grants(grants, 120 * 16)
    for client in clients:
        client.close()


@pytest.mark.slow
def test_an_outage_past_the_budget_names_when_it_began_and_the_budget(
    coordinator: CoordinatorProcess,
) -> None:
    clients, managers = _ranks(coordinator.address, "budget", outage_s=3.0)
    for manager in managers:
        manager.advance(16, b"rand(16,)")
    wall_before = time.strftime("%H:%M", time.localtime())
    coordinator.kill()
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable) as raised:
        for _ in range(10_000):
            managers[0].advance(16, b"rand(16,)")
    waited = time.monotonic() - started
    assert 3.0 <= waited < 12
    message = str(raised.value)
    assert f"unreachable at [{coordinator.address}] since " in message
    assert wall_before in message and "reachable until" in message
    assert "past the outage budget of 3 s" in message
    assert "install(outage_s=...)" in message and "RNGCOORD_OUTAGE_S" in message
    for manager in managers:
        started = time.monotonic()
        manager.close()  # leaving gives up with a warning, not an exception
        assert time.monotonic() - started < 8
    for client in clients:
        client.close()


@pytest.mark.slow
def test_failover_to_the_other_postgres_replica(
    postgres_url_factory: Callable[[], str],
    coordinator_factory: Callable[..., CoordinatorProcess],
) -> None:
    db_url = postgres_url_factory()
    replicas = [coordinator_factory(db_url), coordinator_factory(db_url)]
    targets = [r.address for r in replicas]
    clients, managers = _ranks(targets, "failover")

    def kill_first() -> None:
        time.sleep(0.8)
        replicas[0].kill()  # for good

    killer = threading.Thread(target=kill_first)
    killer.start()
    bases, raised, _ = _run_ranks(managers, 300, lambda rank: 0.005 * (rank + 1))
    killer.join()
    assert raised == [None, None]
    assert bases[0] == bases[1] == [16 * i for i in range(300)]
    for manager in managers:
        manager.close()
    for client in clients:
        client.close()
    _check_grants(_grants(replicas[1].address, "failover"), 300 * 16)
    verify = run_cli("verify", "--db", db_url)
    assert verify.returncode == 0, verify.stdout + verify.stderr


_INSTALL = textwrap.dedent(
    """
    import json, sys, tempfile, time
    import torch.distributed as dist
    from rngcoord.client import init_mesh, install

    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    mesh = init_mesh((1,), ("tp",), device_type="cpu")
    started = time.monotonic()
    try:
        install(mesh, target=sys.argv[1], job="probe", token=sys.argv[2] or None,
                connect_timeout_s=float(sys.argv[3]))
        outcome = {"error": None, "message": ""}
    except Exception as e:
        outcome = {"error": type(e).__name__, "message": str(e)}
    outcome["seconds"] = time.monotonic() - started
    print(json.dumps(outcome))
    """
)


def _install(target: str, token: str, within_s: float) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _INSTALL, target, token, str(within_s)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.slow
def test_install_fails_fast_on_a_wrong_address_or_token(
    coordinator_factory: Callable[..., CoordinatorProcess], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("trainer member probe s3cret\n")
    server = coordinator_factory(args=("--tokens", str(tokens)))
    closed = closed_address()
    wrong_address = _install(closed, "s3cret", 3.0)
    assert wrong_address["error"] == "CoordinatorUnavailable"
    assert closed in wrong_address["message"] and "RNGCOORD_ADDR" in wrong_address["message"]
    assert 3.0 <= wrong_address["seconds"] < 10
    wrong_token = _install(server.address, "wrong", 3.0)
    assert wrong_token["error"] == "AuthenticationError", wrong_token
    assert "RNGCOORD_TOKEN" in wrong_token["message"] and wrong_token["seconds"] < 10
    right = _install(server.address, "s3cret", 3.0)
    assert right["error"] is None, right
