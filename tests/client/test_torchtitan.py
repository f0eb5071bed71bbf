"""torchtitan 0.3.0's ``set_determinism``, unmodified, with rngcoord installed.

torchtitan seeds DTensor with ``torch.distributed.tensor._random.manual_seed(seed + pp_rank,
world_mesh)``: each pipeline stage passes another seed. Under rngcoord a seed is split into
a base (the seed less the rank's stage offset on the install mesh's split dims, which is
``pp_rank`` here) and the stages' own streams (split dims, docs/design.md §5.4): the base is
the job's root seed, or selects the base's streams (``/seed:<base>`` groups).

The smallest mesh that has both a pipeline dim and a TP dim whose shards must differ is
pp=2 x tp=2: four gloo processes (dp x pp x tp = 8 would not fit two cores). The same four
processes then run dp=2 x tp=2 without PP. torchtitan's own ParallelDims builds the meshes,
with its device type pointed at cpu. Each scenario is a fresh job on one coordinator.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from programs import start_gloo

from harness import CoordinatorProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="torchtitan is not installed (pip install torchtitan==0.3.0 torch==2.13.0)",
    ),
]

SEED = 42


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("titan")
    proc = CoordinatorProcess(f"sqlite:///{root / 'store.db'}", root / "coordinator").start()
    try:
        job = start_gloo("titan_determinism", 4, root / "out", addr=proc.address, prefix="tt")
        yield job.wait(timeout_s=600)
    finally:
        proc.close()


def _ok(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    errors = [f"rank {r}: {run[name]['error']}" for r, run in enumerate(runs) if run[name]["error"]]
    assert not errors, "\n".join(errors)
    return [run[name] for run in runs]


def _equal(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return all(
        torch.equal(x["rand"], y["rand"]) and torch.equal(x["randn"], y["randn"])
        for x, y in zip(a, b, strict=True)
    )


# pp=2 x tp=2, rank = 2 * pp + tp.
def test_stages_and_shards_draw_distinct_streams(runs: list[dict[str, Any]]) -> None:
    same = _ok(runs, "same")
    for i in range(4):
        assert same[i]["scope"] is None and same[i]["job_seed"] == SEED
        for j in range(i + 1, 4):
            assert not torch.equal(same[i]["rand"], same[j]["rand"]), (i, j)
            assert not torch.equal(same[i]["randn"], same[j]["randn"]), (i, j)
    # Each stage's tp mesh is its own group: stage 1's name holds ranks 2 and 3.
    assert same[0]["groups"] == ["tp:2[0-1]"] and same[2]["groups"] == ["tp:2[2-3]"]


def test_same_seed_reproduces(runs: list[dict[str, Any]]) -> None:
    same = _ok(runs, "same")
    assert _equal(same, _ok(runs, "same-again"))
    # With no install(seed=...), torchtitan's debug.seed becomes the job's root seed.
    from_titan = _ok(runs, "root-from-titan")
    assert all(r["job_seed"] == SEED and r["scope"] is None for r in from_titan)
    assert _equal(same, from_titan)


def test_other_base_selects_other_streams(runs: list[dict[str, Any]]) -> None:
    other = _ok(runs, "other-base")
    assert all(r["scope"] == 7 for r in other)
    assert all(g.endswith("/seed:7") for r in other for g in r["groups"])
    assert not any(
        torch.equal(a["rand"], b["rand"]) for a, b in zip(other, _ok(runs, "same"), strict=True)
    )
    assert _equal(other, _ok(runs, "other-base-again"))
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(other[i]["rand"], other[j]["rand"]), (i, j)


def test_without_debug_seed(runs: list[dict[str, Any]]) -> None:
    # torchtitan broadcasts rank 0's CPU RNG state as the base: every rank agrees on it.
    drawn = _ok(runs, "titan-draws-seed")
    scopes = {r["scope"] for r in drawn}
    assert len(scopes) == 1, scopes
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(drawn[i]["rand"], drawn[j]["rand"]), (i, j)


# dp=2 x tp=2 without PP, rank = 2 * dp + tp: dp replicas draw alike, tp shards differ.
def test_without_pp(runs: list[dict[str, Any]]) -> None:
    nopp = _ok(runs, "nopp")
    for r in nopp:
        assert r["scope"] is None
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(nopp[a]["rand"], nopp[b]["rand"]), (a, b)
    for a, b in ((0, 1), (2, 3)):
        assert not torch.equal(nopp[a]["rand"], nopp[b]["rand"]), (a, b)
    assert _equal(nopp, _ok(runs, "nopp-again"))
    other = _ok(runs, "nopp-other-base")
    assert all(r["scope"] == 7 for r in other)
    assert not _equal(nopp, other)
