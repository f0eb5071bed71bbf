"""The sharding_invariant policy end to end: the same DTensor ops on meshes 1, 2x1, 2x2 and 4,
in processes and in threads, give bitwise-equal global tensors, equal to what one device
draws with rngcoord.client._portable; and an elastic resize from 4 ranks to 2 with --resume
reproduces the uninterrupted run's dropout masks bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from programs import run_threads, start_gloo

from harness import run_cli, side_by_side
from rngcoord import demo
from rngcoord.client import _portable

pytestmark = pytest.mark.slow

SEED = 77
BATCH = 8  # train_tp.py's default --batch


def _group_seed() -> int:
    import hashlib

    digest = hashlib.sha256(
        b"rngcoord/v1/group-seed\0" + SEED.to_bytes(8, "big") + b"invariant"
    ).digest()
    return int.from_bytes(digest[:8], "big")


def test_same_values_on_every_mesh(coordinator: Any, tmp_path: Path) -> None:
    addr = coordinator.address
    # The gloo jobs start first and the thread-rank runs go on while they start up.
    gloo21 = start_gloo("invariant_ops", 2, tmp_path / "b", addr=addr, job="m21", mesh=[2, 1])
    gloo22 = start_gloo("invariant_ops", 4, tmp_path / "c", addr=addr, job="m22", mesh=[2, 2])
    try:
        runs = {
            "1 (threads)": run_threads(
                "invariant_ops", 1, tmp_path / "a", addr=addr, job="m1", mesh=[1]
            ),
            "4 (threads)": run_threads(
                "invariant_ops", 4, tmp_path / "d", addr=addr, job="m4", mesh=[4]
            ),
            "2x1 (gloo)": gloo21.wait(),
            "2x2 (gloo)": gloo22.wait(),
        }
    finally:
        gloo21.kill()
        gloo22.kill()
    reference = runs["1 (threads)"][0]
    ops = [k for k in reference if k != "groups"]
    assert len(ops) == 32
    for name, results in runs.items():
        for rank, result in enumerate(results):
            assert result["groups"] == reference["groups"], (name, rank)
            for op in ops:
                assert torch.equal(result[op], reference[op]), (name, rank, op)
    assert list(reference["groups"]) == ["invariant"]
    # The first op is what one device draws at the stream's start, from the group's seed.
    expected = _portable.uniform(_group_seed(), 0, (6, 5), None, dtype=torch.float32).values
    assert torch.equal(reference["rand0"], expected)
    # Values differ between ops: the stream moves on.
    assert not torch.equal(reference["rand0"], reference["rand1"])


def test_compiled_equals_eager(coordinator: Any, tmp_path: Path) -> None:
    """torch.compile under the policy: graph breaks at the random ops, the same values and
    cursors as eager over 3 steps, on two gloo processes."""
    results = start_gloo("invariant_compile", 2, tmp_path, addr=coordinator.address).wait()
    for result in results:
        (eager, eager_cursors), (compiled, compiled_cursors) = result["eager"], result["compiled"]
        assert compiled_cursors == eager_cursors and eager_cursors[0] > 0
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
        assert not torch.equal(eager[0], eager[1])


def _full_masks(records: Path, steps: range) -> dict[tuple[int, str], torch.Tensor]:
    """Each step's dropout masks as global tensors, assembled from the ranks' local masks
    (the hidden activations are sharded by columns, the outputs replicated)."""
    found = demo.step_records(records)
    out = {}
    for step in steps:
        ranks = sorted(rank for rank, s in found if s == step)
        first = found[(ranks[0], step)]
        for name in first["masks"]:
            local = [
                torch.tensor(list(bytes.fromhex(found[(r, step)]["masks"][name]))).reshape(
                    BATCH, -1
                )
                for r in ranks
            ]
            out[(step, name)] = torch.cat(local, 1) if name in first["sharded"] else local[0]
    return out


@pytest.mark.timeout(400)
def test_resize_from_4_ranks_to_2_with_resume_is_bitwise(coordinator: Any, tmp_path: Path) -> None:
    """examples/train_tp.py with --policy sharding_invariant: 4 ranks run steps 1-3 and
    checkpoint; 2 ranks resume the same job from that checkpoint and run steps 4-6. Their
    dropout masks equal an uninterrupted 4-rank run's, bitwise."""
    spec: dict[str, Any] = {"seed": SEED, "checkpoint_every": 1, "policy": "sharding_invariant"}
    # The reference and the first half run side by side, so that each one's waits
    # (rendezvous, peers, checkpoints) overlap the other's work.
    reference, first = side_by_side(
        lambda: demo.run_job(
            demo.JobSpec("inv-reference", 4, 6, **spec), coordinator.address, tmp_path / "ref"
        ),
        lambda: demo.run_job(
            demo.JobSpec("inv-resize", 4, 3, **spec), coordinator.address, tmp_path / "resize"
        ),
    )
    assert reference.returncode == 0, reference.log_tail()
    assert first.returncode == 0, first.log_tail()
    resized = demo.run_job(
        demo.JobSpec("inv-resize", 2, 6, resume=True, **spec),
        coordinator.address,
        tmp_path / "resize",
    )
    assert resized.returncode == 0, resized.log_tail()
    assert "resuming after step 3" in resized.log.read_text()
    expected = _full_masks(reference.records, range(4, 7))
    got = _full_masks(resized.records, range(4, 7))
    assert expected.keys() == got.keys() and len(got) == 12
    for key, mask in expected.items():
        assert torch.equal(got[key], mask), key
    # Dropout did drop something, and the 2-rank epoch is the group's second.
    assert all(0 < int(m.sum()) < m.numel() for m in got.values())
    (member,) = {m.epoch for m in demo.members(resized.records, 0) if m.rank < 2}
    assert member == 2

    # rngcoord replay regenerates the first op (step 1's hidden dropout, at cursor 0) offline
    # from the audit export, and says which lease granted it.
    export = run_cli("audit", "--db", coordinator.db_url, "--json", "--job", "inv-reference")
    assert export.returncode == 0, export.stderr
    (tmp_path / "audit.jsonl").write_text(export.stdout)
    replay = ["replay", str(tmp_path / "audit.jsonl"), "--job", "inv-reference"]
    op = ["--cursor", "0", "--op", "dropout", "--shape", f"{BATCH},64", "--arg", "p=0.25"]
    done = run_cli(*replay, *op, "-o", str(tmp_path / "step1.pt"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "granted: epoch 1 seq 0 [0, " in done.stdout
    dropped = torch.load(tmp_path / "step1.pt") == 0
    step1 = _full_masks(reference.records, range(1, 2))
    assert torch.equal(dropped.to(torch.uint8), step1[(1, "0.hidden_dropout")].to(torch.uint8))
    # Offsets that were never granted, and a malformed argument, are refused.
    far = run_cli(*replay, "--cursor", str(1 << 60), *op[2:])
    assert far.returncode == 2 and "never granted" in far.stderr
    bad = run_cli(*replay, *op, "--arg", "p")
    assert bad.returncode == 2 and "NAME=VALUE" in bad.stderr
