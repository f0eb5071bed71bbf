"""The shard layout (rngcoord.client._tracker.shard_offsets) and sub-mesh groups
(rngcoord.client._groups.stream_group), checked as properties over shapes, placements and 1-D,
2-D and 3-D meshes, seen from every rank.

The meshes are real DeviceMeshes of a one-process gloo group, built for each simulated rank
with ``_rank`` (what PyTorch's own tests do) and no backend of their own.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor._random as dtensor_random
from hypothesis import given, settings
from hypothesis import strategies as st
from programs import run_threads
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ports import free_port
from rngcoord.client._groups import invariant_group, stream_group
from rngcoord.client._tracker import shard_offsets

MESHES = [(1,), (2,), (4,), (3,), (2, 2), (4, 2), (2, 3), (2, 2, 2)]


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    if dist.is_initialized():
        yield
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh_of(shape: tuple[int, ...], rank: int, names: tuple[str, ...] | None = None) -> DeviceMesh:
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    return DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False, _rank=rank)


def slice_of(
    shape: tuple[int, ...], names: tuple[str, ...], sub: tuple[str, ...], rank: int
) -> DeviceMesh:
    """``root[sub]`` as seen by ``rank`` (indexing a backend-less mesh needs process groups)."""
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    coordinate = [int(c) for c in torch.nonzero(ranks == rank)[0]]
    index = tuple(slice(None) if n in sub else coordinate[i] for i, n in enumerate(names))
    return DeviceMesh("cpu", ranks[index], mesh_dim_names=sub, _init_backend=False, _rank=rank)


def spec_of(mesh: DeviceMesh, shape: tuple[int, ...], placements: list[Any]) -> DTensorSpec:
    meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def local_numel(mesh: DeviceMesh, shape: tuple[int, ...], placements: list[Any]) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return math.prod(local)


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    mesh_shape = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    # Primes, sizes below the number of ranks, and multiples of 4.
    tensor = tuple(draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 11, 13, 16])) for _ in range(ndim))
    placements: list[Any] = [
        draw(st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, ndim - 1))))
        for _ in mesh_shape
    ]
    return mesh_shape, tensor, placements


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(cases(), st.lists(cases(), min_size=1, max_size=3))
def test_shards_never_overlap_within_or_across_ops(
    first: tuple[tuple[int, ...], tuple[int, ...], list[Any]],
    more: list[tuple[tuple[int, ...], tuple[int, ...], list[Any]]],
) -> None:
    """Every distinct shard of an op draws from its own offsets [start, start + numel),
    inside [0, end); replicas draw the same; the next op starts at end, so ops never share
    offsets either. Where upstream's layout cannot overlap, it is kept."""
    base = 0
    for mesh_shape, tensor, placements in [first, *more]:
        world = math.prod(mesh_shape)
        by_shard: dict[tuple[int, int], set[int]] = {}
        ends = set()
        for rank in range(world):
            mesh = mesh_of(mesh_shape, rank)
            start, end = shard_offsets(spec_of(mesh, tensor, placements))
            n = local_numel(mesh, tensor, placements)
            assert start % 4 == 0 and end % 4 == 0
            assert start >= 0 and start + n <= end
            by_shard.setdefault((start, n), set()).add(rank)
            ends.add(end)
        assert len(ends) == 1, "ranks disagree on where the cursor goes"
        intervals = sorted((base + s, base + s + n) for s, n in by_shard if n)
        for (_, a_end), (b_start, _) in itertools.pairwise(intervals):
            assert a_end <= b_start, (mesh_shape, tensor, placements, intervals)
        (end,) = ends
        total = (math.prod(tensor) + 3) // 4 * 4
        spec = spec_of(mesh_of(mesh_shape, 0), tensor, placements)
        first_numel = math.prod(dtensor_random._calc_first_shard_size(spec))
        shards = len(by_shard)
        if first_numel % 4 == 0 and shards * first_numel <= total:
            assert end == total  # upstream's layout, unchanged
        base += end


def test_worked_example() -> None:
    """docs/design.md §2.6: an (8,) tensor with [Shard(0)] on 4 ranks."""
    starts = [shard_offsets(spec_of(mesh_of((4,), r), (8,), [Shard(0)])) for r in range(4)]
    assert starts == [(0, 16), (4, 16), (8, 16), (12, 16)]
    # Evenly sharded: upstream's offsets.
    even = [shard_offsets(spec_of(mesh_of((4,), r), (16,), [Shard(0)])) for r in range(4)]
    assert even == [(0, 16), (4, 16), (8, 16), (12, 16)]
    even_2d = [
        shard_offsets(spec_of(mesh_of((2, 2), r), (8, 16), [Shard(0), Shard(1)])) for r in range(4)
    ]
    assert even_2d == [(0, 128), (32, 128), (64, 128), (96, 128)]


@pytest.mark.parametrize(
    ("names", "shape", "sub", "rank", "expected"),
    [
        # dp x tp: the tp slices are copies along dp, a replicate dim.
        (("dp", "tp"), (2, 2), ("tp",), 2, ("tp:2[0-3]", 2, 4)),
        (("dp", "tp"), (2, 2), ("dp",), 1, ("dp:2[0-3]", 1, 4)),
        # dp x pp x tp: copies along dp share, pipeline stages do not.
        (("dp", "pp", "tp"), (2, 2, 2), ("tp",), 5, ("tp:2[0-1.4-5]", 3, 4)),
        (("dp", "pp", "tp"), (2, 2, 2), ("tp",), 2, ("tp:2[2-3.6-7]", 0, 4)),
        (("dp", "pp", "tp"), (2, 2, 2), ("dp", "tp"), 6, ("dp:2,tp:2[2-3.6-7]", 2, 4)),
        (("pp", "tp"), (2, 2), ("tp",), 3, ("tp:2[2-3]", 1, 2)),
        # HSDP + TP: every dim replicates.
        (("dp_replicate", "dp_shard", "tp"), (2, 2, 2), ("tp",), 5, ("tp:2[0-7]", 5, 8)),
        (
            ("dp_replicate", "dp_shard", "tp"),
            (2, 2, 2),
            ("dp_replicate", "dp_shard"),
            5,
            ("dp_replicate:2,dp_shard:2[0-7]", 5, 8),
        ),
    ],
)
def test_sub_mesh_groups(
    names: tuple[str, ...],
    shape: tuple[int, ...],
    sub: tuple[str, ...],
    rank: int,
    expected: tuple[str, int, int],
) -> None:
    root = mesh_of(shape, rank, names)
    group = stream_group(slice_of(shape, names, sub, rank), rank, root)
    assert (group.name, group.rank, group.world_size) == expected


def test_sub_mesh_group_rules() -> None:
    root = mesh_of((2, 2), 1, ("dp", "tp"))
    tp = slice_of((2, 2), ("dp", "tp"), ("tp",), 1)
    # The root itself, no root, and a mesh that is not a slice: their own groups.
    assert stream_group(root, 1, root).name == "dp:2,tp:2[0-3]"
    assert stream_group(tp, 1, None).name == "tp:2[0-1]"
    hand_built = DeviceMesh("cpu", torch.tensor([0, 3]), _init_backend=False, _rank=0)
    assert stream_group(hand_built, 0, mesh_of((2, 2), 0, ("dp", "tp"))).name == "d0:2[0.3]"
    # split_dims overrides the default: here dp stages draw separately.
    split = stream_group(tp, 1, root, split_dims=("dp",))
    assert (split.name, split.rank, split.world_size) == ("tp:2[0-1]", 1, 2)


@pytest.mark.slow
def test_values_never_repeat_and_copies_agree(coordinator: Any, tmp_path: Path) -> None:
    """The same properties on values, end to end: eight thread-ranks on a ("dp", "pp", "tp")
    mesh draw float64 rand through a real coordinator (chance collisions are negligible)."""
    results = run_threads("layout_values", 8, tmp_path, addr=coordinator.address)
    full = results[0]["full"]
    # Replicas and shards assemble to the same full tensor on every rank.
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result["full"], full, strict=True))
    # No value repeats inside an op, or anywhere across the 7 x 64 ops of the stream.
    values = torch.cat([t.flatten() for t in full])
    assert torch.unique(values).numel() == values.numel()
    # dp copies of a tp slice draw the same; the two tp ranks of a slice differ.
    for rank, result in enumerate(results):
        copy = results[rank ^ 4]  # the same (pp, tp) on the other dp coordinate
        assert all(torch.equal(a, b) for a, b in zip(result["tp"], copy["tp"], strict=True))
        other_tp = results[rank ^ 1]
        for a, b in zip(result["tp"], other_tp["tp"], strict=True):
            assert not bool(torch.isin(a, b).any())
    # Pipeline stages ran different op sequences on their own streams: no divergence, each
    # stage attested at 1,024 ops, and the stages' numbers differ.
    for result in results:
        stage_group = [g for g in result["groups"] if g.startswith("tp:2[")]
        assert len(stage_group) == 1
        assert result["attestations"][stage_group[0]] == 1
    stage0 = next(r for r in results if r["stage"] == 0)["stage_values"]
    stage1 = next(r for r in results if r["stage"] == 1)["stage_values"]
    assert not bool(torch.isin(stage0, stage1).any())


def test_groups_of_a_100k_rank_mesh() -> None:
    """Sub-mesh and invariant groups at 10^5 ranks (a 125 x 100 x 8 dp x pp x tp root), seen
    from one rank: the same rules as on small meshes (the tracker finds them once per mesh)."""
    shape, names, rank = (125, 100, 8), ("dp", "pp", "tp"), 54321  # dp 67, pp 90, tp 1
    root = mesh_of(shape, rank, names)
    tp = stream_group(slice_of(shape, names, ("tp",), rank), rank, root)
    # Copies along dp share the tp slice's stream; the stage (pp 90) keeps its own.
    assert (tp.world_size, tp.rank) == (1000, 67 * 8 + 1)
    assert tp.name.startswith("tp:8[sha:")
    dp_tp = stream_group(slice_of(shape, names, ("dp", "tp"), rank), rank, root)
    assert (dp_tp.world_size, dp_tp.rank) == (1000, 67 * 8 + 1)
    assert dp_tp.name != tp.name
    whole = stream_group(root, rank, root)
    assert (whole.name, whole.rank, whole.world_size) == (
        "dp:125,pp:100,tp:8[0-99999]",
        rank,
        10**5,
    )
    inv = invariant_group(root, rank)
    assert (inv.name, inv.rank, inv.world_size) == ("invariant[pp:90]", 67 * 8 + 1, 1000)
