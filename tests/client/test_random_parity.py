"""PyTorch's DTensor random-op suite, with rngcoord installed, on CPU and a real coordinator.

Origin: test/distributed/tensor/test_random_ops.py of pytorch/pytorch, commit
0295b8bd419d5322871db1160070e5cead64f828. Every upstream test has a scenario of the same name
in tests/client/parity_programs.py that makes its assertions about user-visible behaviour
(replicas equal, shards different, determinism, manual_seed, meta init, the 3-D mesh,
compiled == eager) on CPU: four thread-ranks of PyTorch's threaded process group for the init
and op tests, two gloo processes for the compile tests, eight thread-ranks for the 3-D test.
The scenarios are restated rather than copied; they keep upstream's imports (``manual_seed``
is imported from ``torch.distributed.tensor._random`` at the top, before any install()) and
upstream's ``torch.compile(..., fullgraph=True)``. The deviations that remain, and why:

- Every scenario installs rngcoord (a fresh job on a real coordinator) on its mesh.
  Upstream's GPU skips do not apply: rngcoord's CPU path has DTensor's offset semantics.
- test_init_with_user_generator: upstream expects the default stream, seeded by
  ``torch.manual_seed(42)``, to equal a user generator seeded 42. Under rngcoord the default
  stream comes from leases, so two user generators seeded alike are compared instead (equal,
  advancing, and equal again after reseeding).
- test_meta_tensor_init: a (256, 512) tensor instead of (1024, 2048). With the region
  disabled upstream expects equal ranks because the test seeds every rank alike; here the
  assertion is that a disabled region draws nothing from the leases.
- test_rng_tracker_init: upstream asserts DTensor's tracker is created lazily and syncs rank
  0's seed. Replaced by: the tracker is rngcoord's router (an upstream
  ``OffsetBasedRNGTracker``), every rank's group seed is equal, and replicas are equal
  although each rank seeded torch differently.
- test_manual_seed: upstream sets a different seed on each rank and reads it back from the
  device generator. Under rngcoord a seed is a base whose streams every rank of a group must
  share (ranks passing different bases would wait in different groups), so every rank
  passes the same seeds: a base other than the job's draws other streams, the same base
  again and the job's seed start their streams over (the draws repeat), no collective runs.
- test_manual_seed_submesh: rngcoord's InvalidRequest (an RNGCoordError, not RuntimeError),
  with upstream's message.
- test_pipeline_parallel_manual_seed: upstream's per-stage seeds ``123 + pp_rank`` as
  upstream passes them; beyond upstream, every rank draws from base 123's streams, and the
  same seeds reproduce the values.
- test_deterministic_*: ``torch.manual_seed`` calls that made ranks agree are not needed;
  test_deterministic_rand_1d seeds ranks differently before the Replicate draw, to show it.
- test_compile_*: upstream compares device RNG states and expects ``run_dtensor_rng_op`` in
  the graph. Under rngcoord the graph holds ``rngcoord::draw`` behind effect tokens, which
  draws from the leases when the graph runs (rngcoord.client._traced), so: compiled
  (aot_eager and inductor with ``fallback_random``, ``fullgraph=True``) == eager bitwise over
  3 calls, the lease cursors move identically (in place of RNG states), and the aot_eager
  graphs hold ``rngcoord::draw`` in ``with_effects`` and no ``run_dtensor_rng_op``.
- test_deterministic_uniform_2d reads ``_calc_shard_linear_idx`` from DTensor's tracker, as
  upstream; rngcoord's router inherits it.
- The LocalTensor variants (create_local_tensor_test_class) are not run: LocalTensor mode
  simulates every rank in one thread, and rngcoord keeps one tracker per real rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from parity_programs import COMPILE, INIT_AND_OPS, THREE_D
from programs import run_threads, start_gloo

from harness import CoordinatorProcess

pytestmark = pytest.mark.slow

SEED = 271828


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("parity")
    proc = CoordinatorProcess(f"sqlite:///{root / 'store.db'}", root / "coordinator").start()
    try:
        yield proc.address
    finally:
        proc.close()


def _failures(results: list[dict[str, Any]], name: str) -> str:
    return "\n".join(
        f"--- rank {rank} ---\n{r['failures'][name]}"
        for rank, r in enumerate(results)
        if r["failures"][name] is not None
    )


@pytest.fixture(scope="module")
def init_and_ops(address: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("init-and-ops")
    only = list(INIT_AND_OPS)
    return run_threads(
        "parity_init_and_ops", 4, out, addr=address, seed=SEED, prefix="ops", only=only
    )


@pytest.fixture(scope="module")
def compiled(address: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("compile")
    job = start_gloo(
        "parity_compile", 2, out, addr=address, seed=SEED, prefix="compile", only=list(COMPILE)
    )
    return job.wait(timeout_s=900)


@pytest.fixture(scope="module")
def three_d(address: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("3d")
    only = list(THREE_D)
    return run_threads("parity_3d", 8, out, addr=address, seed=SEED, prefix="3d", only=only)


@pytest.mark.parametrize("name", list(INIT_AND_OPS))
def test_init_and_ops(init_and_ops: list[dict[str, Any]], name: str) -> None:
    failures = _failures(init_and_ops, name)
    assert not failures, failures


@pytest.mark.parametrize("name", list(COMPILE))
def test_compile(compiled: list[dict[str, Any]], name: str) -> None:
    failures = _failures(compiled, name)
    assert not failures, failures


@pytest.mark.parametrize("name", list(THREE_D))
def test_3d(three_d: list[dict[str, Any]], name: str) -> None:
    failures = _failures(three_d, name)
    assert not failures, failures
