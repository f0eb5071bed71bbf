"""The guides' opening examples run as written: each shell block below, taken from the guide
itself, in a fresh folder, with only its port made free (tests run side by side)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def _first_sh_block(guide: Path) -> str:
    text = guide.read_text(encoding="utf-8")
    found = re.search(r"```sh\n(.*?)```", text, re.S)
    assert found, f"{guide.name} opens with no ```sh example"
    return found.group(1)


def _run(script: str, cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    # The venv's `rngcoord`, `python` and `torchrun` first on PATH, as an activated venv
    # would put them.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # A session of its own: a script that fails (or times out) before its `kill %1` must not
    # leave its background coordinator running beside the rest of the suite. Files, not
    # pipes: a background process would hold a pipe open after the script ends.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            ["bash", "-e", "-c", script], cwd=cwd, env=env, stdout=out, stderr=err,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            process.wait(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert process.returncode == 0, f"{script}\n--- stdout:\n{stdout}\n--- stderr:\n{stderr}"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _with_free_port(script: str, port: str) -> str:
    assert port in script
    return script.replace(port, str(free_port()))


@pytest.mark.slow
def test_architecture_guide_runs_a_coordinator_and_one_rank(tmp_path: Path) -> None:
    script = _with_free_port(_first_sh_block(ROOT / "docs" / "architecture.md"), "50071")
    done = _run(script, tmp_path)
    # "1 <seed> 0 1024": epoch 1, the group's seed, and the first lease's range.
    assert re.fullmatch(r"1 \d+ 0 1024", done.stdout.strip().splitlines()[-1]), done.stdout
    assert (tmp_path / "arch.db").exists()


@pytest.mark.slow
def test_client_guide_trains_on_four_ranks_and_the_audit_guide_reads_its_store(
    tmp_path: Path,
) -> None:
    # The client guide runs examples/train_tp.py from a checkout: the same relative path here.
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = _with_free_port(_first_sh_block(ROOT / "docs" / "client.md"), "29520")
    trained = _run(script, tmp_path, timeout_s=240)
    assert re.search(r"step 8/8 .*epoch 1", trained.stdout), trained.stdout

    read = _run(_first_sh_block(ROOT / "docs" / "audit.md"), tmp_path)
    table = read.stdout
    assert "tp-example" in table and "grant" in table, table
    verdict = [line for line in table.splitlines() if line.startswith("ok: ")]
    # With the anchors, nothing is left unchecked: no "its tail unchecked" after it.
    assert verdict == [verdict[0].split(";")[0]] and verdict[0].endswith("no overlaps"), table
    report = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "tp-example" in report


@pytest.mark.slow
def test_operations_guide_serves_on_after_a_replica_dies(
    tmp_path: Path, postgres_url_factory: Callable[[], str]
) -> None:
    script = _first_sh_block(ROOT / "docs" / "operations.md")
    default_db = "postgresql://postgres@127.0.0.1:5432/postgres"
    assert default_db in script
    script = script.replace(default_db, postgres_url_factory())  # a database of its own
    script = _with_free_port(_with_free_port(script, "50051"), "50052")
    done = _run(script, tmp_path)
    lines = done.stdout.strip().splitlines()
    assert "0 1024 1024 2048" in lines, done.stdout
    assert lines[-1].startswith("ok: ") and "no overlaps" in lines[-1], done.stdout
