"""docker-compose.yml resolves, under a real docker-compose, to the stack that README documents.

CI installs Debian's docker-compose 1.29 (.ci/run); `docker-compose config` validates the file
against the Compose schema and interpolates the environment without needing a Docker engine.
Each test resolves the file under a controlled environment and checks one documented promise:
services and profiles, the grpc health probe, GPU reservations, start order, and addresses,
ports and tokens taken from environment variables.
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
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROFILES = ((), ("cpu",), ("postgres",), ("cpu", "postgres"))
HEALTHY = {"condition": "service_healthy"}


class Compose:
    """docker-compose on the repository's file, seeing exactly the user variables it is given.

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
        self._resolved: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}

    def run(
        self, *args: str, profiles: tuple[str, ...] = (), env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        argv = [self.binary, "--file", str(COMPOSE_FILE), "--project-directory", str(ROOT)]
        argv += ["--env-file", str(self.empty_env_file)]
        for profile in profiles:
            argv += ["--profile", profile]
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
        return _run([*argv, *args], env={**base, **(env or {})})

    def resolved(self, **env: str) -> dict[str, Any]:
        """The fully resolved file (every profile's services) as plain Python values."""
        key = tuple(sorted(env.items()))
        if key not in self._resolved:
            text = self.run("config", profiles=("cpu", "postgres"), env=env).stdout
            to_json = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
            self._resolved[key] = json.loads(_run([*self.python, "-c", to_json], stdin=text).stdout)
        return self._resolved[key]

    def services(self, **env: str) -> dict[str, Any]:
        services: dict[str, Any] = self.resolved(**env)["services"]
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


def _image_ports() -> set[int]:
    return {
        int(port)
        for keyword, rest in dockerfile_instructions(COORDINATOR_DOCKERFILE)
        if keyword == "EXPOSE"
        for port in rest.split()
    }


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


@pytest.mark.parametrize("profiles", PROFILES, ids=lambda p: "+".join(p) or "default")
def test_file_validates_without_warnings(compose: Compose, profiles: tuple[str, ...]) -> None:
    result = compose.run("config", "--quiet", profiles=profiles)
    # docker-compose warns on stderr about a variable used without a default, which would
    # silently resolve to "" for a user who did not set it.
    assert result.stderr == ""


def test_services_and_profiles(compose: Compose) -> None:
    services = compose.services()
    profiles = {name: service.get("profiles", []) for name, service in services.items()}
    assert profiles == {
        "coordinator": [],
        "trainer": [],
        "trainer-cpu": ["cpu"],
        "postgres": ["postgres"],
        "coordinator-pg": ["postgres"],
    }
    for name in ("coordinator", "coordinator-pg"):
        assert services[name]["build"]["dockerfile"] == "Dockerfile.coordinator"
    for name in ("trainer", "trainer-cpu"):
        assert services[name]["build"]["dockerfile"] == "Dockerfile.trainer"
    # One image per Dockerfile, shared by the services built from it.
    assert services["coordinator"]["image"] == services["coordinator-pg"]["image"]
    assert services["trainer"]["image"] == services["trainer-cpu"]["image"]


def test_coordinators_use_the_images_grpc_health_probe(compose: Compose) -> None:
    probe = _image_healthcheck()
    assert "grpc_health.v1" in probe[-1] and "SERVING" in probe[-1]
    for name in ("coordinator", "coordinator-pg"):
        assert compose.services()[name]["healthcheck"]["test"] == probe, name


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


def test_coordinator_ports_come_from_the_environment(compose: Compose) -> None:
    image_ports = _image_ports()
    assert image_ports == {29520, 9464}
    assert compose.services()["coordinator"]["ports"] == [
        "127.0.0.1:29520:29520/tcp",
        "127.0.0.1:9464:9464/tcp",
    ]
    assert compose.services()["coordinator-pg"]["ports"] == [
        "127.0.0.1:29521:29520/tcp",
        "127.0.0.1:9465:9464/tcp",
    ]
    moved = compose.services(
        PUBLISH_ADDR="0.0.0.0",
        COORDINATOR_PORT="31000",
        METRICS_PORT="31001",
        COORDINATOR_PG_PORT="31002",
        METRICS_PG_PORT="31003",
    )
    assert moved["coordinator"]["ports"] == ["0.0.0.0:31000:29520/tcp", "0.0.0.0:31001:9464/tcp"]
    assert moved["coordinator-pg"]["ports"] == [
        "0.0.0.0:31002:29520/tcp",
        "0.0.0.0:31003:9464/tcp",
    ]


@pytest.mark.parametrize("gpus", [None, "4"])
def test_trainer_reserves_one_gpu_per_rank(compose: Compose, gpus: str | None) -> None:
    trainer = compose.services(**({} if gpus is None else {"GPUS": gpus}))["trainer"]
    expected = gpus or "2"
    launcher, script = _torchrun(trainer)
    assert _flag(launcher, "--nproc-per-node") == expected
    assert script[0] == "examples/train_tp.py"
    devices = trainer["deploy"]["resources"]["reservations"]["devices"]
    # docker-compose 1.x prints an interpolated count as a string; Compose v2 reads it as a number.
    assert devices == [{"driver": "nvidia", "count": expected, "capabilities": ["gpu"]}]


def test_trainers_start_once_the_coordinator_is_healthy(compose: Compose) -> None:
    services = compose.services()
    assert "healthcheck" in services["coordinator"]
    for name in ("trainer", "trainer-cpu"):
        assert services[name]["depends_on"] == {"coordinator": HEALTHY}, name
    assert "healthcheck" in services["postgres"]
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"]
    assert services["coordinator-pg"]["depends_on"] == {"postgres": HEALTHY}


def test_cpu_profile_runs_the_same_job_without_gpus(compose: Compose) -> None:
    services = compose.services(CPU_RANKS="3")
    trainer, cpu = services["trainer"], services["trainer-cpu"]
    assert "deploy" not in cpu
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


def test_trainer_defaults_reach_the_sqlite_coordinator_without_a_token(compose: Compose) -> None:
    services = compose.services()
    for name, job in (("trainer", "tp-gpu"), ("trainer-cpu", "tp-cpu")):
        env = services[name]["environment"]
        assert env["RNGCOORD_ADDR"] == "coordinator:29520"
        assert env["RNGCOORD_JOB"] == job
        # Keys without a value: the host's variable if set there, otherwise left unset.
        assert env["RNGCOORD_TOKEN"] is None
        assert env["RNGCOORD_SEED"] is None


def test_trainer_settings_and_arguments_come_from_the_environment(
    compose: Compose,
) -> None:
    services = compose.services(
        RNGCOORD_ADDR="coordinator-pg:29520",
        RNGCOORD_JOB="run-7",
        RNGCOORD_TOKEN="s3cret",
        RNGCOORD_SEED="42",
        TRAIN_STEPS="7",
        TRAIN_ARGS="--resume",
    )
    for name in ("trainer", "trainer-cpu"):
        env = services[name]["environment"]
        settings = ("RNGCOORD_ADDR", "RNGCOORD_JOB", "RNGCOORD_TOKEN", "RNGCOORD_SEED")
        assert [env[key] for key in settings] == ["coordinator-pg:29520", "run-7", "s3cret", "42"]
        _, script = _torchrun(services[name])
        assert _flag(script, "--steps") == "7"
        assert _flag(script, "--checkpoint-dir") == "/checkpoints/run-7"
        assert script[-1] == "--resume"


def test_postgres_profile_runs_the_coordinator_on_postgres(compose: Compose) -> None:
    services = compose.services(POSTGRES_PASSWORD="pg-pass")
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == "pg-pass"
    assert "ports" not in services["postgres"], "the database is for the coordinator only"
    db_url = services["coordinator-pg"]["environment"]["RNGCOORD_DB"]
    assert db_url == "postgresql://rngcoord:pg-pass@postgres:5432/rngcoord"
    assert "volumes" not in services["coordinator-pg"]
