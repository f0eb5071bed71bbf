"""The coordinator image's environment serves, and answers grpc health, without torch.

Building the image needs a Docker engine, which CI cannot always start (scripts/compose_e2e.sh
builds and runs the real image where it can). What a test can always reach is the Python
environment inside it, so this module installs it the way Dockerfile.coordinator does:
the build stage's COPY set into a fresh source tree, and the build stage's own venv and
`pip install` commands (the `server` extra only) into a fresh venv. `rngcoord serve` from that
venv must start, pass the image's HEALTHCHECK command and answer grpc health SERVING, while
`import torch` fails. The Dockerfile's other promises (non-root user, volume, ports, entry
point, environment defaults) are read from the file itself.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
COORDINATOR_DOCKERFILE = ROOT / "Dockerfile.coordinator"
INSTALL_TIMEOUT_S = 240
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 30


def dockerfile_instructions(path: Path) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    logical = re.sub(r"\\\n", " ", path.read_text())
    for line in logical.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            yield keyword.upper(), rest.strip()


@dataclass(frozen=True)
class Stage:
    """One stage of a Dockerfile: its FROM arguments and its instructions in order."""

    base: str
    instructions: tuple[tuple[str, str], ...]

    def all(self, keyword: str) -> list[str]:
        return [rest for key, rest in self.instructions if key == keyword]

    def one(self, keyword: str) -> str:
        found = self.all(keyword)
        assert len(found) == 1, f"expected one {keyword} in the stage FROM {self.base}: {found}"
        return found[0]

    def env(self) -> dict[str, str]:
        pairs = (item.partition("=") for rest in self.all("ENV") for item in shlex.split(rest))
        return {key: value for key, _, value in pairs}


def coordinator_stages() -> tuple[Stage, Stage]:
    """The (build, runtime) stages of Dockerfile.coordinator."""
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for keyword, rest in dockerfile_instructions(COORDINATOR_DOCKERFILE):
        if keyword == "FROM":
            stages.append((rest, []))
        elif stages:
            stages[-1][1].append((keyword, rest))
    assert len(stages) == 2, f"expected a build and a runtime stage, got {len(stages)}"
    build, runtime = (Stage(base, tuple(instructions)) for base, instructions in stages)
    return build, runtime


def _copy_build_context(build: Stage, src: Path) -> None:
    """Lay out the build stage's source tree as its COPY instructions do (from the repo root)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.py[cod]")  # as .dockerignore does
    for rest in build.all("COPY"):
        *sources, dest = shlex.split(rest)
        target = src / dest
        for source in sources:
            origin = ROOT / source
            assert origin.exists(), f"Dockerfile.coordinator copies {source}, which is missing"
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=ignore, dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target / origin.name)


def _run_command(run: str) -> list[str]:
    """A RUN instruction's command, without its BuildKit `--mount=` options."""
    argv = shlex.split(run)
    while argv and argv[0].startswith("--mount="):
        argv.pop(0)
    return argv


def _run(
    argv: list[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the caller's RNGCOORD_* settings or venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNGCOORD_")}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return {**env, **extra}


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding exactly what Dockerfile.coordinator's build stage installs."""
    build, _ = coordinator_stages()
    workdir = tmp_path_factory.mktemp("coordinator-image")
    src, venv = workdir / "src", workdir / "venv"
    _copy_build_context(build, src)
    venv_commands = [rest for rest in build.all("RUN") if " -m venv " in rest]
    assert len(venv_commands) == 1, f"expected one `python -m venv` RUN: {venv_commands}"
    image_venv_path = shlex.split(venv_commands[0])[-1]
    installs = [rest for rest in build.all("RUN") if " pip install " in rest]
    assert len(installs) == 1, f"expected one `pip install` RUN: {installs}"
    install = _run_command(installs[0].replace(image_venv_path, str(venv)))

    created = _run([sys.executable, "-m", "venv", str(venv)])
    assert created.returncode == 0, created.stderr
    # The image's build ENV applies, except PIP_NO_CACHE_DIR: pip's cache keeps this test fast
    # and changes only where the same wheels come from, not what is installed.
    pip_env = {k: v for k, v in build.env().items() if k != "PIP_NO_CACHE_DIR"}
    installed = _run(install, cwd=src, env=_clean_env(**pip_env))
    assert installed.returncode == 0, (
        f"{shlex.join(install)}:\n{installed.stdout}{installed.stderr}"
    )
    return venv


def test_dockerfile_builds_a_slim_non_root_serve_image() -> None:
    build, runtime = coordinator_stages()
    assert build.base == "${BASE_IMAGE} AS build" and runtime.base == "${BASE_IMAGE}"
    assert "ARG BASE_IMAGE=python:3.11-slim" in COORDINATOR_DOCKERFILE.read_text()
    (pip_install,) = (rest for rest in build.all("RUN") if " pip install " in rest)
    requirements = [arg for arg in _run_command(pip_install) if arg.startswith(".")]
    assert requirements == [".[server]"], "the image installs the server extra only"
    # A CA bundle for pip comes only as a build secret, never as a file in a layer.
    assert build.one("ARG") == "PIP_CERT"
    assert "--mount=type=secret,id=pip_cert" in pip_install
    # The runtime stage refuses to finish with torch in it.
    assert any('find_spec("torch")' in run for run in runtime.all("RUN"))

    user = runtime.one("USER").split(":")[0]
    assert user not in ("root", "0"), "the coordinator must not run as root"
    assert json.loads(runtime.one("ENTRYPOINT")) == ["rngcoord", "serve"]
    assert runtime.one("EXPOSE").split() == ["29520", "9464"]
    volumes = json.loads(runtime.one("VOLUME"))
    env = runtime.env()
    assert env["RNGCOORD_LISTEN"] == "0.0.0.0:29520"
    assert env["RNGCOORD_DB"] == "sqlite:////data/rngcoord.db"
    assert volumes == ["/data"]
    assert env["RNGCOORD_DB"].removeprefix("sqlite:///").startswith(volumes[0] + "/")


def test_server_extra_installs_no_torch(image_venv: Path) -> None:
    python = str(image_venv / "bin" / "python")
    result = _run([python, "-c", "import torch"], env=_clean_env())
    assert result.returncode != 0
    assert "No module named 'torch'" in result.stderr
    imported = _run(
        [python, "-c", "import rngcoord.server.app, grpc_health, psycopg"], env=_clean_env()
    )
    assert imported.returncode == 0, imported.stderr


def test_demo_says_it_needs_the_client_extra(image_venv: Path) -> None:
    result = _run([str(image_venv / "bin" / "rngcoord"), "demo"], env=_clean_env())
    assert result.returncode == 2
    assert "needs the client extra" in result.stderr
    assert "pip install 'rngcoord[client]'" in result.stderr


def test_serve_answers_grpc_health_without_torch(image_venv: Path, tmp_path: Path) -> None:
    _, runtime = coordinator_stages()
    ready = tmp_path / "ready"
    serve = [
        str(image_venv / "bin" / "rngcoord"),
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--db",
        f"sqlite:///{tmp_path / 'rngcoord.db'}",
        "--metrics",
        "off",
        "--ready-file",
        str(ready),
        "--init",
    ]
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(serve, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists() or not ready.read_text().strip():
            assert server.poll() is None, (
                f"serve exited {server.returncode}:\n{log_path.read_text()}"
            )
            assert time.monotonic() < deadline, f"serve not ready:\n{log_path.read_text()}"
            time.sleep(0.05)
        address = ready.read_text().strip()

        # The image's HEALTHCHECK command, run as the image runs it: its venv first on PATH and
        # RNGCOORD_LISTEN naming the port (its host part is the in-container bind address).
        probe = json.loads(runtime.one("HEALTHCHECK").split(" CMD ", 1)[1])
        probe_env = _clean_env(
            PATH=f"{image_venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            RNGCOORD_LISTEN=f"0.0.0.0:{address.rpartition(':')[2]}",
        )
        healthy = _run(probe, env=probe_env)
        assert healthy.returncode == 0, f"healthcheck failed:\n{healthy.stderr}"

        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "rngcoord.v1.Coordinator"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, service

        # `docker stop` sends SIGTERM to the entry point; it must drain and exit cleanly.
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=STOP_TIMEOUT_S) == 0, log_path.read_text()
        # The probe is no formality: with the server gone it reports unhealthy.
        assert _run(probe, env=probe_env).returncode != 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
