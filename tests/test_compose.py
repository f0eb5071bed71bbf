"""The compose files resolve, under a real docker-compose, to the stack that
docs/containers.md documents.

docker-compose.yml holds the coordinators and the CPU trainer; docker-compose.gpu.yml adds the
GPU trainer (`-f docker-compose.yml -f docker-compose.gpu.yml`). CI installs Debian's
docker-compose 1.29 (.ci/run); `docker-compose config` validates the files against the Compose
schema and interpolates the environment without needing a Docker engine. Each test resolves
the files under a controlled environment and checks one documented promise: services and
profiles, the grpc health probe, host networking on loopback, GPU reservations, start order,
restarts, and addresses, ports and tokens taken from environment variables.
scripts/compose_e2e.sh runs the same files on a real engine.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from test_server_image import COORDINATOR_DOCKERFILE, dockerfile_instructions

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BASE_FILES = (ROOT / "docker-compose.yml",)
GPU_FILES = (*BASE_FILES, ROOT / "docker-compose.gpu.yml")
PROFILES = ((), ("cpu",), ("postgres",), ("cpu", "postgres"))
HEALTHY = {"condition": "service_healthy"}


class Compose:
    """docker-compose on the repository's files, seeing exactly the user variables it is given.

    A clean environment and an empty --env-file keep the developer's shell and any .env file
    from changing what the file resolves to.

    Args:
        binary: the docker-compose 1.x executable.
        python: the interpreter that runs it, whose PyYAML parses its output.
        empty_env_file: an empty file for --env-file.
    """

    def __init__(self, binary: str, python: list[str], empty_env_file: Path) -> None:
        self.binary = binary
        self.python = python
        self.empty_env_file = empty_env_file
        self._resolved: dict[tuple[object, ...], dict[str, Any]] = {}

    def run(
        self,
        *args: str,
        files: tuple[Path, ...] = BASE_FILES,
        profiles: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = [self.binary]
        for file in files:
            argv += ["--file", str(file)]
        argv += ["--project-directory", str(ROOT), "--env-file", str(self.empty_env_file)]
        for profile in profiles:
            argv += ["--profile", profile]
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
        return _run([*argv, *args], env={**base, **(env or {})})

    def resolved(self, files: tuple[Path, ...] = BASE_FILES, **env: str) -> dict[str, Any]:
        """The fully resolved files (every profile's services) as plain Python values."""
        key = (files, *sorted(env.items()))
        if key not in self._resolved:
            text = self.run("config", files=files, profiles=("cpu", "postgres"), env=env).stdout
            to_json = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
            self._resolved[key] = json.loads(_run([*self.python, "-c", to_json], stdin=text).stdout)
        return self._resolved[key]

    def services(self, files: tuple[Path, ...] = BASE_FILES, **env: str) -> dict[str, Any]:
        services: dict[str, Any] = self.resolved(files, **env)["services"]
        return services


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Compose:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip(
            "docker-compose is not installed; CI installs it (apt-get install docker-compose)"
        )
    version = _run([binary, "version", "--short"]).stdout.strip()
    if not version.startswith("1."):
        pytest.skip(
            f"these checks read docker-compose 1.x output as CI installs it; found {version}"
        )
    # docker-compose 1.x prints YAML only, and PyYAML is no dependency of this project; but
    # docker-compose 1.x is a Python program that requires PyYAML, so its interpreter parses.
    shebang = Path(binary).read_bytes().split(b"\n", 1)[0].decode(errors="replace")
    if not shebang.startswith("#!"):
        pytest.skip(f"{binary} is not a Python script, so no PyYAML comes with it")
    empty_env_file = tmp_path_factory.mktemp("compose") / "empty.env"
    empty_env_file.touch()
    return Compose(binary, shlex.split(shebang[2:]), empty_env_file)


def _run(
    argv: list[str], *, env: Mapping[str, str] | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv, input=stdin, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"{shlex.join(argv)} failed:\n{result.stdout}{result.stderr}"
    return result


def _image_healthcheck() -> list[str]:
    for keyword, rest in dockerfile_instructions(COORDINATOR_DOCKERFILE):
        if keyword == "HEALTHCHECK":
            command: list[str] = json.loads(rest[rest.index("CMD ") + len("CMD ") :])
            return ["CMD", *command]
    raise AssertionError("Dockerfile.coordinator has no HEALTHCHECK")


def _torchrun(service: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Split a trainer's command into torchrun's own arguments and the script's (from the .py)."""
    argv = shlex.split(service["command"])
    assert argv[0] == "torchrun", argv
    script = next(i for i, arg in enumerate(argv) if arg.endswith(".py"))
    return argv[1:script], argv[script:]


def _flag(args: list[str], name: str) -> str:
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{name}=")]
    assert len(values) == 1, f"expected one {name}=... in {args}"
    return values[0]


LAYOUTS = {"base": BASE_FILES, "gpu": GPU_FILES}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("profiles", PROFILES, ids=lambda p: "+".join(p) or "default")
def test_files_validate_without_warnings(
    compose: Compose, layout: str, profiles: tuple[str, ...]
) -> None:
    result = compose.run("config", "--quiet", files=LAYOUTS[layout], profiles=profiles)
    # docker-compose warns on stderr about a variable used without a default, which would
    # silently resolve to "" for a user who did not set it.
    assert result.stderr == ""


def test_services_and_profiles(compose: Compose) -> None:
    services = compose.services()
    profiles = {name: service.get("profiles", []) for name, service in services.items()}
    assert profiles == {
        "coordinator": [],
        "trainer-cpu": ["cpu"],
        "postgres": ["postgres"],
        "coordinator-pg": ["postgres"],
    }
    # The GPU file adds its trainer, outside any profile: `-f ... -f ...gpu.yml up` starts it.
    gpu = compose.services(GPU_FILES)
    assert set(gpu) == {*services, "trainer"}
    assert "profiles" not in gpu["trainer"]
    for name in ("coordinator", "coordinator-pg"):
        assert services[name]["build"]["dockerfile"] == "Dockerfile.coordinator"
    assert services["trainer-cpu"]["build"]["dockerfile"] == "Dockerfile.trainer"
    assert gpu["trainer"]["build"]["dockerfile"] == "Dockerfile.trainer"
    # One image per Dockerfile, shared by the services built from it.
    assert services["coordinator"]["image"] == services["coordinator-pg"]["image"]
    assert gpu["trainer"]["image"] == services["trainer-cpu"]["image"]


def test_only_the_gpu_file_reserves_devices(compose: Compose) -> None:
    # docker-compose 1.29's `up` rejects an interpolated device count, so the base file, which
    # 1.29 runs (scripts/compose_e2e.sh), must hold none.
    assert all("deploy" not in service for service in compose.services().values())
    gpu = compose.services(GPU_FILES)
    assert [name for name, service in gpu.items() if "deploy" in service] == ["trainer"]


def test_coordinators_use_the_images_grpc_health_probe(compose: Compose) -> None:
    probe = _image_healthcheck()
    assert "grpc_health.v1" in probe[-1] and "SERVING" in probe[-1]
    for name in ("coordinator", "coordinator-pg"):
        assert compose.services()[name]["healthcheck"]["test"] == probe, name


def test_coordinators_create_their_store_and_audit_key_on_first_start(compose: Compose) -> None:
    services = compose.services()
    for name in ("coordinator", "coordinator-pg"):
        env = services[name]["environment"]
        assert env["RNGCOORD_INIT"] == "1", name
        # The key lives in the coordinator's named volume, so it outlives the container as the
        # audit chain it signs does, and `rngcoord verify` in the container finds it.
        key_dir = str(Path(env["RNGCOORD_AUDIT_KEY"]).parent)
        assert f"{name}-data:{key_dir}:rw" in services[name]["volumes"], name


def test_sqlite_coordinator_keeps_its_database_on_a_named_volume(compose: Compose) -> None:
    coordinator = compose.services()["coordinator"]
    db_url = coordinator["environment"]["RNGCOORD_DB"]
    assert db_url.startswith("sqlite:////")
    db_dir = str(Path(db_url.removeprefix("sqlite:///")).parent)
    sources = [
        spec.split(":")[0] for spec in coordinator["volumes"] if spec.split(":")[1] == db_dir
    ]
    assert len(sources) == 1, f"no volume holds {db_dir}: {coordinator['volumes']}"
    assert sources[0] in compose.resolved()["volumes"], (
        f"{sources[0]} is a bind mount, not a named volume"
    )


def test_every_service_runs_on_the_host_network(compose: Compose) -> None:
    for name, service in compose.services(GPU_FILES).items():
        assert service["network_mode"] == "host", name
        # Published ports mean nothing on the host network; the listen addresses decide.
        assert "ports" not in service, name


def test_listen_addresses_are_loopback_ports_from_the_environment(compose: Compose) -> None:
    def listening(services: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
        found = {
            name: (
                services[name]["environment"]["RNGCOORD_LISTEN"],
                services[name]["environment"]["RNGCOORD_METRICS"],
                "",
            )
            for name in ("coordinator", "coordinator-pg")
        }
        postgres = services["postgres"]
        found["postgres"] = (postgres["command"][-1], "", postgres["environment"]["PGPORT"])
        return found

    assert listening(compose.services()) == {
        "coordinator": ("127.0.0.1:29520", "127.0.0.1:9464", ""),
        "coordinator-pg": ("127.0.0.1:29521", "127.0.0.1:9465", ""),
        # Not 5432: on the host network that is the port of a PostgreSQL the host may run.
        "postgres": ("listen_addresses=127.0.0.1", "", "55432"),
    }
    moved = compose.services(
        LISTEN_ADDR="0.0.0.0",
        COORDINATOR_PORT="31000",
        METRICS_PORT="31001",
        COORDINATOR_PG_PORT="31002",
        METRICS_PG_PORT="31003",
        POSTGRES_PORT="31004",
    )
    assert listening(moved) == {
        "coordinator": ("0.0.0.0:31000", "0.0.0.0:31001", ""),
        "coordinator-pg": ("0.0.0.0:31002", "0.0.0.0:31003", ""),
        "postgres": ("listen_addresses=0.0.0.0", "", "31004"),
    }
    # Whatever the listen address, the clients of a service dial it on loopback.
    db_url = moved["coordinator-pg"]["environment"]["RNGCOORD_DB"]
    assert db_url == "postgresql://rngcoord:rngcoord@127.0.0.1:31004/rngcoord"


@pytest.mark.parametrize("gpus", [None, "4"])
def test_gpu_trainer_reserves_one_gpu_per_rank(compose: Compose, gpus: str | None) -> None:
    env = {} if gpus is None else {"GPUS": gpus}
    trainer = compose.services(GPU_FILES, **env)["trainer"]
    expected = gpus or "2"
    launcher, script = _torchrun(trainer)
    assert _flag(launcher, "--nproc-per-node") == expected
    assert script[0] == "examples/train_tp.py"
    devices = trainer["deploy"]["resources"]["reservations"]["devices"]
    # docker-compose 1.x prints an interpolated count as a string; Compose v2 reads it as a number.
    assert devices == [{"driver": "nvidia", "count": expected, "capabilities": ["gpu"]}]


def test_trainers_start_once_the_coordinator_is_healthy(compose: Compose) -> None:
    services = compose.services(GPU_FILES)
    assert "healthcheck" in services["coordinator"]
    for name in ("trainer", "trainer-cpu"):
        assert services[name]["depends_on"] == {"coordinator": HEALTHY}, name
    assert "healthcheck" in services["postgres"]
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"]
    assert services["coordinator-pg"]["depends_on"] == {"postgres": HEALTHY}


def test_trainers_come_back_after_a_crash(compose: Compose) -> None:
    services = compose.services(GPU_FILES, MAX_RESTARTS="5")
    for name in ("trainer", "trainer-cpu"):
        # torchrun restarts the ranks after one fails; Docker restarts a container that died
        # (not one that finished, nor one stopped by hand). Both make the ranks join anew.
        assert services[name]["restart"] == "on-failure", name
        launcher, _ = _torchrun(services[name])
        assert _flag(launcher, "--max-restarts") == "5", name
        # tini as PID 1: SIGKILL to it takes the whole container down, as a crash would.
        assert services[name]["init"] is True, name


def test_cpu_profile_runs_the_same_job_without_gpus(compose: Compose) -> None:
    assert _flag(_torchrun(compose.services()["trainer-cpu"])[0], "--nproc-per-node") == "4"
    services = compose.services(GPU_FILES, CPU_RANKS="3")
    trainer, cpu = services["trainer"], services["trainer-cpu"]
    # An empty CUDA_VISIBLE_DEVICES hides every GPU from torch, so the job takes gloo.
    assert cpu["environment"]["CUDA_VISIBLE_DEVICES"] == ""
    cpu_launcher, cpu_script = _torchrun(cpu)
    gpu_launcher, gpu_script = _torchrun(trainer)
    assert _flag(cpu_launcher, "--nproc-per-node") == "3"
    assert [a for a in cpu_launcher if not a.startswith("--nproc-per-node")] == [
        a for a in gpu_launcher if not a.startswith("--nproc-per-node")
    ]
    # Same script and arguments but the device and the default job (so its checkpoints).
    assert cpu_script[0] == gpu_script[0] == "examples/train_tp.py"
    assert (_flag(cpu_script, "--device"), _flag(gpu_script, "--device")) == ("cpu", "cuda")
    assert _flag(cpu_script, "--steps") == _flag(gpu_script, "--steps")
    assert _flag(cpu_script, "--checkpoint-dir") == "/checkpoints/tp-cpu"
    assert _flag(gpu_script, "--checkpoint-dir") == "/checkpoints/tp-gpu"
    for service in (trainer, cpu):
        assert "checkpoints:/checkpoints:rw" in service["volumes"]
        # The ranks' own traffic stays on loopback, like everything else on the host network.
        assert service["environment"]["GLOO_SOCKET_IFNAME"] == "lo"


def test_trainer_defaults_reach_the_sqlite_coordinator_without_a_token(compose: Compose) -> None:
    services = compose.services(GPU_FILES)
    for name, job, launch in (
        ("trainer", "tp-gpu", "trainer-gpu@{host}"),
        ("trainer-cpu", "tp-cpu", "trainer-cpu@{host}"),
    ):
        env = services[name]["environment"]
        assert env["RNGCOORD_ADDR"] == "127.0.0.1:29520"
        assert env["RNGCOORD_JOB"] == job
        # Keys without a value: the host's variable if set there, otherwise left unset.
        assert env["RNGCOORD_TOKEN"] is None
        assert env["RNGCOORD_SEED"] is None
        # One launch across container restarts, one per host (launch_id fills in {host}).
        assert env["RNGCOORD_LAUNCH"] == launch


def test_trainer_settings_and_arguments_come_from_the_environment(
    compose: Compose,
) -> None:
    services = compose.services(
        GPU_FILES,
        RNGCOORD_ADDR="127.0.0.1:29521",
        RNGCOORD_JOB="run-7",
        RNGCOORD_TOKEN="s3cret",
        RNGCOORD_SEED="42",
        TRAIN_STEPS="7",
        TRAIN_ARGS="--resume",
    )
    for name in ("trainer", "trainer-cpu"):
        env = services[name]["environment"]
        settings = ("RNGCOORD_ADDR", "RNGCOORD_JOB", "RNGCOORD_TOKEN", "RNGCOORD_SEED")
        assert [env[key] for key in settings] == ["127.0.0.1:29521", "run-7", "s3cret", "42"]
        _, script = _torchrun(services[name])
        assert _flag(script, "--steps") == "7"
        assert _flag(script, "--checkpoint-dir") == "/checkpoints/run-7"
        assert script[-1] == "--resume"


def test_postgres_profile_runs_the_coordinator_on_postgres(compose: Compose) -> None:
    services = compose.services(POSTGRES_PASSWORD="pg-pass", POSTGRES_IMAGE="local/pg:17")
    postgres = services["postgres"]
    assert postgres["image"] == "local/pg:17"
    assert compose.services()["postgres"]["image"] == "postgres:17"
    assert postgres["environment"]["POSTGRES_PASSWORD"] == "pg-pass"
    db_url = services["coordinator-pg"]["environment"]["RNGCOORD_DB"]
    assert db_url == "postgresql://rngcoord:pg-pass@127.0.0.1:55432/rngcoord"
    # The records are in PostgreSQL; the coordinator's volume holds its audit key only.
    assert services["coordinator-pg"]["volumes"] == ["coordinator-pg-data:/data:rw"]


def test_dockerfiles_default_to_public_bases_and_no_sandbox_inputs() -> None:
    """What a user builds is what the recipes say by default; a sandbox's inputs are opt-in."""
    coordinator = COORDINATOR_DOCKERFILE.read_text()
    trainer = (ROOT / "Dockerfile.trainer").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim\n" in coordinator
    assert "ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime\n" in trainer
    # Extra wheels come from a stage that is empty unless WHEELS_IMAGE names another image.
    assert "ARG WHEELS_IMAGE=scratch\n" in trainer
    assert "FROM ${WHEELS_IMAGE} AS wheels\n" in trainer
    for text in (coordinator, trainer):
        # A CA bundle only ever arrives as a BuildKit secret, for the install step alone.
        assert "\nARG PIP_CERT\n" in text
        assert "--mount=type=secret,id=pip_cert" in text
        for sandbox_path in ("/opt/wheels", "/etc/ssl/certs/ca-certificates.crt", "bookworm"):
            assert sandbox_path not in text, sandbox_path
