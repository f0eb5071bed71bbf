"""Losing the store: the server notices and stops answering, nothing starts over at offset 0,
clients stop with the store's identity, and recovery from an export keeps streams unique.
Also bounded fuzzing of a live server. (The chaos run, a 4-rank gloo job through a stopped,
killed and restarted coordinator, is in tests/client/test_tracker_faults.py.)

Every test runs real `rngcoord serve` subprocesses on real stores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import CoordinatorFactory, CoordinatorProcess, run_cli, secret_for
from rngcoord.client import (
    CoordinatorClient,
    LeaseManager,
    StoreMismatchError,
)
from rngcoord.client._leases import LeaseSchedule
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import error_info

JOB = "lost"


def _wait(predicate: object, timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - started < timeout_s, f"{what} within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def _manager(client: CoordinatorClient, group: str = "g") -> LeaseManager:
    """A manager of a 1-rank group whose leases are 64 offsets each."""
    joined = client.join_group(JOB, group, rank=0, world_size=1, member_id="m0", job_seed=7)
    return LeaseManager(
        client,
        JOB,
        group,
        rank=0,
        member_id="m0",
        joined=joined,
        schedule=LeaseSchedule(fixed=64),
    )


@pytest.mark.slow
def test_a_deleted_store_turns_the_server_away_and_a_restart_needs_init(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    db = tmp_path / "lost.db"
    server = coordinator_factory(f"sqlite:///{db}")
    stub = server.stub()
    stub.JoinGroup(
        pb.JoinGroupRequest(
            job=JOB, group="g", rank=0, world_size=1, member_id="m", member_secret=secret_for("m")
        )
    )

    def reserve(seq: int) -> pb.ReserveResponse:
        request = pb.ReserveRequest(
            job=JOB,
            group="g",
            epoch=1,
            seq=seq,
            size=64,
            fingerprint=b"f",
            rank=0,
            member_id="m",
            member_secret=secret_for("m"),
        )
        reply: pb.ReserveResponse = stub.Reserve(request, timeout=10)
        return reply

    assert reserve(0).lease.start == 0
    for path in tmp_path.glob("lost.db*"):
        path.unlink()
    took = _wait(lambda: server.health() == "NOT_SERVING", 5, "health NOT_SERVING")
    assert took < 5
    for seq in (0, 1, 2):  # neither a hit nor a grant is acknowledged any more
        with pytest.raises(grpc.RpcError) as refused:
            reserve(seq)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        info = error_info(refused.value)
        assert info is not None and info.reason == "STORE_LOST"
    assert any(e["event"] == "store_lost" for e in server.log_events())
    server.kill()
    with pytest.raises(RuntimeError, match=r"no rngcoord store at .*lost\.db: create one with"):
        server.restart()
    assert not db.exists()


def test_a_relative_default_path_from_another_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_cli("serve", "--db", "sqlite:///rngcoord.db", "--metrics", "off", cwd=elsewhere)
    assert result.returncode == 2
    assert f"no rngcoord store at {elsewhere / 'rngcoord.db'}" in result.stderr
    assert not (elsewhere / "rngcoord.db").exists()


@pytest.mark.slow
def test_a_client_meeting_a_new_empty_store_stops_and_never_reuses_offsets(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    db = tmp_path / "first.db"
    server = coordinator_factory(f"sqlite:///{db}")
    client = CoordinatorClient(server.address, outage_s=10.0, backoff_s=0.1)
    manager = _manager(client)
    first_store = client.store_id
    assert first_store and manager.advance(32, b"a") == 0
    saved = client.audit_head
    assert saved.startswith(f"{first_store}:")
    # The store is lost while the server is down; it comes back on a new, empty one.
    server.kill()
    for path in tmp_path.glob("first.db*"):
        path.unlink()
    server.restart(init=True)
    with pytest.raises(StoreMismatchError) as stopped:
        manager.advance(96, b"b")  # needs lease 2, which the new store has never heard of
    assert first_store in str(stopped.value) and "--floor-from" in str(stopped.value)
    with pytest.raises(StoreMismatchError):
        _manager(client, "g")
    # A new process resuming from the checkpoint meets the same refusal at its first join.
    fresh = CoordinatorClient(server.address)
    fresh.expect_store(first_store)
    with pytest.raises(
        StoreMismatchError, match=f"this job's random streams came from store {first_store}"
    ):
        fresh.join_group(JOB, "g", rank=0, world_size=1, member_id="m1", job_seed=7)
    for c in (client, fresh):
        c.close()
    # Nothing was granted from the new store.
    listed = run_cli("audit", "--db", f"sqlite:///{db}", "--kind", "grant")
    assert "no audit records match" in listed.stdout


@pytest.mark.slow
def test_floors_from_an_export_keep_a_new_store_above_the_lost_one(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    old = coordinator_factory(f"sqlite:///{tmp_path / 'old.db'}")
    with CoordinatorClient(old.address) as client:
        manager = _manager(client)
        for _ in range(5):
            manager.advance(64, b"op")
        manager.close()
    old.terminate()
    export = tmp_path / "export.jsonl"
    export.write_text(run_cli("audit", "--db", old.db_url, "--json").stdout)
    grants = [json.loads(line) for line in export.read_text().splitlines()]
    high = max(r["detail"]["end"] for r in grants if r["kind"] == "grant")
    assert high >= 5 * 64
    bound = tmp_path / "bound.txt"
    bound.write_text(f"# JOB GROUP OFFSET\nother * {1 << 40}\n")
    new = coordinator_factory(
        f"sqlite:///{tmp_path / 'new.db'}",
        args=["--floor-from", str(export), "--floor-from", str(bound)],
    )
    with CoordinatorClient(new.address) as client:
        manager = _manager(client)
        assert manager.advance(64, b"op") == high  # the same job's group starts above it
        other = client.join_group("other", "x", rank=0, world_size=1, member_id="o", job_seed=7)
        assert other.start == 1 << 40
    floors = run_cli("audit", "--db", new.db_url, "--kind", "floor", "--json")
    assert sorted(json.loads(line)["detail"]["floor"] for line in floors.stdout.splitlines()) == [
        high,
        1 << 40,
    ]
    assert run_cli("verify", "--db", new.db_url).returncode == 0


def test_a_dropped_postgresql_schema_turns_the_server_away(
    coordinator_factory: CoordinatorFactory, postgres_url_factory: object
) -> None:
    import psycopg

    url = postgres_url_factory()  # type: ignore[operator]
    server = coordinator_factory(url)
    stub = server.stub()
    stub.JoinGroup(
        pb.JoinGroupRequest(
            job=JOB, group="g", rank=0, world_size=1, member_id="m", member_secret=secret_for("m")
        )
    )
    with psycopg.connect(url, autocommit=True) as conn:
        for attempt in range(5):
            # The server's reads hold table locks one by one as the DROP takes them all, so
            # PostgreSQL may pick the DROP as a deadlock's victim: drop again, as an operator
            # would.
            try:
                with conn.transaction():
                    conn.execute("DROP SCHEMA public CASCADE")
                    conn.execute("CREATE SCHEMA public")
                break
            except psycopg.errors.DeadlockDetected:
                if attempt == 4:
                    raise
    _wait(lambda: server.health() == "NOT_SERVING", 5, "health NOT_SERVING")
    request = pb.ReserveRequest(
        job=JOB,
        group="g",
        epoch=1,
        seq=0,
        size=64,
        fingerprint=b"f",
        rank=0,
        member_id="m",
        member_secret=secret_for("m"),
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.Reserve(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


FIELDS = st.fixed_dictionaries(
    {
        "job": st.text(max_size=200),
        "group": st.text(max_size=200),
        "epoch": st.integers(0, (1 << 64) - 1),
        "seq": st.integers(0, (1 << 64) - 1),
        "size": st.integers(0, (1 << 64) - 1),
        "rank": st.integers(0, (1 << 32) - 1),
        "member_id": st.text(max_size=200),
        "fingerprint": st.binary(max_size=64),
    }
)


@pytest.mark.slow
def test_fuzzed_requests_leave_a_serving_server_and_a_clean_store(
    coordinator: CoordinatorProcess,
) -> None:
    stub = coordinator.stub()
    channel = coordinator.channel()
    codes: set[str] = set()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        fields=FIELDS,
        raw=st.binary(max_size=512),
        method=st.sampled_from(["JoinGroup", "Reserve", "LeaveGroup", "GetGroup", "Restore"]),
    )
    def fuzz(fields: dict[str, Any], raw: bytes, method: str) -> None:
        f = fields
        secret = secret_for(f["member_id"])
        requests = {
            "JoinGroup": pb.JoinGroupRequest(
                job=f["job"], group=f["group"], rank=f["rank"], world_size=f["rank"],
                member_id=f["member_id"], member_secret=secret, timeout_ms=50,
            ),
            "Reserve": pb.ReserveRequest(
                job=f["job"], group=f["group"], epoch=f["epoch"], seq=f["seq"], size=f["size"],
                fingerprint=f["fingerprint"], rank=f["rank"], member_id=f["member_id"],
                member_secret=secret,
            ),
            "LeaveGroup": pb.LeaveGroupRequest(
                job=f["job"], group=f["group"], epoch=f["epoch"], rank=f["rank"],
                member_id=f["member_id"], member_secret=secret,
            ),
            "GetGroup": pb.GetGroupRequest(job=f["job"], group=f["group"]),
            "Restore": pb.RestoreRequest(
                job=f["job"], group=f["group"], epoch=f["epoch"], seq=f["seq"], cursor=f["size"],
                rank=f["rank"], member_id=f["member_id"], member_secret=secret, timeout_ms=50,
            ),
        }  # fmt: skip
        for payload in (requests[method], raw):
            try:
                if isinstance(payload, bytes):
                    channel.unary_unary(
                        f"/rngcoord.v1.Coordinator/{method}",
                        request_serializer=None,
                        response_deserializer=None,
                    )(payload, timeout=10)
                else:
                    getattr(stub, method)(payload, timeout=10)
                codes.add("OK")
            except grpc.RpcError as e:
                assert e.code() != grpc.StatusCode.INTERNAL, (method, payload, e.details())
                codes.add(e.code().name)

    fuzz()
    assert "INVALID_ARGUMENT" in codes
    assert coordinator.health() == "SERVING"
    report = run_cli("verify", "--db", coordinator.db_url)
    assert report.returncode == 0, report.stdout + report.stderr
