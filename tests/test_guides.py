"""The guides' opening examples run as written: each shell block below, taken from the guide
itself, in a fresh folder, with only its port made free (tests run side by side)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def _first_sh_block(guide: Path) -> str:
    text = guide.read_text(encoding="utf-8")
    found = re.search(r"```sh\n(.*?)```", text, re.S)
    assert found, f"{guide.name} opens with no ```sh example"
    return found.group(1)


@pytest.mark.slow
def test_architecture_guide_runs_a_coordinator_and_one_rank(tmp_path: Path) -> None:
    script = _first_sh_block(ROOT / "docs" / "architecture.md")
    assert "50071" in script
    script = script.replace("50071", str(free_port()))
    # The venv's `rngcoord` and `python` first on PATH, as an activated venv would put them.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # "1 <seed> 0 1024": epoch 1, the group's seed, and the first lease's range.
    assert re.fullmatch(r"1 \d+ 0 1024", done.stdout.strip().splitlines()[-1]), done.stdout
    assert (tmp_path / "arch.db").exists()
