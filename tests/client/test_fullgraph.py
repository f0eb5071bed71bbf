"""A TP MLP compiled block by block with ``fullgraph=True``, as torchtitan compiles
transformer blocks, draws what eager draws: DTensor dropout inside compiled graphs goes
through ``rngcoord::draw`` (rngcoord.client._traced), bit for bit, with the lease cursors
moving alike.

Two gloo processes run tests/client/compile_programs.py's ``fullgraph_mlp`` on a 2-rank TP
mesh against a real coordinator: three training steps eagerly, then with each of the two
blocks compiled on aot_eager and inductor, fullgraph True and False. Outputs, the first
layer's gradients and the cursors after every step must equal eager's; the aot_eager
graphs must hold the four dropouts as draws in the forward graphs and none in the backward
graphs (a recomputed dropout would draw twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from programs import start_gloo

from harness import CoordinatorProcess

pytestmark = pytest.mark.slow

SEED = 161803


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("fullgraph")
    proc = CoordinatorProcess(f"sqlite:///{root / 'store.db'}", root / "coordinator").start()
    try:
        job = start_gloo(
            "fullgraph_mlp", 2, root / "out", addr=proc.address, seed=SEED, prefix="fg"
        )
        yield job.wait(timeout_s=900)
    finally:
        proc.close()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_blocks_equal_eager(
    results: list[dict[str, Any]], backend: str, fullgraph: bool
) -> None:
    name = f"{backend}-fullgraph={fullgraph}"
    failures = [f"--- rank {r} ---\n{res['failures'][name]}" for r, res in enumerate(results)]
    failures = [f for f, res in zip(failures, results, strict=True) if res["failures"][name]]
    assert not failures, "\n".join(failures)


def test_reference_draws_as_dtensor(results: list[dict[str, Any]]) -> None:
    # The eager reference itself: the outer dropout acts on a Replicate activation, so both
    # ranks see the same output; and the steps draw new masks.
    for step in range(3):
        assert torch.equal(results[0]["eager_y"][step], results[1]["eager_y"][step]), step
    assert not torch.equal(results[0]["eager_y"][0], results[0]["eager_y"][1])
