"""The `rngcoord serve --workers N` supervisor (rngcoord.server.workers), as real processes on
a real port: the port never stays dead over a broken token file, a SIGHUP at any moment is a
reload, and no worker outlives its supervisor."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from harness import CoordinatorFactory, CoordinatorProcess, secret_for, wait_for_group
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc as pb_grpc

JOB = "job-1"
GOOD = "good-token-5c1f0e7a9b"
NEWER = "newer-token-71d2ab44c3"
BROKEN = "broken-token-e09a6f13d8"
TOKEN_TEXT = ("token-5c1f", "token-71d2", "token-e09a")
"""Pieces of every token the tests write: none may reach a log line."""


def _until(what: str, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g}s"
        time.sleep(0.05)


def _events(server: CoordinatorProcess, name: str) -> list[dict[str, object]]:
    return [e for e in server.log_events() if e.get("event") == name]


def _join(server: CoordinatorProcess, token: str) -> grpc.StatusCode:
    """A one-rank JoinGroup with `token` on a connection of its own (the kernel hands each
    connection to one worker); OK or the refusal's code."""
    channel = grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        pb_grpc.CoordinatorStub(channel).JoinGroup(
            pb.JoinGroupRequest(
                job=JOB,
                group=f"g-{uuid.uuid4().hex[:8]}",
                rank=0,
                world_size=1,
                member_id="m0",
                member_secret=secret_for("m0"),
            ),
            metadata=(("authorization", f"Bearer {token}"),),
            timeout=10,
        )
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    finally:
        channel.close()
    return grpc.StatusCode.OK


def _worker_pids(server: CoordinatorProcess) -> set[int]:
    """The pids of the workers that logged that they serve, since the start."""
    return {int(e["fields"]["pid"]) for e in _events(server, "serving")}  # type: ignore[index]


def _children(pid: int) -> set[int]:
    """The live child processes of `pid` (the workers and multiprocessing's resource
    tracker)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return set()
    return {int(p) for p in text.split()}


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _supervised(factory: CoordinatorFactory, tokens: Path, workers: int = 2) -> CoordinatorProcess:
    return factory(args=["--workers", str(workers), "--tokens", str(tokens)])


@pytest.mark.slow
def test_a_restarted_worker_serves_the_last_good_tokens_while_the_file_is_broken(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"ops admin * {GOOD}\n")
    server = _supervised(coordinator_factory, tokens)
    assert server.popen is not None
    assert _join(server, GOOD) == grpc.StatusCode.OK

    tokens.write_text(f"ops wizard * {BROKEN}\n")
    server.popen.send_signal(signal.SIGHUP)
    _until("the failed reload is logged", lambda: bool(_events(server, "tokens_reload_failed")))

    # Every worker dies, so every call below reaches one started after the file broke.
    pids = _worker_pids(server)
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _until("both workers serve again", lambda: len(_worker_pids(server) - pids) == 2)
    for _ in range(6):
        assert _join(server, GOOD) == grpc.StatusCode.OK
        assert _join(server, BROKEN) == grpc.StatusCode.UNAUTHENTICATED
    (failed,) = _events(server, "tokens_reload_failed")
    assert failed["logger"] == "rngcoord.workers"
    assert f"{tokens}:1: field 2 (ROLE) is not one of" in str(failed["fields"])
    assert "wizard" not in str(failed["fields"])

    # A good file again: the running workers take it over their pipes.
    tokens.write_text(f"ops admin * {NEWER}\n")
    server.popen.send_signal(signal.SIGHUP)
    # One line from the supervisor, one from each worker as it takes the table.
    _until(
        "every worker serves the new table", lambda: len(_events(server, "tokens_reloaded")) == 3
    )
    for _ in range(6):
        assert _join(server, NEWER) == grpc.StatusCode.OK
        assert _join(server, GOOD) == grpc.StatusCode.UNAUTHENTICATED
    output = server.output()
    assert not [piece for piece in TOKEN_TEXT if piece in output], "a token reached the log"
    assert server.terminate() == 0


def _supervising(pid: int) -> bool:
    """Whether `pid`, a `rngcoord serve --workers N`, runs the supervisor's code: it catches
    SIGHUP (its SigCgt mask, /proc/PID/status) or has started a worker."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    (caught,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(caught, 16) & (1 << (signal.SIGHUP - 1))) or bool(_children(pid))


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.1, 0.4, 0.8, 1.2, 2.0])
def test_a_sighup_during_start_up_is_applied_once_every_worker_serves(
    tmp_path: Path, delay_s: float
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"ops admin * {GOOD}\n")
    server = CoordinatorProcess(
        f"sqlite:///{tmp_path / 'coordinator.db'}",
        tmp_path / "coordinator",
        args=["--workers", "2", "--tokens", str(tokens)],
    )
    problems: list[BaseException] = []

    def hang_up() -> None:
        # The delay counts from the supervisor's first moment. Before it, the interpreter is
        # still importing `rngcoord serve`, no worker exists, and SIGHUP's default action ends
        # the process: a limit of the command line (rngcoord.server.cli), not the supervisor.
        try:
            _until("the server starts", lambda: server.popen is not None)
            assert server.popen is not None
            pid = server.popen.pid
            _until("the supervisor runs", lambda: _supervising(pid))
            time.sleep(delay_s)
            server.popen.send_signal(signal.SIGHUP)
        except BaseException as exc:  # re-raised by the test below
            problems.append(exc)

    sender = threading.Thread(target=hang_up)
    sender.start()
    try:
        server.start()
        sender.join()
        assert not problems, problems
        assert server.popen is not None
        supervisor = server.popen.pid
        workers = _children(supervisor)
        assert len(_worker_pids(server) & workers) == 2
        # Start-up done first, then the reload: the supervisor's line, and each worker's.
        _until("the reload is applied", lambda: len(_events(server, "tokens_reloaded")) == 3)
        names = [e.get("event") for e in server.log_events()]
        assert names.index("workers_serving") < names.index("tokens_reloaded")
        assert _join(server, GOOD) == grpc.StatusCode.OK
        assert server.terminate() == 0
        _until("no worker outlives the supervisor", lambda: not any(map(_alive, workers)), 10)
    finally:
        sender.join()
        server.close()


@pytest.mark.slow
def test_workers_stop_serving_when_the_supervisor_is_killed(
    coordinator_factory: CoordinatorFactory,
) -> None:
    server = coordinator_factory(args=["--workers", "2"])
    assert server.popen is not None
    workers = _children(server.popen.pid)
    assert len(_worker_pids(server) & workers) == 2
    # Joins that wait for a second rank are in flight in both workers (connections are spread
    # over them), so a worker that merely drained would wait out the grace period (10 s).
    groups = [f"wait-{i}" for i in range(8)]
    channels = [
        grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in groups
    ]

    def join(i: int) -> grpc.StatusCode:
        try:
            pb_grpc.CoordinatorStub(channels[i]).JoinGroup(
                pb.JoinGroupRequest(
                    job=JOB,
                    group=groups[i],
                    rank=0,
                    world_size=2,
                    member_id="m0",
                    member_secret=secret_for("m0"),
                    timeout_ms=60_000,
                ),
                timeout=70,
            )
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(len(groups)) as pool:
        calls = [pool.submit(join, i) for i in range(len(groups))]
        stub = server.stub()
        for group in groups:
            wait_for_group(stub, JOB, group)
        server.kill()
        killed = time.monotonic()
        _until("every worker exits", lambda: not any(map(_alive, workers)), 5)
        _until("the port is closed", lambda: not _port_open(server.port), 5)
        assert time.monotonic() - killed < 5
        assert all(call.result(timeout=30) != grpc.StatusCode.OK for call in calls)
    for channel in channels:
        channel.close()


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.3, 0.7])
def test_a_sigterm_during_start_up_stops_every_worker_started(
    tmp_path: Path, delay_s: float
) -> None:
    server = CoordinatorProcess(
        f"sqlite:///{tmp_path / 'coordinator.db'}",
        tmp_path / "coordinator",
        args=["--workers", "2"],
    )
    seen: set[int] = set()
    problems: list[BaseException] = []

    def terminate() -> None:
        try:
            _until("the server starts", lambda: server.popen is not None)
            assert server.popen is not None
            pid = server.popen.pid
            _until("the supervisor runs", lambda: _supervising(pid))
            due = time.monotonic() + delay_s
            while time.monotonic() < due:
                seen.update(_children(pid))
                time.sleep(0.01)
            server.popen.send_signal(signal.SIGTERM)
            # A worker it was starting as the signal came is its child too, for a moment.
            while server.popen.poll() is None:
                seen.update(_children(pid))
                time.sleep(0.01)
        except BaseException as exc:  # re-raised by the test below
            problems.append(exc)

    sender = threading.Thread(target=terminate)
    sender.start()
    try:
        # It may have served just before the signal: either way it stops, and says so.
        with contextlib.suppress(RuntimeError):
            server.start()
        sender.join()
        assert not problems, problems
        assert server.popen is not None and server.popen.wait(30) == 0, server.output()
        assert [e for e in server.log_events() if e.get("event") == "stopped"]
        _until("no worker outlives the supervisor", lambda: not any(map(_alive, seen)), 10)
    finally:
        sender.join()
        server.close()
