"""CoordinatorClient: failover against real coordinators, the errors of refused requests,
bearer tokens and TLS, a time-bounded retry against closed ports, configuration from the
environment."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ports import closed_address
from rngcoord.client import (
    AuthenticationError,
    CoordinatorClient,
    CoordinatorUnavailable,
    FailedPreconditionError,
    InvalidRequest,
    JoinTimeoutError,
    NotFoundError,
    _connection,
)
from rngcoord.v1.types import members_digest


def test_fails_over_to_the_next_target(coordinator: Any) -> None:
    with CoordinatorClient([closed_address(), coordinator.address], backoff_s=0.01) as client:
        joined = client.join_group(
            "failover", "g", rank=0, world_size=1, member_id="m0", job_seed=9, include_members=True
        )
        assert (joined.epoch, joined.job_seed, joined.members) == (1, 9, ("m0",))
        assert joined.members_digest == members_digest([(0, "m0")])
        lease = client.reserve(
            "failover", "g", epoch=1, seq=0, size=64, fingerprint=b"fp", rank=0, member_id="m0"
        )
        assert (lease.seq, lease.start, lease.end, lease.seed) == (0, 0, 64, joined.seed)
        assert not lease.existing
        assert client.reserve(
            "failover", "g", epoch=1, seq=0, size=64, fingerprint=b"fp", rank=0, member_id="m0"
        ).existing
        info = client.get_group("failover", "g")
        assert (info.epoch, info.high_water, info.leases) == (1, 64, 1)
        assert (
            client.restore("failover", "g", epoch=1, seq=1, cursor=0, rank=0, member_id="m0").cursor
            == 0
        )
        client.leave_group("failover", "g", epoch=1, rank=0, member_id="m0")
        assert client.get_group("failover", "g").members == ("",)
        kinds = [r.kind for r in client.list_audit(job="failover")]
        assert kinds[:3] == ["job", "group", "epoch"] and kinds[-1] == "leave"


def test_refusals_name_what_failed(coordinator: Any) -> None:
    with CoordinatorClient(coordinator.address) as client:
        with pytest.raises(NotFoundError, match="check the job and group names"):
            client.get_group("nosuchjob", "g")
        with pytest.raises(InvalidRequest, match="group"):
            client.join_group("refusals", "bad name!", rank=0, world_size=1, member_id="m0")
        client.join_group("refusals", "g", rank=0, world_size=1, member_id="m0", job_seed=1)
        with pytest.raises(FailedPreconditionError, match="root seed 1"):
            client.join_group("refusals", "g2", rank=0, world_size=1, member_id="m0", job_seed=2)
        with pytest.raises(FailedPreconditionError, match="not a member"):
            client.reserve(
                "refusals",
                "g",
                epoch=1,
                seq=0,
                size=64,
                fingerprint=b"fp",
                rank=0,
                member_id="intruder",
            )
        with pytest.raises(JoinTimeoutError, match=r"\[1\]"):
            client.join_group(
                "refusals", "pair", rank=0, world_size=2, member_id="m0", timeout_s=0.3
            )


def test_token_and_tls(coordinator_factory: Any, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    tokens = tmp_path / "tokens"
    tokens.write_text("secure s3cret\n")
    server = coordinator_factory(
        args=("--tokens", str(tokens), "--tls-cert", str(cert), "--tls-key", str(key))
    )
    with CoordinatorClient(server.address, token="s3cret", tls_ca=str(cert)) as client:
        assert client.join_group("secure", "g", rank=0, world_size=1, member_id="m0").epoch == 1
    with (
        CoordinatorClient(server.address, token="wrong", tls_ca=str(cert)) as client,
        pytest.raises(AuthenticationError, match="RNGCOORD_TOKEN"),
    ):
        client.get_group("secure", "g")


def test_joins_of_one_epoch_agree(coordinator: Any) -> None:
    results: dict[int, Any] = {}
    with CoordinatorClient(coordinator.address) as client:

        def run(rank: int) -> None:
            results[rank] = client.join_group(
                "agree", "g", rank=rank, world_size=3, member_id=f"m{rank}", job_seed=4
            )

        threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len({(r.epoch, r.seed, r.start, r.members) for r in results.values()}) == 1


def test_unreachable_coordinator_gives_a_bounded_wait_and_advice() -> None:
    targets = [closed_address(), closed_address()]
    client = CoordinatorClient(targets, deadline_s=1.0, outage_s=1.5, backoff_s=0.01)
    started = time.monotonic()
    with client, pytest.raises(CoordinatorUnavailable) as raised:
        client.get_group("job", "group")
    # Tools fail within their budget when nothing listens.
    assert 1.5 <= time.monotonic() - started < 5
    message = str(raised.value)
    assert f"[{targets[0]}, {targets[1]}] since " in message and "never reached" in message
    assert "outage budget of 1.5 s" in message
    assert "rngcoord serve" in message and "RNGCOORD_ADDR" in message
    # A budget of 0 tries each target once.
    started = time.monotonic()
    with CoordinatorClient(targets, outage_s=0) as once, pytest.raises(CoordinatorUnavailable):
        once.get_group("job", "group")
    assert time.monotonic() - started < 1.5


def test_client_configuration_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RNGCOORD_ADDR", "a:1, b:2")
    monkeypatch.setenv("RNGCOORD_TOKEN", "secret")
    with CoordinatorClient() as client:
        assert client.targets == ("a:1", "b:2")
        assert client._metadata == (("authorization", "Bearer secret"),)
    monkeypatch.delenv("RNGCOORD_ADDR")
    monkeypatch.delenv("RNGCOORD_TOKEN")
    with CoordinatorClient() as client:
        assert client.targets == (_connection.DEFAULT_ADDR,)
        assert client._metadata == ()
    with pytest.raises(InvalidRequest, match="RNGCOORD_ADDR"):
        CoordinatorClient(" , ")
    with pytest.raises(InvalidRequest, match="CA bundle"):
        CoordinatorClient("a:1", tls_ca="/nonexistent/ca.pem")


def test_a_process_keeps_one_channel_per_target(coordinator: Any) -> None:
    # Every tracker and group of a process (thread-ranks included) shares one channel, hence
    # one connection, per coordinator; the last client to close closes it.
    first = CoordinatorClient(coordinator.address)
    second = CoordinatorClient([coordinator.address, closed_address()])
    assert first._channels[0] is second._channels[0]
    first.close()
    first.close()  # idempotent: releases once
    # Still open for the other client.
    joined = second.join_group("shared", "g", rank=0, world_size=1, member_id="m0")
    assert joined.epoch == 1
    second.close()
    third = CoordinatorClient(coordinator.address)
    assert third._channels[0] is not second._channels[0]
    third.close()
