"""Rank programs restating PyTorch's DTensor random-op suite with rngcoord installed.

Origin: test/distributed/tensor/test_random_ops.py of pytorch/pytorch at commit
0295b8bd419d5322871db1160070e5cead64f828 (the torch 2.13 line). Each scenario below is named
after the upstream test whose user-visible assertions it makes, rewritten for CPU, gloo or
PyTorch's threaded process group, and a real coordinator. tests/client/test_random_parity.py
lists what each scenario replaces and why.

A scenario runs on every rank and raises AssertionError on a failure; the program runs all of
its scenarios and reports each one's traceback (or None), so the test reports them one by one.
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor._random as random
import torch.nn.functional as F
from programs import Ctx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._random import manual_seed
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

PROGRAMS: dict[str, Callable[[Ctx], dict[str, Any]]] = {}
Scenario = Callable[["Env"], None]


class Env:
    """What a scenario gets: the rank, the world, and a fresh rngcoord job per scenario."""

    def __init__(self, ctx: Ctx, name: str) -> None:
        self.rank = ctx.rank
        self.world = ctx.world
        self.args = ctx.args
        self.name = name
        self.trackers: list[Any] = []

    def install(self, mesh: DeviceMesh, **kwargs: Any) -> Any:
        from rngcoord.client import install

        job = f"{self.args['prefix']}-{self.name.replace('_', '-')}"
        kwargs.setdefault("seed", self.args["seed"])
        tracker = install(mesh, self.args["addr"], job=job, **kwargs)
        self.trackers.append(tracker)
        return tracker

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def seed_apart(env: Env) -> None:
    """Seed each rank's torch generator differently, as ranks of a real job may be.

    The thread-ranks of one process share torch's CPU generator, so a rank's
    ``torch.manual_seed`` must not land between another rank's setting of that generator
    and its draw (a region holds the tracker's generator lock; user code does not). The
    barrier keeps every rank's reseeding before any rank's next draw.
    """
    torch.manual_seed(env.rank)
    dist.barrier()


def cursors(tracker: Any) -> dict[str, int]:
    return {name: m.cursor for name, m in tracker.leases.items()}


def run_scenarios(ctx: Ctx, scenarios: dict[str, Scenario]) -> dict[str, Any]:
    failures: dict[str, str | None] = {}
    for name, scenario in scenarios.items():
        env = Env(ctx, name)
        try:
            scenario(env)
            failures[name] = None
        except Exception:
            failures[name] = traceback.format_exc()
        finally:
            env.close()
        dist.barrier()
    return {"failures": failures}


# -- DistTensorRandomInitTest -----------------------------------------------------------------


def init_ops(env: Env) -> None:
    mesh = init_device_mesh("cpu", (env.world,))
    tracker = env.install(mesh)
    ops: list[tuple[Callable[..., Any], dict[str, Any]]] = [
        (torch.nn.init.kaiming_uniform_, {"a": 0, "mode": "fan_in", "nonlinearity": "leaky_relu"}),
        (torch.nn.init.normal_, {"mean": 1.5, "std": 0.8}),
        (torch.nn.init.uniform_, {"a": 0, "b": 1.2}),
        (torch.Tensor.log_normal_, {}),
        (torch.Tensor.exponential_, {}),
        (torch.Tensor.geometric_, {"p": 0.3}),
    ]
    for dtype in (torch.float32, torch.float16):
        ops.append((torch.rand_like, {"dtype": dtype}))
        ops.append((torch.randn_like, {"dtype": dtype}))
        ops.append((torch.randint_like, {"low": 0, "high": 100, "dtype": dtype}))
    for op, kwargs in ops:
        dtensor = distribute_tensor(torch.empty(8, 4 * env.world), mesh, [Shard(1)])
        before = cursors(tracker)
        dtensor = op(dtensor, **kwargs)
        # Beyond upstream: every op, the other distributions included, drew from the leases.
        assert cursors(tracker) != before, f"{op} did not draw from the leases"
        assert isinstance(dtensor, DTensor), op
        local = dtensor.to_local()
        full = dtensor.full_tensor()
        for other in range(env.world):
            if other != env.rank:
                block = full[:, 4 * other : 4 * (other + 1)]
                assert not torch.equal(block, local), (op, other)


def multinomial_sharded(env: Env) -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (env.world,))
    env.install(mesh)
    probs = torch.full((8, 4), 0.25)
    result: Any = torch.multinomial(distribute_tensor(probs, mesh, [Shard(0)]), 2, replacement=True)
    assert isinstance(result, DTensor) and result.shape == torch.Size([8, 2])
    assert result.placements == (Shard(0),)
    with CommDebugMode() as comm_mode:  # type: ignore[no-untyped-call]
        last: Any = torch.multinomial(
            distribute_tensor(probs, mesh, [Shard(1)]), 2, replacement=True
        )
    assert comm_mode.get_total_counts() > 0
    assert last.shape == torch.Size([8, 2]) and last.placements == (Replicate(),)


def init_with_user_generator(env: Env) -> None:
    mesh = init_device_mesh("cpu", (env.world,))
    env.install(mesh)
    t1: Any = torch.distributed.tensor.empty((8, 3), device_mesh=mesh, placements=[Shard(0)])
    t2: Any = torch.distributed.tensor.empty((8, 3), device_mesh=mesh, placements=[Shard(0)])
    rng1, rng2 = torch.Generator().manual_seed(42), torch.Generator().manual_seed(42)
    previous = None
    for i in range(2):
        torch.nn.init.uniform_(t1, 0.0, 1.0, rng1)
        torch.nn.init.uniform_(t2, 0.0, 1.0, rng2)
        full = t1.full_tensor()
        assert torch.equal(full, t2.full_tensor()), i
        assert previous is None or not torch.equal(previous, full), "the generator did not move"
        previous = full
    rng1.manual_seed(55)
    rng2.manual_seed(55)
    torch.nn.init.uniform_(t1, 0.0, 1.0, rng1)
    torch.nn.init.uniform_(t2, 0.0, 1.0, rng2)
    assert torch.equal(t1.full_tensor(), t2.full_tensor())


def meta_tensor_init(env: Env) -> None:
    mesh = DeviceMesh("cpu", torch.arange(env.world))
    tracker = env.install(mesh)
    meta = distribute_tensor(torch.empty(256, 512, device="meta"), mesh, [Replicate()])
    assert meta.is_meta
    dtensor: Any = torch.empty_like(meta, device="cpu")
    dtensor.uniform_()
    assert random._rng_tracker is not None and random._rng_tracker.distribute_region_enabled
    gathered = gather(dtensor.to_local())
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    moved = dict(cursors(tracker))
    dtensor = torch.empty_like(meta, device="cpu")
    random._rng_tracker.distribute_region_enabled = False
    try:
        dtensor.uniform_()
        assert not random._rng_tracker.distribute_region_enabled
    finally:
        random._rng_tracker.distribute_region_enabled = True
    assert cursors(tracker) == moved, "a disabled region drew from the leases"


def _linear_weights_differ(env: Env, weight: Any) -> None:
    from rngcoord.client._router import TrackerRouter

    assert isinstance(random._rng_tracker, random.OffsetBasedRNGTracker)
    assert isinstance(random._rng_tracker, TrackerRouter)
    assert isinstance(weight, DTensor)
    gathered = gather(weight.to_local())
    for other in range(env.world):
        if other != env.rank:
            assert not torch.equal(weight.to_local(), gathered[other]), other


def tp_model_meta_init(env: Env) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp_mesh = init_device_mesh("cpu", (env.world,))
    env.install(tp_mesh)
    with torch.device("meta"):
        model = torch.nn.Linear(env.world, env.world, bias=False)
        parallelize_module(model, tp_mesh, ColwiseParallel())
        assert model.weight.device == torch.device("meta")
    model.to_empty(device="cpu")
    model.reset_parameters()
    assert model.weight.device == torch.device("cpu")
    _linear_weights_differ(env, model.weight)


def fsdp_tp_model_meta_init(env: Env) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (env.world // 2, 2), mesh_dim_names=("dp", "tp"))
    env.install(mesh)
    with torch.device("meta"):
        model = torch.nn.Linear(env.world, env.world, bias=False)
        parallelize_module(model, mesh["tp"], ColwiseParallel())
        fully_shard(model, mesh=mesh["dp"])
        assert model.weight.device == torch.device("meta")
    model.to_empty(device="cpu")
    model.reset_parameters()
    _linear_weights_differ(env, model.weight)


def dtensor_init_helper_tensor_meta_strides(env: Env) -> None:
    mesh = DeviceMesh("cpu", torch.arange(env.world))
    env.install(mesh)
    captured = []
    router: Any = random._rng_tracker

    class SpecCapturingTracker:
        def _distribute_region(self, spec: Any) -> Any:
            captured.append(spec.tensor_meta)
            return router._distribute_region(spec)

    torch.distributed.tensor.randn((8, 8), device_mesh=mesh, placements=[Shard(0)])
    random._rng_tracker = SpecCapturingTracker()  # type: ignore[assignment]
    try:
        torch.distributed.tensor.randn((8, 8), device_mesh=mesh, placements=[Shard(0)])
    finally:
        random._rng_tracker = router
    assert len(captured) == 1
    assert captured[0].shape == torch.Size([8, 8]) and captured[0].stride == (8, 1)


# -- DistTensorRandomOpTest -------------------------------------------------------------------


def rng_tracker_init(env: Env) -> None:
    seed_apart(env)  # the ranks' own generators differ, as in a real job
    mesh = DeviceMesh("cpu", torch.arange(env.world))
    tracker = env.install(mesh)
    assert isinstance(random._rng_tracker, random.OffsetBasedRNGTracker)
    dt = distribute_tensor(torch.empty([env.world]), mesh, [Shard(0)])
    dt.uniform_(0, 1)
    (seed,) = {m.seed for m in tracker.leases.values()}
    seeds = gather(torch.tensor([seed % (1 << 63)]))
    assert all(int(s) == seed % (1 << 63) for s in seeds), seeds
    rep = torch.distributed.tensor.rand((4,), device_mesh=mesh, placements=[Replicate()])
    gathered = gather(rep.to_local())
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def manual_seed_scenario(env: Env) -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    # `manual_seed` was imported at the top of this module, before install(): it still
    # takes rngcoord's meaning.
    assert manual_seed is random.manual_seed
    mesh = DeviceMesh("cpu", torch.arange(env.world))
    tracker = env.install(mesh)
    seed = env.args["seed"]

    def draw() -> Any:
        return torch.distributed.tensor.rand((8,), device_mesh=mesh, placements=[Shard(0)])

    first = draw().full_tensor()
    with CommDebugMode() as comm_mode:  # type: ignore[no-untyped-call]
        manual_seed(seed + 1, mesh)
        assert tracker.seed_scope == seed + 1
        other = draw()
        manual_seed(seed + 1, mesh)
        again = draw()
        manual_seed(seed, mesh)
        assert tracker.seed_scope is None
        root_again = draw()
    assert comm_mode.get_total_counts() == 0, "manual_seed ran collectives"
    # Another base draws other streams; the same base, and the root seed, start over.
    assert not torch.equal(other.full_tensor(), first)
    assert torch.equal(again.full_tensor(), other.full_tensor())
    assert torch.equal(root_again.full_tensor(), first)
    assert any(name.endswith(f"/seed:{seed + 1}") for name in tracker.leases), tracker.leases


def manual_seed_submesh(env: Env) -> None:
    from rngcoord.client import InvalidRequest

    env.install(DeviceMesh("cpu", torch.arange(env.world)))
    other = DeviceMesh("cpu", [(env.rank + 1) % env.world], _rank=env.rank)
    try:
        manual_seed(env.rank, other)
        raise AssertionError("manual_seed accepted a mesh without the calling rank")
    except InvalidRequest as e:
        assert "manual_seed requires the current rank to be a part of the device mesh" in str(e)


def pipeline_parallel_manual_seed(env: Env) -> None:
    world_mesh = init_device_mesh("cpu", (env.world // 2, 2), mesh_dim_names=("pp", "spmd"))
    tracker = env.install(world_mesh)
    pp_rank = world_mesh["pp"].get_local_rank()
    spmd_mesh = world_mesh["spmd"]

    def init() -> torch.Tensor:
        manual_seed(123 + pp_rank, spmd_mesh)  # upstream's per-stage seeds
        weight = torch.distributed.tensor.ones(
            2 * spmd_mesh.size(), 2, device_mesh=spmd_mesh, placements=[Shard(0)]
        )
        torch.nn.init.normal_(weight)
        return weight.to_local()

    local = init()
    # Every stage draws from base seed 123's streams; stages differ through the split dim.
    assert tracker.seed_scope == 123
    gathered = gather(local)
    for other in range(env.world):
        if other != env.rank:
            assert not torch.equal(local, gathered[other]), other
    assert torch.equal(init(), local), "the same per-stage seeds did not reproduce the values"


def deterministic_dropout_1d(env: Env) -> None:
    seed_apart(env)
    mesh = DeviceMesh("cpu", torch.arange(env.world))
    env.install(mesh)
    dtensor = distribute_tensor(torch.empty(4, 4), mesh, [Shard(1)])
    dtensor.uniform_(0, 1)
    dtensor = dtensor.redistribute(mesh, [Replicate()])
    dtensor = torch.nn.Dropout(p=0.2)(dtensor)
    gathered = gather(dtensor.to_local())
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def deterministic_rand_1d(env: Env) -> None:
    mesh = DeviceMesh("cpu", torch.arange(env.world))
    env.install(mesh)
    size = [4, 4 * env.world]
    for fn in (torch.distributed.tensor.rand, torch.distributed.tensor.randn):
        gathered = gather(fn(size, device_mesh=mesh, placements=[Shard(1)]).to_local())
        for other in range(env.world):
            if other != env.rank:
                assert not torch.equal(gathered[env.rank], gathered[other]), (fn, other)
        seed_apart(env)  # rngcoord needs no common torch seed for replicas
        gathered = gather(fn(size, device_mesh=mesh, placements=[Replicate()]).to_local())
        assert all(torch.equal(g, gathered[0]) for g in gathered), fn


def deterministic_uniform_2d(env: Env) -> None:
    device_mesh = DeviceMesh("cpu", torch.arange(env.world).reshape(2, 2))
    env.install(device_mesh)
    dtensor = distribute_tensor(torch.empty(4, 4), device_mesh, [Replicate(), Replicate()])
    placements_list: list[list[Any]] = [
        [Shard(0), Shard(1)],
        [Shard(1), Shard(0)],
        [Shard(0), Replicate()],
        [Replicate(), Shard(0)],
        [Shard(1), Replicate()],
        [Replicate(), Shard(1)],
        [Replicate(), Replicate()],
    ]
    shard_index_list = [
        {0: 0, 1: 1, 2: 2, 3: 3},
        {0: 0, 1: 2, 2: 1, 3: 3},
        {0: 0, 1: 0, 2: 1, 3: 1},
        {0: 0, 1: 1, 2: 0, 3: 1},
        {0: 0, 1: 0, 2: 1, 3: 1},
        {0: 0, 1: 1, 2: 0, 3: 1},
        {0: 0, 1: 0, 2: 0, 3: 0},
    ]
    coordinate = device_mesh.get_coordinate()
    assert coordinate is not None
    for placements, shard_index in zip(placements_list, shard_index_list, strict=True):
        dtensor = dtensor.redistribute(device_mesh, placements)
        dtensor.uniform_(0, 1)
        dim_map = dtensor._spec.dim_map
        shard_coord = [coordinate[d] if d >= 0 else 0 for d in dim_map]
        shard_size = [device_mesh.size(d) if d >= 0 else 1 for d in dim_map]
        tracker: Any = random._rng_tracker
        linear = tracker._calc_shard_linear_idx(shard_coord, shard_size)
        assert linear == shard_index[env.rank], placements
        _, local_offset = compute_local_shape_and_global_offset(
            dtensor.shape, device_mesh, placements
        )
        blocks: list[list[tuple[Any, int]]] = [[(0, n)] for n in dtensor.shape]
        for idx, placement in enumerate(placements):
            if isinstance(placement, Shard):
                blocks[placement.dim] = []
                for i in range(device_mesh.size(idx)):
                    size, offset = placement._local_shard_size_and_offset(
                        dtensor.shape[placement.dim], device_mesh.size(idx), i
                    )
                    assert offset is not None
                    blocks[placement.dim].append((offset, size))
        local = dtensor.to_local()
        full = dtensor.full_tensor()
        for block in itertools.product(*blocks):
            offsets = tuple(o for o, _ in block)
            piece = full[tuple(slice(o, o + n) for o, n in block)]
            if offsets == tuple(local_offset):
                assert torch.equal(piece, local), placements
            else:
                assert not torch.equal(piece, local), (placements, block)


def philox_state_seed_roundtrip(env: Env) -> None:
    from torch.distributed.tensor._random import _PhiloxState

    philox = _PhiloxState(torch.zeros(16, dtype=torch.uint8))
    philox.seed = torch.tensor([2**63 + 42], dtype=torch.uint64)
    philox.seed = philox.seed.clone()


# -- DistTensorRandomOpCompileTest ------------------------------------------------------------


def _compile_case(
    env: Env,
    fn: Callable[[Any], Any],
    placements: list[Any],
    create: Callable[[DeviceMesh, list[Any]], Any] | None = None,
) -> None:
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    mesh = init_device_mesh("cpu", (env.world,))
    env.name = f"{env.name}-{type(placements[0]).__name__.lower()}"
    tracker = env.install(mesh)
    seed = env.args["seed"]

    def make() -> Any:
        if create is not None:
            return create(mesh, placements)
        return torch.distributed.tensor.ones((8, 8), device_mesh=mesh, placements=placements)

    def run(f: Callable[[Any], Any]) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
        manual_seed(seed, mesh)  # the stream's start, as upstream's torch.manual_seed(0)
        results, states = [], [cursors(tracker)]
        for _ in range(3):
            results.append(f(make()).to_local().clone())
            states.append(cursors(tracker))
        for a, b in itertools.pairwise(states[1:]):
            assert a != b, "the lease cursor did not move"
        return results, states

    eager, eager_states = run(fn)
    backend = AotEagerAndRecordGraphs()
    torch._inductor.config.fallback_random = True  # as upstream
    for compiled in (
        torch.compile(fn, backend=backend, fullgraph=True),
        torch.compile(fn, backend="inductor", fullgraph=True),
    ):
        torch._dynamo.reset()
        results, states = run(compiled)
        for i, (a, b) in enumerate(zip(eager, results, strict=True)):
            assert torch.equal(a, b), f"compiled != eager at call {i}"
        # After each call (the group is joined by the first one, so not before it).
        assert states[1:] == eager_states[1:], (states, eager_states)
    assert backend.fw_graphs, "aot_eager compiled no graph"
    for graph in backend.fw_graphs:
        # The graph draws from the leases when it runs, in effect-token order; upstream's
        # graph holds run_dtensor_rng_op (CUDA) or the op itself, reading the device
        # generator.
        assert "run_dtensor_rng_op" not in graph.code
        assert "torch.ops.rngcoord.draw.default" in graph.code, graph.code
        assert "with_effects" in graph.code, graph.code
    if all(isinstance(p, Replicate) for p in placements):
        for result in eager:
            gathered = gather(result)
            assert all(torch.equal(g, gathered[0]) for g in gathered)
    torch._dynamo.reset()


def _compile_scenario(
    fn: Callable[[Any], Any], create: Callable[[DeviceMesh, list[Any]], Any] | None = None
) -> Scenario:
    def scenario(env: Env) -> None:
        base = env.name
        for placements in ([Shard(0)], [Replicate()]):
            env.name = base
            _compile_case(env, fn, placements, create)

    return scenario


def _half(mesh: DeviceMesh, placements: list[Any]) -> Any:
    return distribute_tensor(torch.full((8, 8), 0.5), mesh, placements)


def _uniform_then_dropout(x: Any) -> Any:
    x = x.uniform_(0, 1)
    return F.dropout(x, p=0.5)


INIT_AND_OPS: dict[str, Scenario] = {
    "test_init_ops": init_ops,
    "test_multinomial_sharded": multinomial_sharded,
    "test_init_with_user_generator": init_with_user_generator,
    "test_meta_tensor_init": meta_tensor_init,
    "test_tp_model_meta_init": tp_model_meta_init,
    "test_fsdp_tp_model_meta_init": fsdp_tp_model_meta_init,
    "test_dtensor_init_helper_tensor_meta_strides": dtensor_init_helper_tensor_meta_strides,
    "test_rng_tracker_init": rng_tracker_init,
    "test_manual_seed": manual_seed_scenario,
    "test_manual_seed_submesh": manual_seed_submesh,
    "test_pipeline_parallel_manual_seed": pipeline_parallel_manual_seed,
    "test_deterministic_dropout_1d": deterministic_dropout_1d,
    "test_deterministic_rand_1d": deterministic_rand_1d,
    "test_deterministic_uniform_2d": deterministic_uniform_2d,
    "test_philox_state_seed_roundtrip": philox_state_seed_roundtrip,
}

COMPILE: dict[str, Scenario] = {
    "test_compile_native_dropout": _compile_scenario(lambda x: F.dropout(x, p=0.5, training=True)),
    "test_compile_normal_": _compile_scenario(lambda x: x.normal_()),
    "test_compile_rand_like": _compile_scenario(torch.rand_like),
    "test_compile_randn_like": _compile_scenario(torch.randn_like),
    "test_compile_randint_like": _compile_scenario(lambda x: torch.randint_like(x, 0, 10)),
    "test_compile_uniform_": _compile_scenario(lambda x: x.uniform_(0.0, 1.0)),
    "test_compile_bernoulli": _compile_scenario(torch.bernoulli, _half),
    "test_compile_bernoulli_float": _compile_scenario(lambda x: x.bernoulli_(0.5)),
    "test_compile_multiple_random_ops": _compile_scenario(_uniform_then_dropout),
}


def hsdp_tp_model_meta_init(env: Env) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh(
        "cpu", (env.world // 4, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    env.install(mesh)
    with torch.device("meta"):
        model = torch.nn.Linear(env.world, env.world, bias=False)
        parallelize_module(model, mesh["tp"], ColwiseParallel())
        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    model.to_empty(device="cpu")
    model.reset_parameters()
    assert isinstance(model.weight, DTensor)
    weight = model.weight.to_local()
    gathered = gather(weight)
    for other in range(env.world):
        same = torch.equal(weight, gathered[other])
        assert same == (env.rank % 4 == other % 4), other


THREE_D: dict[str, Scenario] = {"test_hsdp_tp_model_meta_init": hsdp_tp_model_meta_init}


def _program(name: str, scenarios: dict[str, Scenario]) -> None:
    def run(ctx: Ctx) -> dict[str, Any]:
        return run_scenarios(ctx, {k: v for k, v in scenarios.items() if k in ctx.args["only"]})

    PROGRAMS[name] = run


_program("parity_init_and_ops", INIT_AND_OPS)
_program("parity_compile", COMPILE)
_program("parity_3d", THREE_D)


# The fullgraph and torchtitan programs run through the same launcher.
from compile_programs import PROGRAMS as _COMPILE_PROGRAMS  # noqa: E402

PROGRAMS.update(_COMPILE_PROGRAMS)
