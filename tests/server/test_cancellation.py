"""Clients that give up mid-call never stop the coordinator (docs/design.md §7.3, §2.12).

Each storm runs against a real `rngcoord serve` process: JoinGroups whose deadlines are shorter
than their barrier timeouts, Reserves with millisecond deadlines, channels closed with calls in
flight, and client processes SIGKILLed mid-storm. Afterwards another job joins and reserves
within a second, health is SERVING, the storm's own job goes on with leases that agree, and the
store verifies. The writer's own faults are injected into a real server process too, and a
database that stops answering (a row lock held elsewhere) turns health NOT_SERVING.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest

from harness import CoordinatorProcess, run_cli, secret_for
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

_FINGERPRINT = b"\x01" * 16
_SIZE = 1 << 16


def _join(
    stub: pb_grpc.CoordinatorStub,
    job: str,
    group: str,
    *,
    world_size: int = 1,
    rank: int = 0,
    timeout_s: float = 5.0,
    deadline_s: float | None = None,
) -> pb.JoinGroupResponse:
    request = pb.JoinGroupRequest(
        job=job,
        group=group,
        rank=rank,
        world_size=world_size,
        member_id=f"m{rank}",
        member_secret=secret_for(f"m{rank}"),
        timeout_ms=round(timeout_s * 1000),
    )
    response: pb.JoinGroupResponse = stub.JoinGroup(
        request, timeout=deadline_s if deadline_s is not None else timeout_s + 5
    )
    return response


def _reserve_request(job: str, group: str, epoch: int, seq: int) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        job=job,
        group=group,
        epoch=epoch,
        seq=seq,
        size=_SIZE,
        fingerprint=_FINGERPRINT,
        rank=0,
        member_id="m0",
        member_secret=secret_for("m0"),
    )


def _quietly(fn: Callable[[], object]) -> None:
    with contextlib.suppress(grpc.RpcError):
        fn()


def _storm_joins(address: str, tag: str) -> None:
    """Joins of 2-rank groups whose second rank never comes, with a client deadline (0.2 s)
    far shorter than the barrier timeout (5 s): the server must drop each one cleanly."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        threads = [
            threading.Thread(
                target=_quietly,
                args=(
                    lambda i=i: _join(stub, f"storm-{tag}", f"g{i}", world_size=2, deadline_s=0.2),
                ),
            )
            for i in range(40)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _storm_reserves(address: str, job: str, epoch: int, seqs: range) -> None:
    """Reserves of consecutive seqs with 1 to 4 ms deadlines, many in flight at once."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        futures = [
            stub.Reserve.future(
                _reserve_request(job, "g", epoch, seq), timeout=0.001 * (1 + seq % 4)
            )
            for seq in seqs
        ]
        for future in futures:
            _quietly(future.result)


def _storm_closed_channels(address: str, job: str, epoch: int, seqs: range) -> None:
    """Calls in flight on channels that are closed under them (joins and reserves)."""
    for seq in seqs:
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.CoordinatorStub(channel)
        pending: list[Any] = [
            stub.Reserve.future(_reserve_request(job, "g", epoch, seq), timeout=5),
            stub.JoinGroup.future(
                pb.JoinGroupRequest(
                    job=f"{job}-closed",
                    group=f"c{seq}",
                    rank=0,
                    world_size=2,
                    member_id="m0",
                    member_secret=secret_for("m0"),
                    timeout_ms=5000,
                ),
                timeout=10,
            ),
        ]
        time.sleep(0.002)
        channel.close()
        for future in pending:
            _quietly(future.result)


_KILLED_CLIENT = textwrap.dedent(
    """
    import hashlib, sys, threading
    import grpc
    from rngcoord.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc as pb_grpc
    address, job, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    secret = hashlib.sha256(b"test-secret:m0").digest()  # as tests/harness.py secret_for
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.CoordinatorStub(channel)
    def reserves():
        seq = 0
        while True:
            futures = [
                stub.Reserve.future(
                    pb.ReserveRequest(job=job, group="g", epoch=epoch, seq=s, size=1 << 16,
                        fingerprint=b"\\x01" * 16, rank=0, member_id="m0",
                        member_secret=secret),
                    timeout=5,
                )
                for s in range(seq, seq + 64)
            ]
            for f in futures:
                try:
                    f.result()
                except grpc.RpcError:
                    pass
            seq += 64
    def joins():
        i = 0
        while True:
            try:
                stub.JoinGroup(pb.JoinGroupRequest(job=job + "-k", group=f"k{i}", rank=0,
                    world_size=2, member_id="m0", member_secret=secret, timeout_ms=30000),
                    timeout=60)
            except grpc.RpcError:
                pass
            i += 1
    for target in (reserves, joins, joins, joins):
        threading.Thread(target=target, daemon=True).start()
    print("storming", flush=True)
    threading.Event().wait()
    """
)


def _storm_killed_client(address: str, job: str, epoch: int) -> None:
    """A client process with joins waiting and reserves in flight, SIGKILLed mid-storm."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CLIENT, address, job, str(epoch)],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"storming"
        time.sleep(0.7)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _assert_still_serving(server: CoordinatorProcess, tag: str) -> None:
    """Another job joins and reserves within a second each, and health is SERVING."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        started = time.monotonic()
        joined = _join(stub, f"other-{tag}", "g", deadline_s=1.0)
        lease = stub.Reserve(
            _reserve_request(f"other-{tag}", "g", joined.epoch, 0), timeout=1.0
        ).lease
        took = time.monotonic() - started
    assert (lease.start, lease.end) == (joined.start, joined.start + _SIZE)
    assert took < 2.0, f"another job took {took:.2f} s to join and reserve"
    assert server.health() == "SERVING"


def _run_storms(server: CoordinatorProcess) -> None:
    address = server.address
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        joined = _join(stub, "storm", "g")
    epoch = joined.epoch
    _storm_joins(address, "a")
    _assert_still_serving(server, "after-joins")
    _storm_reserves(address, "storm", epoch, range(0, 400))
    _assert_still_serving(server, "after-reserves")
    _storm_closed_channels(address, "storm", epoch, range(400, 430))
    _assert_still_serving(server, "after-closed")
    _storm_killed_client(address, "storm", epoch)
    _assert_still_serving(server, "after-kill")
    # The storm's own job goes on: every lease it was granted is contiguous and the next
    # one follows the last, whatever calls were cancelled on the way.
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        info = stub.GetGroup(pb.GetGroupRequest(job="storm", group="g"), timeout=5)
        assert info.leases >= 1
        lease = stub.Reserve(_reserve_request("storm", "g", epoch, info.leases), timeout=5).lease
        assert lease.start == info.high_water == joined.start + info.leases * _SIZE
        again = stub.Reserve(_reserve_request("storm", "g", epoch, 0), timeout=5)
        assert again.existing
        assert (again.lease.start, again.lease.end) == (joined.start, joined.start + _SIZE)


def _check_log_and_store(server: CoordinatorProcess) -> None:
    output = server.output()
    for bad in ("InvalidStateError", "writer_died", "Traceback"):
        assert bad not in output, f"{bad} in the server's log:\n{output[-4000:]}"
    result = run_cli("verify", "--db", server.db_url)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("workers", [1, 2], ids=["one-worker", "two-workers"])
def test_cancellation_storms_on_sqlite(
    coordinator_factory: Callable[..., CoordinatorProcess], workers: int
) -> None:
    server = coordinator_factory(args=("--workers", str(workers)))
    _run_storms(server)
    _check_log_and_store(server)


def test_cancellation_storms_on_postgresql(
    coordinator_factory: Callable[..., CoordinatorProcess],
    postgres_url_factory: Callable[[], str],
) -> None:
    server = coordinator_factory(postgres_url_factory())
    _run_storms(server)
    _check_log_and_store(server)


# A real server process whose writer gets the faults a test asks for, injected into the real
# GroupCommitWriter's transaction callbacks before the CLI starts it. The test arms them by
# writing "raise N" (the next N commits raise, and so does the rollback after each) or "die"
# (the next commit kills the writer thread) to the file FAULTS names.
_FAULTY_SERVER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from rngcoord.server.storage import groupcommit
    from rngcoord.server.cli import main

    armed = Path(os.environ["FAULTS"])
    original = groupcommit.GroupCommitWriter.__init__

    def init(self, *, commit, rollback, **kwargs):
        state = {"left": 0, "seen": "", "last": "ok"}

        def fault():
            text = armed.read_text() if armed.exists() else ""
            if text != state["seen"]:
                state["seen"] = text
                kind, _, count = text.partition(" ")
                state["kind"], state["left"] = kind, int(count or 1)
            if state["left"] > 0:
                state["left"] -= 1
                return state["kind"]
            return "ok"

        def faulty_commit():
            state["last"] = fault()
            if state["last"] == "raise":
                raise KeyError("injected fault in commit")
            if state["last"] == "die":
                raise SystemExit("injected: the writer thread dies")
            commit()

        def faulty_rollback():
            rollback()
            if state["last"] == "raise":  # escapes the batch: the writer's last defence
                raise RuntimeError("injected fault in rollback")

        original(self, commit=faulty_commit, rollback=faulty_rollback, **kwargs)

    groupcommit.GroupCommitWriter.__init__ = init
    sys.exit(main(sys.argv[1:]))
    """
)


def _faulty_server(tmp_path: Path) -> subprocess.Popen[bytes]:
    db = tmp_path / "rngcoord.db"
    ready = tmp_path / "ready"
    log = (tmp_path / "server.log").open("wb")
    env = {**os.environ, "FAULTS": str(tmp_path / "faults")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _FAULTY_SERVER,
            "serve",
            "--init",
            "--listen",
            "127.0.0.1:0",
            "--db",
            f"sqlite:///{db}",
            "--ready-file",
            str(ready),
            "--metrics",
            "off",
            "--workers",
            "1",
            "--peer-rate",
            "0",
            "--grace",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        assert time.monotonic() < deadline, "the faulty server did not start"
        time.sleep(0.02)
    return proc


def _events(tmp_path: Path) -> list[dict[str, object]]:
    lines = (tmp_path / "server.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_an_exception_inside_the_writer_fails_one_batch_and_the_writer_goes_on(
    tmp_path: Path,
) -> None:
    proc = _faulty_server(tmp_path)
    (tmp_path / "faults").write_text("raise 3")
    try:
        address = (tmp_path / "ready").read_text()
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            refused = 0
            deadline = time.monotonic() + 20
            while True:  # until the injected faults are used up
                try:
                    joined = _join(stub, "job", "g", deadline_s=5)
                    break
                except grpc.RpcError as e:
                    # Typed, not a hang: the batch failed, and the caller may retry.
                    assert e.code() in (
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.INTERNAL,
                    ), e
                    refused += 1
                    assert time.monotonic() < deadline
            lease = stub.Reserve(_reserve_request("job", "g", joined.epoch, 0), timeout=5).lease
            assert lease.end - lease.start == _SIZE
        assert proc.poll() is None
        assert refused > 0, "no injected fault reached a caller"
    finally:
        proc.terminate()
        proc.wait(30)
    assert any(e["event"] == "write_batch_failed" for e in _events(tmp_path))


def test_a_dead_writer_turns_health_not_serving_and_the_process_exits(tmp_path: Path) -> None:
    proc = _faulty_server(tmp_path)
    (tmp_path / "faults").write_text("die")
    try:
        address = (tmp_path / "ready").read_text()
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                # Commits until one dies; each is refused (typed) or answered, never hung.
                for i in range(20):
                    _join(stub, "job", f"g{i}", deadline_s=5)
            assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
        assert proc.wait(30) == 70
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = _events(tmp_path)
    names = [e["event"] for e in events]
    assert "writer_died" in names and "exiting" in names, names


def test_writes_stuck_on_a_database_lock_turn_health_not_serving_until_they_move(
    coordinator_factory: Callable[..., CoordinatorProcess],
    postgres_url_factory: Callable[[], str],
) -> None:
    url = postgres_url_factory()
    server = coordinator_factory(url)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        # Another session holds the chain head's row lock, which every write takes first:
        # the server's writes hang, as on a database that stopped answering.
        with psycopg.connect(url) as blocker:
            blocker.execute("SELECT * FROM audit_head FOR UPDATE")
            stuck = stub.JoinGroup.future(
                pb.JoinGroupRequest(
                    job="job",
                    group="g",
                    rank=0,
                    world_size=1,
                    member_id="m0",
                    member_secret=secret_for("m0"),
                    timeout_ms=60_000,
                ),
                timeout=90,
            )
            deadline = time.monotonic() + 30
            while server.health() == "SERVING":
                assert time.monotonic() < deadline, "health stayed SERVING with writes stuck"
                time.sleep(0.25)
            assert not stuck.done()
            blocker.rollback()
        joined = stuck.result(timeout=30)
        assert joined.epoch == 1
        deadline = time.monotonic() + 10
        while server.health() != "SERVING":
            assert time.monotonic() < deadline, "health did not recover once writes moved"
            time.sleep(0.1)
    events = [e.get("event") for e in server.log_events()]
    assert "not_serving" in events and "serving_again" in events
