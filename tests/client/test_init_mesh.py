"""rngcoord.client.init_mesh picks its device: the accelerator only where it is available and
has a device for each local rank, else CPU with gloo, and it logs which and why.

The process tests start real ranks (two processes of a gloo job, as torchrun would) with no
device named. On this machine there is no GPU: with the CPU wheel torch has no accelerator,
and with a CUDA wheel (the CI matrix's 2.14 and 2.15 venvs) torch is built for CUDA but finds
no device, the case that used to start nccl and fail.
"""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ports import free_port
from rngcoord.client._install import choose_device_type

RANK_PROGRAM = textwrap.dedent(
    """
    import logging, os
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from rngcoord.client import init_mesh

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    mesh = init_mesh((2,), ("tp",))
    total = torch.ones(1)
    dist.all_reduce(total)
    print("RESULT", mesh.device_type, dist.get_backend(), int(total.item()), flush=True)
    # What is tested ends here; the ranks leave without torch's teardown. torch 2.13's
    # destroy_process_group or the interpreter's exit after it aborted a rank twice in CI
    # ("terminate called without an active exception", SIGABRT, on the rank that hosts the
    # TCPStore), after a barrier too, though not in 30 runs in a row here. Rank 1 says it is
    # done through the store and leaves; rank 0, the store's host, leaves once it has said so,
    # so no rank waits on a socket that has gone.
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.set("rank 1 done", "1")
    else:
        store.wait(["rank 1 done"], timedelta(seconds=60))
    os._exit(0)
    """
)


def _run_ranks(tmp_path: Path, extra_env: dict[str, str], program: str = RANK_PROGRAM) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(program)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "WORLD_SIZE")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    env.update(extra_env)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            outputs.append(out)
    finally:
        for proc in procs:  # a failed rank leaves its peer waiting: end it with the test
            proc.kill()
            proc.wait()
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("local_world", [None, "2"])
def test_without_a_usable_accelerator_ranks_use_cpu_and_gloo(
    tmp_path: Path, local_world: str | None
) -> None:
    built_for = torch.accelerator.current_accelerator()
    # This test covers the host without an accelerator; on a GPU host the choice differs,
    # and test_choice_by_devices states it.
    if built_for is not None and torch.accelerator.is_available():
        pytest.skip(f"{built_for.type} is available here")
    extra = {"LOCAL_WORLD_SIZE": local_world} if local_world else {}
    outputs = _run_ranks(tmp_path, extra)
    for rank, out in enumerate(outputs):
        assert "RESULT cpu cpu:gloo 2" in out, out
        if built_for is None:
            line = f"INFO rngcoord.client.install rngcoord: init_mesh on rank {rank} uses cpu "
            assert line + "(torch has no accelerator); process group backend cpu:gloo" in out
        else:
            # The CUDA wheel without a GPU: falling back is worth a warning.
            line = (
                f"WARNING rngcoord.client.install rngcoord: init_mesh on rank {rank} uses cpu "
                f"(torch is built for {built_for.type}, but no {built_for.type} is available)"
            )
            assert line in out, out


@pytest.mark.slow
def test_an_explicit_device_is_used_as_asked(tmp_path: Path) -> None:
    program = RANK_PROGRAM.replace('("tp",))', 'None, "cpu")')
    for rank, out in enumerate(_run_ranks(tmp_path, {}, program)):
        assert "RESULT cpu cpu:gloo 2" in out, out
        assert f"init_mesh on rank {rank} uses cpu (as asked)" in out, out


@pytest.mark.parametrize(
    ("accelerator", "available", "count", "local_ranks", "expected"),
    [
        ("cuda", True, 8, 8, "cuda"),
        ("cuda", True, 8, 4, "cuda"),
        # Two ranks on one GPU: nccl refuses a device shared by two ranks.
        ("cuda", True, 1, 2, "cpu"),
        ("cuda", False, 0, 1, "cpu"),
        (None, False, 0, 1, "cpu"),
        ("xpu", True, 2, 2, "xpu"),
    ],
)
def test_choice_by_devices(
    accelerator: str | None, available: bool, count: int, local_ranks: int, expected: str
) -> None:
    device, reason = choose_device_type(accelerator, available, count, local_ranks)
    assert device == expected
    if accelerator is not None and available:
        assert f"{count} {accelerator} device(s) for {local_ranks} local rank(s)" in reason


def test_choose_device_type_examples() -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(choose_device_type, "choose_device_type"):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    assert runner.summarize(verbose=False).attempted == 2
