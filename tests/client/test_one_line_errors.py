"""A fatal rngcoord error prints one line per rank, the traceback only on rank 0.

Real processes: two ranks of a gloo process group, each a `python` subprocess, whose
install() fails because nothing listens at the coordinator address.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ports import free_port

pytestmark = pytest.mark.slow

_PROGRAM = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from rngcoord.client import install
    from rngcoord.client._install import install_excepthook

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if sys.argv[1] == "rngcoord":
        install(mesh, target=sys.argv[2], job="one-line", connect_timeout_s=0.5)
    else:
        install_excepthook(dist.get_rank())  # what install() does first
        raise ValueError("not an rngcoord error")
    """
)


def _run_ranks(tmp_path: Path, mode: str, debug: bool = False) -> list[str]:
    program = tmp_path / "program.py"
    program.write_text(_PROGRAM)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens here
    master = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=master,
        )
        env.pop("RNGCOORD_DEBUG", None)
        if debug:
            env["RNGCOORD_DEBUG"] = "1"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(program), mode, dead],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1, err
        errs.append(err)
    return errs


def _lines(err: str) -> list[str]:
    # gloo and torch may warn on their own; keep what Python printed for the exception.
    return [line for line in err.splitlines() if line.strip() and "[W" not in line[:4]]


def test_one_line_on_rank_1_traceback_on_rank_0(tmp_path: Path) -> None:
    err0, err1 = _run_ranks(tmp_path, "rngcoord")
    assert "Traceback (most recent call last)" in err0
    assert "[rank 0] rngcoord: CoordinatorUnavailable: " in err0
    assert "Traceback" not in err1, err1
    lines = _lines(err1)
    assert len(lines) == 1, err1
    assert lines[0].startswith("[rank 1] rngcoord: CoordinatorUnavailable: ")


def test_debug_prints_every_traceback(tmp_path: Path) -> None:
    err0, err1 = _run_ranks(tmp_path, "rngcoord", debug=True)
    for rank, err in enumerate((err0, err1)):
        assert "Traceback (most recent call last)" in err
        assert f"[rank {rank}] rngcoord: CoordinatorUnavailable: " in err


def test_other_errors_keep_their_traceback(tmp_path: Path) -> None:
    for err in _run_ranks(tmp_path, "other"):
        assert "Traceback (most recent call last)" in err
        assert "ValueError: not an rngcoord error" in err
        assert "rngcoord:" not in err
