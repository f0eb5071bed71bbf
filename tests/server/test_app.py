"""Operations surface of `rngcoord serve`: health, reflection, metrics, tokens, TLS, drain, logs.

Each test runs a real server subprocess and talks to it the way an operator's tools would
(grpc.health.v1, server reflection, Prometheus scrape, bearer tokens, TLS and mTLS
certificates made by the openssl CLI, SIGTERM).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from harness import CoordinatorFactory, CoordinatorProcess, join_all, secret_for, wait_for_group
from ports import free_port
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

JOB = "ops"
SERVICE = "rngcoord.v1.Coordinator"


def _reserve(seq: int, member: str, *, job: str = JOB, size: int = 64) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        job=job,
        group="g",
        epoch=1,
        seq=seq,
        size=size,
        fingerprint=b"fp",
        rank=0,
        member_id=member,
        member_secret=secret_for(member),
    )


def test_health_reports_serving_and_reflection_lists_the_services(
    coordinator: CoordinatorProcess,
) -> None:
    assert coordinator.health() == "SERVING"
    assert coordinator.health(SERVICE) == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(coordinator.channel())
    replies = list(
        stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
    )
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_metrics_count_grants_hits_divergences_and_errors(
    coordinator_factory: CoordinatorFactory,
) -> None:
    server = coordinator_factory(args=["--metrics", "127.0.0.1:0"])
    (serving,) = [e for e in server.log_events() if e["event"] == "serving"]
    metrics_url = f"http://{serving['fields']['metrics']}/metrics"
    stub = server.stub()
    member = join_all(stub, JOB, "g", 1)[0].members[0]
    for seq in range(3):
        stub.Reserve(_reserve(seq, member), timeout=10)
    for seq in range(2):
        assert stub.Reserve(_reserve(seq, member), timeout=10).existing
    with pytest.raises(grpc.RpcError):
        stub.Reserve(_reserve(0, member, size=128), timeout=10)  # divergence
    with pytest.raises(grpc.RpcError):
        stub.GetGroup(pb.GetGroupRequest(job=JOB, group="nope"), timeout=10)

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("rngcoord_grants_total", ())] == 3
    assert samples[("rngcoord_hits_total", ())] == 2
    assert samples[("rngcoord_divergences_total", ())] == 1
    assert samples[("rngcoord_errors_total", (("code", "FAILED_PRECONDITION"),))] == 1
    assert samples[("rngcoord_errors_total", (("code", "NOT_FOUND"),))] == 1
    assert samples[("rngcoord_rpc_seconds_count", (("method", "Reserve"),))] == 6
    assert samples[("rngcoord_rpc_seconds_count", (("method", "JoinGroup"),))] == 1


@pytest.mark.slow
def test_workers_share_the_port_and_their_metrics(
    coordinator_factory: CoordinatorFactory,
) -> None:
    metrics_port = free_port()
    server = coordinator_factory(args=["--workers", "2", "--metrics", f"127.0.0.1:{metrics_port}"])
    pids = {e["fields"]["pid"] for e in server.log_events() if e["event"] == "serving"}
    assert len(pids) == 2, "two worker processes serve"
    # Separate connections (the kernel spreads connections, not calls, over the workers).
    grants = 0
    for i in range(8):
        channel = grpc.insecure_channel(
            server.address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        stub = pb_grpc.CoordinatorStub(channel)
        member = join_all(stub, JOB, f"w{i}", 1)[0].members[0]
        for seq in range(3):
            request = _reserve(seq, member)
            request.group = f"w{i}"
            assert not stub.Reserve(request, timeout=10).existing
            grants += 1
        channel.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("rngcoord_grants_total", ())] == grants
    assert server.terminate() == 0


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certificates(workdir: Path) -> dict[str, Path]:
    """A self-signed CA, a server certificate for localhost/127.0.0.1 and a client one."""
    if subprocess.run(["openssl", "version"], capture_output=True, check=False).returncode:
        pytest.skip("the openssl CLI is needed to make test certificates")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=rngcoord test CA", cwd=workdir)  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (workdir / f"{name}.ext").write_text(ext)
        _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=rngcoord test {name}", cwd=workdir)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=workdir)  # fmt: skip
    return {p.stem + p.suffix: p for p in workdir.iterdir()}


def _tls_call(server: CoordinatorProcess, credentials: grpc.ChannelCredentials) -> int:
    stub = pb_grpc.CoordinatorStub(server.channel(credentials))
    reply = stub.JoinGroup(
        pb.JoinGroupRequest(
            job=JOB,
            group="tls",
            rank=0,
            world_size=1,
            member_id="t0",
            member_secret=secret_for("t0"),
        ),
        timeout=10,
    )
    epoch: int = reply.epoch
    return epoch


def test_tls_and_mutual_tls(coordinator_factory: CoordinatorFactory, tmp_path: Path) -> None:
    certs = _make_certificates(tmp_path)
    ca = certs["ca.pem"].read_bytes()
    tls_args = ["--tls-cert", str(certs["server.pem"]), "--tls-key", str(certs["server.key"])]

    server = coordinator_factory(args=tls_args)
    assert _tls_call(server, grpc.ssl_channel_credentials(root_certificates=ca)) == 1
    with pytest.raises(grpc.RpcError) as plaintext:
        server.stub().GetGroup(pb.GetGroupRequest(job=JOB, group="tls"), timeout=5)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE

    mtls = coordinator_factory(args=[*tls_args, "--tls-client-ca", str(certs["ca.pem"])])
    with pytest.raises(grpc.RpcError) as anonymous:
        _tls_call(mtls, grpc.ssl_channel_credentials(root_certificates=ca))
    assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=certs["client.key"].read_bytes(),
        certificate_chain=certs["client.pem"].read_bytes(),
    )
    assert _tls_call(mtls, with_cert) == 1


@pytest.mark.slow
def test_sigterm_lets_in_flight_rpcs_finish_then_exits_0(
    coordinator: CoordinatorProcess,
) -> None:
    stub = coordinator.stub()
    outcome: dict[str, grpc.RpcError] = {}

    def join_that_times_out() -> None:
        # Rank 1 never comes: the barrier ends with the server's own DEADLINE_EXCEEDED.
        try:
            stub.JoinGroup(
                pb.JoinGroupRequest(
                    job=JOB,
                    group="drain",
                    rank=0,
                    world_size=2,
                    member_id="d0",
                    member_secret=secret_for("d0"),
                    timeout_ms=1500,
                ),
                timeout=30,
            )
        except grpc.RpcError as exc:
            outcome["error"] = exc

    in_flight = threading.Thread(target=join_that_times_out)
    in_flight.start()
    wait_for_group(stub, JOB, "drain")
    assert coordinator.terminate() == 0
    in_flight.join(timeout=30)
    error = outcome["error"]
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "[1]" in (error.details() or ""), error.details()

    events = [e["event"] for e in coordinator.log_events()]
    assert events[-2:] == ["draining", "stopped"]
    for line in coordinator.output().splitlines():
        assert set(json.loads(line)) >= {"ts", "level", "logger", "event", "fields"}, line


def test_every_log_line_is_json_even_from_psycopg_pool(
    coordinator_factory: CoordinatorFactory, postgres_url_factory: Any
) -> None:
    import psycopg

    url = postgres_url_factory()
    server = coordinator_factory(url)
    stub = server.stub()
    join_all(stub, JOB, "logs", 1)
    # Cut the server's connections: the readers' pool notices and logs about it.
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    deadline = time.monotonic() + 20
    while True:
        try:
            stub.GetGroup(pb.GetGroupRequest(job=JOB, group="logs"), timeout=10)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert server.terminate() == 0
    lines = server.output().splitlines()
    for line in lines:
        assert set(json.loads(line)) >= {"ts", "level", "logger", "event", "fields"}, line
    assert any(json.loads(line)["logger"].startswith("psycopg") for line in lines), lines


def test_an_answer_whose_caller_left_logs_no_traceback() -> None:
    """gRPC's aio server logs ExecuteBatchError with a traceback when a handler answers a
    caller that has gone; under a storm of cancelled calls that raced the CI log check. The
    line is dropped, and gRPC's other errors still log."""
    import io
    import logging

    from rngcoord.server import logs

    stream = io.StringIO()
    logs.configure(stream=stream)
    core = logging.getLogger("grpc._cython.cygrpc")
    try:
        raise RuntimeError("Failed execute_batch")
    except RuntimeError:
        core.exception(
            "ExecuteBatchError raised in core by servicer method [%s]",
            "/rngcoord.v1.Coordinator/Reserve",
        )
        core.exception("Unexpected [%s] raised by servicer method", "RuntimeError")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    logs.configure()
    assert [line["event"] for line in lines] == [
        "Unexpected [RuntimeError] raised by servicer method"
    ]
