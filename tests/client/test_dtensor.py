"""DTensor random ops on a real 2x2 DeviceMesh, drawing from a real coordinator.

The same program (tests/client/programs.py: `semantics`) runs on four gloo processes and on
four thread-ranks of PyTorch's multi-threaded process group; the same assertions hold for
both: DTensor's placement semantics, no repeats, bitwise reproduction across jobs, bitwise
resume through state_dict / load_state_dict / Restore, and collectives over the job's own
process group in between.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from programs import run_threads, start_gloo

from rngcoord.client import CoordinatorClient

pytestmark = pytest.mark.slow

SEED = 20240611
LEASE = 64  # offsets: most ops span or cross lease boundaries
FIRST = ("rand_rep", "randn_shard", "tp_rand", "uniform", "normal")
SECOND = ("bernoulli", "dropout_rep", "dropout_shard", "tp_randn", "rand_rep2")
# roundup4(global numel) of every op of the program on the 2x2 mesh and on "tp" sub-meshes.
MESH_CURSOR = 64 + 64 + 128 + 128 + 64 + 64 + 64 + 64
TP_CURSOR = 16 + 16


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b))


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """No element in common at the same position (a repeat would share them all)."""
    return a.shape != b.shape or not bool((a == b).any())


def check_semantics(results: list[dict[str, Any]], prefix: str, address: str) -> None:
    """The assertions on `semantics` run on a 2x2 ("dp", "tp") mesh; rank = 2 * dp + tp."""
    a = [r["a"] for r in results]

    # Replicate: the same values on every rank.
    for op in ("rand_rep", "dropout_rep", "rand_rep2"):
        for rank in range(1, 4):
            assert _same(a[rank][op], a[0][op]), (op, rank)
    # Shard on both mesh dims: four shards, all different (dropout masks are 0/2, so they
    # differ somewhere rather than everywhere).
    for i in range(4):
        for j in range(i + 1, 4):
            assert _disjoint(a[i]["randn_shard"], a[j]["randn_shard"]), (i, j)
            assert not _same(a[i]["dropout_shard"], a[j]["dropout_shard"]), (i, j)
    # [Replicate() on dp, Shard(1) on tp]: ranks with the same tp coordinate are replicas.
    for op in ("uniform", "normal"):
        assert _same(a[0][op], a[2][op]) and _same(a[1][op], a[3][op]), op
        assert _disjoint(a[0][op], a[1][op]), op
    # [Shard(0) on dp, Replicate() on tp].
    assert _same(a[0]["bernoulli"], a[1]["bernoulli"])
    assert _same(a[2]["bernoulli"], a[3]["bernoulli"])
    assert not _same(a[0]["bernoulli"], a[2]["bernoulli"])
    assert set(torch.cat([x["bernoulli"].flatten() for x in a]).tolist()) == {0.0, 1.0}
    # The two "tp" sub-meshes are copies along "dp", a replicate dim: one group over all four
    # ranks, in which dp copies draw the same numbers (as in DTensor) and tp shards differ.
    for op in ("tp_rand", "tp_randn"):
        assert _disjoint(a[0][op], a[1][op]) and _disjoint(a[2][op], a[3][op]), op
        assert _same(a[0][op], a[2][op]) and _same(a[1][op], a[3][op]), op
    # Dropout keeps 1/(1-p) or 0.
    for op in ("dropout_rep", "dropout_shard"):
        assert set(a[0][op].flatten().tolist()) == {0.0, 2.0}, op
    # Consecutive ops never repeat: the same op again draws new values, and the cursor moved
    # by roundup4(global numel) for every op.
    for rank in range(4):
        assert _disjoint(a[rank]["rand_rep"], a[rank]["rand_rep2"])
        cursors = {name: cursor for name, (_, _, cursor) in results[rank]["groups"].items()}
        assert cursors == {"dp:2,tp:2[0-3]": MESH_CURSOR, "tp:2[0-3]": TP_CURSOR}
        states = results[rank]["rng_states"]
        assert set(states) == set(cursors)
        for name, state in states.items():
            seed, _, cursor = results[rank]["groups"][name]
            assert state.dtype == torch.uint8 and state.numel() == 16
            assert int(state[:8].view(torch.int64)) % (1 << 64) == seed
            assert int(state[8:].view(torch.int64)) == cursor

    # Another job with the same root seed (and another lease size) reproduces job a bitwise;
    # so does a local RNGStateTracker given job a's group seeds.
    for rank in range(4):
        for op in FIRST + SECOND:
            assert _same(results[rank]["b"][op], a[rank][op]), ("b", op, rank)
            assert _same(results[rank]["local"][op], a[rank][op]), ("local", op, rank)
    # state_dict() at the midpoint, then load_state_dict() + Restore, continue bitwise: in a
    # new job (which adopts the saved root seed) and in job a itself, in a new epoch.
    for rank in range(4):
        assert results[rank]["c_job_seed"] == SEED
        assert set(results[rank]["a_resumed_epochs"].values()) == {2}
        for op in SECOND:
            assert _same(results[rank]["c"][op], a[rank][op]), ("c", op, rank)
            assert _same(results[rank]["a_resumed"][op], a[rank][op]), ("a_resumed", op, rank)

    # Collectives over the job's process group, between random ops.
    full = results[0]["redistributed"]
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        assert _same(full[4 * dp : 4 * dp + 4, 4 * tp : 4 * tp + 4], results[rank]["shard"])
        assert _same(results[rank]["redistributed"], full)
        assert results[rank]["all_reduce"].tolist() == [10.0, 10.0]
        assert results[rank]["all_reduce_dp"].tolist() == [4.0 if tp == 0 else 6.0]
        assert _same(results[rank]["after_collectives"], results[0]["after_collectives"])

    # A user generator: replicas identical, shards distinct, the generator advanced the same
    # way on every rank, and the coordinator's stream untouched.
    for rank in range(4):
        assert results[rank]["user_cursor_moved"] == 0
        assert _same(results[rank]["user_rep"], results[0]["user_rep"])
        assert _same(results[rank]["user_state"], results[0]["user_state"])
        for other in range(rank + 1, 4):
            assert _disjoint(results[rank]["user_shard"], results[other]["user_shard"])
    assert _disjoint(results[0]["user_rep"], a[0]["rand_rep"])

    # The coordinator recorded the Restores, one per group and resumed job.
    with CoordinatorClient(address) as client:
        restores = client.list_audit(kinds=["restore"])
    # The module's tests share the coordinator: this one's jobs are "<prefix>-...".
    restored = sorted((r.job, r.group) for r in restores if r.job.startswith(f"{prefix}-"))
    groups = ["dp:2,tp:2[0-3]", "tp:2[0-3]"]
    assert restored == sorted((f"{prefix}-{j}", g) for j in ("a", "c") for g in groups)


@pytest.fixture
def coordinator(module_coordinator: Any) -> Any:
    """One coordinator for the module: each test draws in jobs of its own (prefixes g, t, j,
    and the job "shared")."""
    return module_coordinator


def test_gloo_processes(coordinator: Any, tmp_path: Path) -> None:
    """Four gloo processes (a dispatchable "cpu:gloo" process group from init_mesh)."""
    job = start_gloo(
        "semantics", 4, tmp_path, addr=coordinator.address, seed=SEED, lease_size=LEASE, prefix="g"
    )
    results = job.wait()
    assert {r["backend"] for r in results} == {"cpu:gloo"}
    # Each rank's own CPU generator is as it was: the tracker restores it after each op.
    assert all(r["cpu_state_kept"] for r in results)
    # One tracker per process, each with its own member id.
    members = [r["router_members"] for r in results]
    assert [list(m) for m in members] == [[0], [1], [2], [3]]
    assert len({m[r] for r, m in enumerate(members)}) == 4
    check_semantics(results, "g", coordinator.address)


def test_threaded_process_group(coordinator: Any, tmp_path: Path) -> None:
    """Four thread-ranks in one process: each holds its own tracker (pytorch#103235's first
    warning), and DTensor's single `_rng_tracker` routes to it by rank."""
    results = run_threads(
        "semantics", 4, tmp_path, addr=coordinator.address, seed=SEED, lease_size=LEASE, prefix="t"
    )
    members = results[0]["router_members"]
    assert sorted(members) == [0, 1, 2, 3]
    assert len(set(members.values())) == 4
    for rank, result in enumerate(results):
        assert result["member_id"] == members[rank]
    check_semantics(results, "t", coordinator.address)


def test_shared_stream(coordinator: Any, tmp_path: Path) -> None:
    """shared_stream=True: every mesh draws from one group over the install mesh's ranks, so
    the two "tp" sub-meshes draw the same values (like upstream's single generator), and the
    cursor counts every op."""
    results = run_threads("shared", 4, tmp_path, addr=coordinator.address)
    for rank, result in enumerate(results):
        assert "RNGCOORD_JOB" in result["no_job"]
        assert result["job"] == "shared"
        assert result["groups"] == {"all@dp:2,tp:2[0-3]": 16 + 8 + 64}
        assert "root seed" in result["set_seed"]
        assert "not joined" in result["set_offset"]
        tp = rank % 2
        assert _same(result["tp_rand"], results[tp]["tp_rand"])
    assert _disjoint(results[0]["tp_rand"], results[1]["tp_rand"])
    assert all(_same(r["dp_rand"], results[0]["dp_rand"]) for r in results)


def test_groups_joined_ahead_in_one_message_draw_as_lazily_joined(
    coordinator: Any, tmp_path: Path
) -> None:
    """tracker.join(mesh, mesh["tp"]) joins both groups in one JoinGroups message before any
    op; the draws that follow are bitwise those of a job that joined each at its first op."""
    results = run_threads("joined_ahead", 4, tmp_path, addr=coordinator.address, prefix="j")
    for rank, result in enumerate(results):
        # The mesh's group and the tp sub-mesh's: every group the lazy job joins by its end.
        assert result["joined_before_ops"] == ["dp:2,tp:2[0-3]", "tp:2[0-3]"]
        assert result["ahead_groups"] == result["lazy_groups"] == result["joined_before_ops"]
        for name, value in result["lazy"].items():
            assert _same(value, result["ahead"][name]), (rank, name)
    with CoordinatorClient(coordinator.address) as client:
        joins = client.list_audit(job="j-ahead", kinds=["epoch"])
    assert sorted(r.group for r in joins) == ["dp:2,tp:2[0-3]", "tp:2[0-3]"]
