"""Per-rank programs for the client's distributed tests, and the launchers that run them.

A *program* is a function ``program(ctx) -> dict`` that one rank runs after torch.distributed
is up; what it returns is saved with ``torch.save`` and handed back to the test, which makes
the cross-rank assertions. Two launchers run a program on ``world`` ranks:

- :func:`start_gloo`: one subprocess per rank, a real gloo process group initialised by
  ``rngcoord.client.init_mesh`` from torchrun-style environment variables;
- :func:`run_threads` (and :func:`run_threads_async`): one subprocess whose threads are the
  ranks of PyTorch's multi-threaded process group
  (torch.testing._internal.distributed.multi_threaded_pg).

Run as a script, this module is the subprocess: ``python programs.py MODE PROGRAM RANK WORLD
OUTDIR ARGS_JSON``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LAUNCH_TIMEOUT_S = 150.0


# -- launchers (test side) --------------------------------------------------------------------


@dataclass
class Job:
    """Running rank subprocesses of one program."""

    procs: list[subprocess.Popen[bytes]]
    outdir: Path
    logs: list[Path]
    ranks: int
    started: float = field(default_factory=time.monotonic)

    def kill(self) -> None:
        """Kill the ranks still running, and reap every rank."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def wait(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> list[dict[str, Any]]:
        """Wait for every rank; on a failure or timeout kill the rest and raise with logs."""
        import torch

        deadline = self.started + timeout_s
        while any(p.poll() is None for p in self.procs):
            failed = [p for p in self.procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.kill()
        if any(p.returncode != 0 for p in self.procs):
            output = "\n".join(
                f"--- {log.name} (exit {p.returncode}) ---\n{log.read_text()[-6000:]}"
                for p, log in zip(self.procs, self.logs, strict=True)
            )
            raise AssertionError(f"a rank failed or timed out:\n{output}")
        return [
            torch.load(self.outdir / f"rank{r}.pt", weights_only=False) for r in range(self.ranks)
        ]


def _spawn(
    mode: str,
    program: str,
    rank: int,
    world: int,
    outdir: Path,
    args: dict[str, Any],
    env: dict[str, str],
) -> tuple[subprocess.Popen[bytes], Path]:
    log = outdir / f"{mode}-{program}-{rank}.log"
    cmd = [
        sys.executable,
        str(HERE / "programs.py"),
        mode,
        program,
        str(rank),
        str(world),
        str(outdir),
        json.dumps(args),
    ]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return proc, log


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNGCOORD_")}
    # Two busy cores: one intra-op thread per rank keeps the ranks from starving each other.
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_gloo(
    program: str,
    world: int,
    outdir: Path,
    *,
    run_id: str | None = None,
    restart: int = 0,
    **args: Any,
) -> Job:
    """Start ``program`` on ``world`` gloo ranks, one subprocess each. With ``run_id``, as
    attempt ``restart`` of a torchelastic run (TORCHELASTIC_RUN_ID, _RESTART_COUNT): a later
    attempt of the same run takes its job over at once (docs/design.md §7.1, launches)."""
    from ports import free_port  # test side only: the ranks run this file without tests/

    outdir.mkdir(parents=True, exist_ok=True)
    env = _child_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    if run_id is not None:
        env.update(TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT=str(restart))
    procs, logs = [], []
    for rank in range(world):
        proc, log = _spawn(
            "gloo",
            program,
            rank,
            world,
            outdir,
            args,
            {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        procs.append(proc)
        logs.append(log)
    return Job(procs, outdir, logs, world)


def run_threads(program: str, world: int, outdir: Path, **args: Any) -> list[dict[str, Any]]:
    """Run ``program`` on ``world`` thread-ranks of a multi-threaded process group."""
    return run_threads_async(program, world, outdir, **args).wait()


def run_threads_async(program: str, world: int, outdir: Path, **args: Any) -> Job:
    """Start ``program`` on ``world`` thread-ranks; ``wait()`` on the job for the results."""
    outdir.mkdir(parents=True, exist_ok=True)
    proc, log = _spawn("threads", program, 0, world, outdir, args, _child_env())
    return Job([proc], outdir, [log], world)


def wait_file(path: Path, timeout_s: float = 60.0) -> None:
    """Wait until ``path`` exists (a rank's signal to the test, or the test's to ranks)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


# -- rank side --------------------------------------------------------------------------------


@dataclass
class Ctx:
    """What a program gets: its rank, the world size, its outdir and the test's arguments."""

    rank: int
    world: int
    outdir: Path
    args: dict[str, Any]


PROGRAMS: dict[str, Callable[[Ctx], dict[str, Any]]] = {}


def local(t: object) -> Any:
    """The local shard of a DTensor (random ops on DTensors must return DTensors)."""
    from torch.distributed.tensor import DTensor

    assert isinstance(t, DTensor), type(t)
    return t.to_local()


def program(fn: Callable[[Ctx], dict[str, Any]]) -> Callable[[Ctx], dict[str, Any]]:
    PROGRAMS[fn.__name__] = fn
    return fn


def first_half(mesh: Any) -> dict[str, Any]:
    """Ops 1-5 of the op program on a 2x2 ("dp", "tp") mesh and its "tp" sub-meshes: the
    local values by op name. Every group the program uses has drawn by its end."""
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S

    out = {
        "rand_rep": local(dt.rand((8, 8), device_mesh=mesh, placements=[R(), R()])),
        "randn_shard": local(dt.randn((8, 8), device_mesh=mesh, placements=[S(0), S(1)])),
        "tp_rand": local(dt.rand((4, 4), device_mesh=mesh["tp"], placements=[S(0)])),
    }
    x = dt.zeros((8, 16), device_mesh=mesh, placements=[R(), S(1)])
    out["uniform"] = local(x.uniform_(-1.0, 1.0)).clone()
    out["normal"] = local(x.normal_(0.0, 2.0)).clone()
    return out


def second_half(mesh: Any) -> dict[str, Any]:
    """Ops 6-10: bernoulli_, dropout (replicated and sharded), a sub-mesh op, rand again."""
    import torch.distributed.tensor as dt
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S

    b = dt.zeros((8, 8), device_mesh=mesh, placements=[S(0), R()])
    ones = dt.ones((8, 8), device_mesh=mesh, placements=[R(), R()])
    ones_s = dt.ones((8, 8), device_mesh=mesh, placements=[S(0), S(1)])
    return {
        "bernoulli": local(b.bernoulli_(0.5)).clone(),
        "dropout_rep": local(F.dropout(ones, p=0.5, training=True)),
        "dropout_shard": local(F.dropout(ones_s, p=0.5, training=True)),
        "tp_randn": local(dt.randn((4, 4), device_mesh=mesh["tp"], placements=[S(0)])),
        "rand_rep2": local(dt.rand((8, 8), device_mesh=mesh, placements=[R(), R()])),
    }


def _clone(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() for k, v in values.items()}


@program
def semantics(ctx: Ctx) -> dict[str, Any]:
    """The op program in several jobs of one coordinator, on a 2x2 mesh.

    - job "<p>-a" (root seed S): both halves, with state_dict() at the midpoint, then
      collectives over the dispatchable process group;
    - job "<p>-b" (seed S, another lease size): both halves;
    - job "<p>-c" (no seed: adopts the saved one): load_state_dict(), second half;
    - job "<p>-a" again (a new epoch): load_state_dict() + Restore, second half;
    - a local RNGStateTracker with job a's group seeds: both halves.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S

    from rngcoord.client import RNGStateTracker, init_mesh, install
    from rngcoord.client._router import register, unregister

    mesh = init_mesh((2, 2), ("dp", "tp"), "cpu")
    addr, seed, lease, prefix = (ctx.args[k] for k in ("addr", "seed", "lease_size", "prefix"))
    out: dict[str, Any] = {"backend": str(dist.get_backend_config())}

    a = install(mesh, addr, job=f"{prefix}-a", seed=seed, lease_size=lease)
    cpu_state = torch.get_rng_state()
    values = _clone(first_half(mesh))
    # Meaningful in a process of its own: thread-ranks share the CPU generator.
    out["cpu_state_kept"] = torch.equal(cpu_state, torch.get_rng_state())
    saved = a.state_dict()
    values.update(_clone(second_half(mesh)))
    out["a"] = values
    out["saved"] = saved
    out["member_id"] = a.member_id
    out["groups"] = {name: (m.seed, m.epoch, m.cursor) for name, m in a.leases.items()}
    out["rng_states"] = {k: v.clone() for k, v in a.rng_states.items()}
    out["stats"] = {name: vars(m.stats).copy() for name, m in a.leases.items()}
    import torch.distributed.tensor._random as dtensor_random

    from rngcoord.client._router import TrackerRouter

    router = dtensor_random._rng_tracker
    assert isinstance(router, TrackerRouter)
    out["router_members"] = {r: getattr(t, "member_id", None) for r, t in router.trackers.items()}

    # Collectives over the job's dispatchable process group, between random ops.
    x = dt.randn((8, 8), device_mesh=mesh, placements=[S(0), S(1)])
    out["shard"] = x.to_local().clone()
    out["redistributed"] = x.redistribute(mesh, [R(), R()]).to_local().clone()
    total = torch.full((2,), float(ctx.rank + 1))
    dist.all_reduce(total)
    out["all_reduce"] = total
    dp_sum = torch.full((1,), float(ctx.rank + 1))
    dist.all_reduce(dp_sum, group=mesh.get_group("dp"))
    out["all_reduce_dp"] = dp_sum
    out["after_collectives"] = dt.rand((4,), device_mesh=mesh, placements=[R(), R()]).to_local()

    # A user generator is the user's own stream: DTensor semantics, no coordinator.
    user = torch.Generator().manual_seed(77)
    cursor = a.get_offset("dp:2,tp:2[0-3]")
    y = dt.zeros((8, 8), device_mesh=mesh, placements=[S(0), S(1)])
    out["user_shard"] = local(y.uniform_(generator=user)).clone()
    z = dt.zeros((8, 8), device_mesh=mesh, placements=[R(), R()])
    out["user_rep"] = local(z.uniform_(generator=user)).clone()
    out["user_state"] = user.get_state()
    out["user_cursor_moved"] = a.get_offset("dp:2,tp:2[0-3]") - cursor
    a.close()

    b = install(mesh, addr, job=f"{prefix}-b", seed=seed, lease_size=lease * 4)
    values = _clone(first_half(mesh))
    values.update(_clone(second_half(mesh)))
    out["b"] = values
    b.close()

    c = install(mesh, addr, job=f"{prefix}-c", lease_size=lease)
    c.load_state_dict(saved)
    out["c"] = _clone(second_half(mesh))
    out["c_job_seed"] = c.job_seed
    c.close()

    a2 = install(mesh, addr, job=f"{prefix}-a", lease_size=lease)
    a2.load_state_dict(saved)
    out["a_resumed"] = _clone(second_half(mesh))
    out["a_resumed_epochs"] = {name: m.epoch for name, m in a2.leases.items()}
    a2.close()

    reference = RNGStateTracker("cpu", root=mesh)
    for name, (group_seed, _, _) in out["groups"].items():
        reference.set_seed(name, group_seed)
    register(reference)
    try:
        values = _clone(first_half(mesh))
        values.update(_clone(second_half(mesh)))
    finally:
        unregister(reference)
    out["local"] = values
    return out


@program
def divergence(ctx: Ctx) -> dict[str, Any]:
    """Both ranks run rand((16,)) ops; rank 1 runs one extra randn((16,)) after op 5."""
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R

    from rngcoord.client import DivergenceError, init_mesh, install

    mesh = init_mesh((ctx.world,), ("dp",), "cpu")
    tracker = install(mesh, ctx.args["addr"], job=ctx.args["job"], seed=1, lease_size=64)
    extra_after = ctx.args["extra_after"]
    out: dict[str, Any] = {"op": None}
    # Ops 40..49 run after a barrier: a rank that ran ahead and was granted every lease
    # before the other's divergent request still meets the recorded divergence there.
    for i in range(50):
        if i == 40:
            dist.barrier()
        if out["op"] is not None:
            continue
        try:
            dt.rand((16,), device_mesh=mesh, placements=[R()])
            if ctx.rank == 1 and i == extra_after:
                dt.randn((16,), device_mesh=mesh, placements=[R()])
        except DivergenceError as e:
            (manager,) = tracker.leases.values()
            out = {"op": i, "cursor": manager.cursor, "message": str(e), "group": manager.group}
    return out


@program
def attested_divergence(ctx: Ctx) -> dict[str, Any]:
    """Default lease sizes, rand((16,)) ops: the first lease alone holds 4,096 of them. Rank 1
    runs one extra randn((16,)) after op 100; attestations must catch it."""
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R

    from rngcoord.client import DivergenceError, init_mesh, install

    mesh = init_mesh((ctx.world,), ("dp",), "cpu")
    # attest_min_s=0: every 1,024 ops, however fast these ops run (a test draws thousands a
    # second, so the default 30 s would stretch the stride far past 3,000 ops).
    tracker = install(mesh, ctx.args["addr"], job=ctx.args["job"], seed=3, attest_min_s=0)
    out: dict[str, Any] = {"op": None}
    for i in range(3000):
        if i == 2500:
            dist.barrier()  # both ranks are past every attestation that could catch it
        if out["op"] is not None:
            continue
        if 1024 <= i < 1024 + 64 or 2048 <= i < 2500:
            # Each rank learns of the divergence at an attestation (the second attester at
            # 1,024 ops, the first at 2,048), one round trip of the attestation thread later.
            # Throttled, the test's 64 ops of slack are at least 128 ms, well over that round
            # trip however loaded the machine; unthrottled they are a few milliseconds, and a
            # busy second core (make test runs two workers) made the round trip 114 ops.
            time.sleep(0.002)
        try:
            dt.rand((16,), device_mesh=mesh, placements=[R()])
            if ctx.rank == 1 and i == 100:
                dt.randn((16,), device_mesh=mesh, placements=[R()])
        except DivergenceError as e:
            (manager,) = tracker.leases.values()
            out = {"op": i, "message": str(e), "stats": vars(manager.stats).copy()}
    return out


@program
def layout_values(ctx: Ctx) -> dict[str, Any]:
    """float64 draws on a ("dp", "pp", "tp") 2x2x2 mesh and its sub-meshes: full tensors of
    every case (odd and prime shapes, sizes below the number of ranks), tp-slice draws, and
    pipeline stages that run different op sequences on their own tp slices (1,030 and 1,100
    ops, so that both cross an attestation)."""
    import itertools

    import torch
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S

    from rngcoord.client import init_mesh, install

    mesh = init_mesh((2, 2, 2), ("dp", "pp", "tp"), "cpu")
    tracker = install(mesh, ctx.args["addr"], job="layout", seed=11)
    shapes = [(5,), (3, 7), (8,), (2, 3, 5), (13,), (1,), (6, 2)]
    full = []
    for shape in shapes:
        for placements in itertools.product([R(), *(S(d) for d in range(len(shape)))], repeat=3):
            t = dt.rand(shape, device_mesh=mesh, placements=list(placements), dtype=torch.float64)
            full.append(t.full_tensor())
    out: dict[str, Any] = {"full": full}
    tp = mesh["tp"]
    out["tp"] = [
        local(dt.rand(shape, device_mesh=tp, placements=[S(0)], dtype=torch.float64)).clone()
        for shape in [(3,), (8,), (5, 3)]
    ]
    stage = mesh["pp"].get_local_rank()
    n = 1030 if stage == 0 else 1100
    for i in range(n):
        shape = (4,) if stage == 0 else (3 + i % 5,)
        dt.rand(shape, device_mesh=tp, placements=[S(0)], dtype=torch.float64)
    out["stage_values"] = local(
        dt.rand((8,), device_mesh=tp, placements=[S(0)], dtype=torch.float64)
    ).clone()
    out["stage"] = stage
    out["groups"] = sorted(tracker.leases)
    # The attestation thread sends and counts it after the op that crossed 1,024 ops: wait
    # for it (bounded) instead of racing it, which a loaded machine lost once.
    (stage_group,) = [m for name, m in tracker.leases.items() if name.startswith("tp:2[")]
    deadline = time.monotonic() + 60
    while stage_group.stats.attestations < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    out["attestations"] = {k: m.stats.attestations for k, m in tracker.leases.items()}
    tracker.close()
    return out


@program
def invariant_ops(ctx: Ctx) -> dict[str, Any]:
    """The same DTensor random ops under the sharding_invariant policy on the mesh
    ``args["mesh"]``: the full tensors, each op on a few placements."""
    import torch
    import torch.distributed.tensor as dt
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S

    from rngcoord.client import init_mesh, install

    def full(t: Any) -> Any:
        # A copy: on one rank the full tensor may alias the local one, which later ops fill.
        return t.full_tensor().clone()

    shape = tuple(ctx.args["mesh"])
    mesh = init_mesh(shape, ("dp", "tp")[: len(shape)], "cpu")
    tracker = install(
        mesh, ctx.args["addr"], job=ctx.args["job"], seed=77, policy="sharding_invariant"
    )
    n = len(shape)
    layouts: list[list[Any]] = [[R()] * n, [S(0)] * n, [S(1), *[R()] * (n - 1)], [S(0), S(1)][:n]]
    out: dict[str, Any] = {}
    for k, placements in enumerate(layouts):
        out[f"rand{k}"] = full(dt.rand((6, 5), device_mesh=mesh, placements=placements))
        out[f"randn{k}"] = full(
            dt.randn((7, 3), device_mesh=mesh, placements=placements, dtype=torch.float64)
        )
        x: Any = dt.zeros((5, 9), device_mesh=mesh, placements=placements)
        out[f"uniform{k}"] = full(x.uniform_(-2.0, 3.0))
        out[f"normal{k}"] = full(x.normal_(1.0, 0.5))
        out[f"bernoulli{k}"] = full(x.bernoulli_(0.3))
        ones = dt.ones((8, 6), device_mesh=mesh, placements=placements)
        out[f"dropout{k}"] = full(F.dropout(ones, p=0.4, training=True))
        out[f"rand_like{k}"] = full(torch.rand_like(ones))
        out[f"randint_like{k}"] = full(torch.randint_like(ones, 0, 1000))
    out["groups"] = {name: m.cursor for name, m in tracker.leases.items()}
    tracker.close()
    return out


@program
def invariant_compile(ctx: Ctx) -> dict[str, Any]:
    """Under the sharding_invariant policy, compiled dropout and uniform_ (aot_eager) against
    eager, from the same stream start (manual_seed with the job's seed)."""
    import torch
    import torch.distributed.tensor as dt
    import torch.distributed.tensor._random as dtensor_random
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard as S

    from rngcoord.client import init_mesh, install

    mesh = init_mesh((ctx.world,), ("tp",), "cpu")
    tracker = install(
        mesh, ctx.args["addr"], job="inv-compile", seed=5, policy="sharding_invariant"
    )

    def step(x: Any) -> Any:
        return F.dropout(x.uniform_(0.0, 1.0) + 1.0, p=0.5, training=True)

    def run(fn: Any) -> tuple[list[Any], list[int]]:
        dtensor_random.manual_seed(5, mesh)
        values, cursors = [], []
        for _ in range(3):
            x = dt.ones((8, 8), device_mesh=mesh, placements=[S(0)])
            values.append(fn(x).to_local().clone())
            cursors.append(tracker.leases["invariant"].cursor)
        return values, cursors

    eager = run(step)
    compiled = run(torch.compile(step, backend="aot_eager"))
    tracker.close()
    return {"eager": eager, "compiled": compiled}


@program
def restart(ctx: Ctx) -> dict[str, Any]:
    """rand((16,)) ops in three phases; between them the test kills, then restarts, the
    coordinator. Lease size 256: lease 0 is current and lease 1 has arrived when it dies."""
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R

    from rngcoord.client import RNGStateTracker, init_mesh, install
    from rngcoord.client._router import register, unregister

    mesh = init_mesh((ctx.world,), ("dp",), "cpu")
    tracker = install(mesh, ctx.args["addr"], job="restart", seed=5, lease_size=256, outage_s=30.0)

    def ops(n: int) -> list[Any]:
        return [local(dt.rand((16,), device_mesh=mesh, placements=[R()])) for _ in range(n)]

    values = ops(4)  # [0, 64): lease 0 current, lease 1 prefetched
    (manager,) = tracker.leases.values()
    while manager.stats.received < 2:
        time.sleep(0.01)
    online = vars(manager.stats).copy()
    dist.barrier()
    if ctx.rank == 0:
        (ctx.outdir / "phase1").touch()
    wait_file(ctx.outdir / "go1")
    values += ops(28)  # [64, 512): the rest of lease 0 and all of lease 1, offline
    offline = vars(manager.stats).copy()
    dist.barrier()
    if ctx.rank == 0:
        (ctx.outdir / "phase2").touch()
    wait_file(ctx.outdir / "go2")
    values += ops(20)  # [512, 832): leases 2 and 3 from the restarted coordinator
    out = {
        "values": values,
        "online_stats": online,
        "offline_stats": offline,
        "stats": vars(manager.stats).copy(),
        "cursor": manager.cursor,
        "group": manager.group,
    }
    seed = manager.seed
    tracker.close()
    reference = RNGStateTracker("cpu", root=mesh)
    reference.set_seed(manager.group, seed)
    register(reference)
    try:
        out["local"] = ops(52)
    finally:
        unregister(reference)
    return out


@program
def chaos(ctx: Ctx) -> dict[str, Any]:
    """``ops`` rand((16,)) ops at a steady pace with 64-offset leases (a Reserve every 4 ops),
    while the test stops, kills and restarts the coordinator. Rank 0 touches "running" once
    the stream is under way."""
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R

    from rngcoord.client import RNGCoordError, init_mesh, install

    mesh = init_mesh((ctx.world,), ("dp",), "cpu")
    tracker = install(
        mesh, ctx.args["addr"], job="chaos", seed=9, lease_size=64, deadline_s=5.0, outage_s=60.0
    )
    values = []
    try:
        for i in range(ctx.args["ops"]):
            values.append(local(dt.rand((16,), device_mesh=mesh, placements=[R()])))
            if i == 8 and ctx.rank == 0:
                (ctx.outdir / "running").touch()
            time.sleep(ctx.args["pace_s"])
    except RNGCoordError as e:  # a clear failure is an allowed outcome; the test checks it
        return {"values": values, "error": f"{type(e).__name__}: {e}"}
    (manager,) = tracker.leases.values()
    out = {"values": values, "error": None, "stats": vars(manager.stats).copy()}
    tracker.close()
    return out


@program
def rewound(ctx: Ctx) -> dict[str, Any]:
    """Draw, let the test back the store up, draw on and save the tracker's state; once the
    test has put the backup back, install again and load the state: the store went back in
    time (as a failover that lost commits does), and the join reports the saved cursor, so
    the new epoch starts past it."""
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R

    from rngcoord.client import StoreMismatchError, init_mesh, install

    mesh = init_mesh((ctx.world,), ("dp",), "cpu")

    def ops(n: int) -> None:
        for _ in range(n):
            dt.rand((16,), device_mesh=mesh, placements=[R()])

    tracker = install(mesh, ctx.args["addr"], job="rewound", seed=3, lease_size=64)
    ops(4)
    (ctx.outdir / "drawn").touch()
    wait_file(ctx.outdir / "backed-up")
    ops(40)
    state = tracker.state_dict()
    tracker.close()
    (ctx.outdir / "saved").touch()
    wait_file(ctx.outdir / "rewound")
    again = install(mesh, ctx.args["addr"], job="rewound", seed=3, lease_size=64, outage_s=30.0)
    again.load_state_dict(state)
    try:
        ops(1)
    except StoreMismatchError as e:
        return {"state": state, "error": str(e)}
    return {"state": state, "error": None}


@program
def replica(ctx: Ctx) -> dict[str, Any]:
    """One replica of job ``job``: a 1-D "tp" mesh of the ranks, installed as replica
    ``replica`` (None: from REPLICA_GROUP_ID, as torchft sets it), three sharded and three
    replicated draws. Returns the groups (name -> epoch) and the local values."""
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate, Shard

    from rngcoord.client import init_mesh, install

    mesh = init_mesh((ctx.world,), ("tp",), "cpu")
    tracker = install(
        mesh, ctx.args["addr"], job=ctx.args["job"], seed=11, lease_size=64,
        replica=ctx.args.get("replica"),
    )  # fmt: skip
    sharded = [dt.rand((8,), device_mesh=mesh, placements=[Shard(0)]).to_local() for _ in range(3)]
    replicated = [dt.rand((4,), device_mesh=mesh, placements=[Replicate()]).to_local()]
    groups = {name: m.epoch for name, m in tracker.leases.items()}
    tracker.close()
    return {"groups": groups, "sharded": sharded, "replicated": replicated}


@program
def torchft_attach(ctx: Ctx) -> dict[str, Any]:
    """rngcoord.client.torchft.attach on one rank against real torchft Managers (lighthouse
    ``lighthouse``): each refusal of attach() and of a peer's state, by name, with the
    streams before and after it; then a peer's state loaded as a heal would."""
    import os
    from datetime import timedelta

    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Shard
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from rngcoord.client import InvalidRequest, init_mesh, install
    from rngcoord.client.torchft import attach
    from rngcoord.v1.seeds import group_seed

    mesh = init_mesh((ctx.world,), ("tp",), "cpu")
    addr, job = ctx.args["addr"], ctx.args["job"]
    managers: list[Manager] = []

    def manager(replica: str, use_async_quorum: bool = False) -> Manager:
        made = Manager(
            pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, min_replica_size=1,
            use_async_quorum=use_async_quorum, replica_id=f"attach_{replica}_{len(managers)}",
            lighthouse_addr=ctx.args["lighthouse"], hostname="127.0.0.1",
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
            rank=ctx.rank, world_size=ctx.world, timeout=timedelta(seconds=10),
        )  # fmt: skip
        managers.append(made)
        return made

    def draw() -> None:
        dt.rand((8,), device_mesh=mesh, placements=[Shard(0)])

    out: dict[str, Any] = {}

    def refused(name: str, call: Any) -> None:
        try:
            call()
        except InvalidRequest as e:
            out[name] = str(e)
        else:
            out[name] = None

    plain = install(mesh, addr, job=f"{job}-plain", seed=5, lease_size=64)
    refused("no_replica", lambda: attach(manager("plain"), plain))
    plain.close()

    # The peer: replica 1 of the job draws 3 ops and sends its state as attach's would.
    peer = install(mesh, addr, job=job, seed=5, lease_size=64, replica="1")
    peer_ft = attach(manager("1"), peer)
    for _ in range(3):
        draw()
    sent = peer_ft.state_dict()
    peer.close()

    drawn = install(mesh, addr, job=f"{job}-drawn", seed=5, lease_size=64, replica="0")
    draw()
    refused("after_first_op", lambda: attach(manager("drawn"), drawn))
    drawn.close()

    # Replica 0 at the same step (0) as the peer's state, having drawn other ops (two of 16
    # elements against three of 8): refused, nothing restored.
    other = install(mesh, addr, job=job, seed=5, lease_size=64, replica="0")
    other_ft = attach(manager("other"), other)
    for _ in range(2):
        dt.rand((16,), device_mesh=mesh, placements=[Shard(0)])
    other_ft.mark()
    other_before = other.state_dict()["streams"]
    refused("other_ops", lambda: other_ft.load_state_dict(sent))
    out["other_ops_unchanged"] = (
        other.state_dict()["streams"] == other_before and other_ft.heals == 0
    )
    other.close()
    # Having drawn the peer's three ops at the same step: checked, and healed.
    same = install(mesh, addr, job=job, seed=5, lease_size=64, replica="0")
    same_ft = attach(manager("same"), same)
    for _ in range(3):
        draw()
    same_ft.mark()
    same_ft.load_state_dict(sent)
    out["same_ops_heals"] = same_ft.heals
    same.close()

    later = install(mesh, addr, job=f"{job}-async", seed=5, lease_size=64, replica="0")
    out["asynchronous"] = [
        attach(manager("async", use_async_quorum=True), later).asynchronous,
    ]
    later.close()

    tracker = install(mesh, addr, job=job, seed=5, lease_size=64, replica="0")
    sync = manager("0")
    ft = attach(sync, tracker)
    out["asynchronous"].append(ft.asynchronous)
    refused("twice", lambda: attach(sync, tracker))
    before = tracker.state_dict()["streams"]
    tag = next(iter(sent["tracker"]["streams"]))
    entry = sent["tracker"]["streams"][tag]
    bad = {
        "not_attached": {"tracker": sent["tracker"]},
        "other_job": {**sent, "tracker": {**sent["tracker"], "job": f"{job}-other"}},
        "not_a_replica": {**sent, "replica": "2"},
        "seed_not_the_roots": {
            **sent,
            "tracker": {**sent["tracker"], "streams": {tag: {**entry, "seed": entry["seed"] ^ 1}}},
        },
        "other_root_seed": {
            **sent,
            "tracker": {
                **sent["tracker"],
                "job_seed": 6,
                "streams": {tag: {**entry, "seed": group_seed(6, tag)}},
            },
        },
    }
    for name, state in bad.items():
        refused(name, lambda state=state: ft.load_state_dict(state))
    out["unchanged"] = tracker.state_dict()["streams"] == before and ft.heals == 0

    # The heal: replica 0 continues its own group at the peer's position, with its own seed.
    ft.load_state_dict(sent)
    draw()
    out["heals"] = ft.heals
    out["sent"] = entry
    out["healed"] = tracker.state_dict()["streams"]
    tracker.close()
    for made in managers:
        made.shutdown(wait=False)
    return out


@program
def seed_checks(ctx: Ctx) -> dict[str, Any]:
    """Save a state of job ``<prefix>-a`` (root seed 1), then load it where its streams are
    not the job's: into a job of root seed 2, and (edited) into job a itself, installed
    without a seed (the coordinator's is read). Each load must refuse at once, restoring
    nothing; a faithful load into job a without a seed must pass, and so must a load into job
    c of the same root seed."""
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate

    from rngcoord.client import InvalidRequest, init_mesh, install

    mesh = init_mesh((ctx.world,), ("dp",), "cpu")
    addr, prefix = ctx.args["addr"], ctx.args["prefix"]
    a = install(mesh, addr, job=f"{prefix}-a", seed=1, lease_size=64)
    dt.rand((4,), device_mesh=mesh, placements=[Replicate()])
    state = a.state_dict()
    a.close()
    out: dict[str, Any] = {}
    b = install(mesh, addr, job=f"{prefix}-b", seed=2, lease_size=64)
    try:
        b.load_state_dict(state)
    except InvalidRequest as e:
        out["other_root"] = str(e)
    out["other_root_restored"] = sorted(b.state_dict()["streams"])
    b.close()
    streams = {k: {**v, "seed": v["seed"] ^ 1} for k, v in state["streams"].items()}
    again = install(mesh, addr, job=f"{prefix}-a", lease_size=64)
    try:
        again.load_state_dict({**state, "streams": streams})
    except InvalidRequest as e:
        out["edited"] = str(e)
    out["edited_restored"] = sorted(again.state_dict()["streams"])
    again.load_state_dict(state)
    out["faithful"] = dt.rand((4,), device_mesh=mesh, placements=[Replicate()]).to_local()
    again.close()
    # Into another job of the same root seed: allowed, and its Restore names job a.
    c = install(mesh, addr, job=f"{prefix}-c", seed=1, lease_size=64)
    c.load_state_dict(state)
    out["other_job"] = dt.rand((4,), device_mesh=mesh, placements=[Replicate()]).to_local()
    c.close()
    return out


@program
def joined_ahead(ctx: Ctx) -> dict[str, Any]:
    """The op program's first half on a 2x2 mesh in two jobs of one root seed: "<p>-lazy"
    joins each group at its first op, "<p>-ahead" joins the mesh and its "tp" sub-mesh first,
    in one JoinGroups message (tracker.join)."""
    import torch.distributed as dist

    from rngcoord.client import init_mesh, install

    mesh = init_mesh((2, 2), ("dp", "tp"), "cpu")
    out: dict[str, Any] = {}
    for how in ("lazy", "ahead"):
        tracker = install(
            mesh, ctx.args["addr"], job=f"{ctx.args['prefix']}-{how}", seed=21, lease_size=64
        )
        if how == "ahead":
            tracker.join(mesh, mesh["tp"], mesh["tp"])
            out["joined_before_ops"] = sorted(tracker.leases)
        out[how] = first_half(mesh)
        out[f"{how}_groups"] = sorted(tracker.leases)
        tracker.close()
        dist.barrier()
    return out


@program
def shared(ctx: Ctx) -> dict[str, Any]:
    """shared_stream=True on a 2x2 mesh: one group for the mesh and its sub-meshes. Also the
    install() errors and the refused seed interface."""
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S

    from rngcoord.client import InvalidRequest, init_mesh, install

    mesh = init_mesh((2, 2), ("dp", "tp"), "cpu")
    out: dict[str, Any] = {}
    try:
        install(mesh, ctx.args["addr"])
    except InvalidRequest as e:
        out["no_job"] = str(e)
    dist.barrier()  # thread-ranks share os.environ
    os.environ["RNGCOORD_JOB"] = "shared"
    tracker = install(mesh, ctx.args["addr"], seed=8, lease_size=64, shared_stream=True)
    out["tp_rand"] = local(dt.rand((4, 4), device_mesh=mesh["tp"], placements=[S(0)]))
    out["dp_rand"] = local(dt.rand((6,), device_mesh=mesh["dp"], placements=[R()]))
    out["mesh_rand"] = local(dt.rand((8, 8), device_mesh=mesh, placements=[S(0), S(1)]))
    out["groups"] = {name: m.cursor for name, m in tracker.leases.items()}
    out["job"] = tracker.job
    try:
        tracker.set_seed("all@dp:2,tp:2[0-3]", 1)
    except InvalidRequest as e:
        out["set_seed"] = str(e)
    try:
        tracker.set_offset("tp:2[0-3]", 0)
    except InvalidRequest as e:
        out["set_offset"] = str(e)
    tracker.close()
    return out


class FakeGPU:
    """A cuda-like device module whose generator state is 16 bytes of (seed, offset), like
    CUDA's Philox, and which logs every state set, per thread-rank."""

    def __init__(self) -> None:
        self.state = bytearray(16)
        self.sets: dict[int, list[tuple[int, int]]] = {}

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_rng_state(self, device: object = None) -> Any:
        import torch

        return torch.frombuffer(bytearray(self.state), dtype=torch.uint8)

    def set_rng_state(self, new_state: Any, device: object = None) -> None:
        import struct

        import torch.distributed as dist

        assert new_state.dtype.is_floating_point is False and new_state.numel() == 16
        self.state = bytearray(new_state.numpy().tobytes())
        self.sets.setdefault(dist.get_rank(), []).append(struct.unpack("<Qq", self.state))


_fake_lock = threading.Lock()
_fake: FakeGPU | None = None


def fake_gpu() -> FakeGPU:
    """Register the "fakegpu" device once per process and return its module.

    ``rename_privateuse1_backend`` plus ``torch._register_device_module`` make
    ``torch.fakegpu`` the device handle, but DTensor's sharding propagation also builds fake
    tensors on the mesh's device, which needs a device guard: torch 2.13's
    ``_setup_privateuseone_for_python_backend`` registers the Python one. The device has no
    kernels, so the DTensors' local shards stay on CPU (built with the DTensor constructor,
    which does not move them); the RNG state is the device's.
    """
    global _fake
    with _fake_lock:
        if _fake is None:
            from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

            _fake = FakeGPU()
            _setup_privateuseone_for_python_backend("fakegpu", backend_module=_fake)
        return _fake


@program
def fake_device(ctx: Ctx) -> dict[str, Any]:
    """Random ops on a 2x2 mesh of the fake cuda-like device, lease size 32: the Philox
    states the tracker sets, and DTensor's own offsets for each op's spec."""
    import torch
    import torch.distributed.tensor._random as dtensor_random
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from rngcoord.client import OffsetsExhausted, init_mesh, install
    from rngcoord.client._tracker import shard_offsets

    fake = fake_gpu()
    mesh = init_mesh((2, 2), ("dp", "tp"), "fakegpu")
    tracker = install(mesh, ctx.args["addr"], job="fake", seed=ctx.args["seed"], lease_size=32)
    upstream = object.__new__(dtensor_random.OffsetBasedRNGTracker)

    def dtensor(shape: tuple[int, ...], placements: list[Any]) -> DTensor:
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        stride = torch._prims_common.make_contiguous_strides_for(shape)
        meta = TensorMeta(torch.Size(shape), stride, torch.float32)
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
        # The public constructors move local tensors to the mesh's device, which has no
        # kernels; DTensor's own constructor keeps them where they are.
        return DTensor(torch.zeros(local_shape), spec, requires_grad=False)  # type: ignore[no-untyped-call]

    cases: list[tuple[str, tuple[int, ...], list[Any], Callable[[Any], object]]] = [
        ("uniform_", (8, 8), [S(0), S(1)], lambda t: t.uniform_()),
        ("normal_", (5, 3), [R(), S(0)], lambda t: t.normal_()),
        ("bernoulli_", (6,), [S(0), R()], lambda t: t.bernoulli_(0.5)),
        ("dropout", (4, 10), [R(), R()], lambda t: F.dropout(t, 0.5)),
        ("rand_like", (3, 7), [S(1), S(0)], lambda t: torch.rand_like(t)),
        ("uniform_", (40,), [R(), S(0)], lambda t: t.uniform_()),
    ]
    ops = []
    for name, shape, placements, run in cases:
        t = dtensor(shape, placements)
        before = len(fake.sets.get(ctx.rank, []))
        run(t)
        ops.append(
            {
                "name": name,
                "numel": t.numel(),
                "offsets": shard_offsets(t._spec),
                "upstream": upstream._compute_rng_offsets(t._spec),
                "sets": fake.sets[ctx.rank][before:],
            }
        )
    (group,) = tracker.leases
    manager = tracker.leases[group]
    out: dict[str, Any] = {"ops": ops, "group": group, "job_seed": tracker.job_seed}

    # DTensor's CUDA path asks only for the offsets: the tracker sets (seed, base) and
    # run_dtensor_rng_op adds the shard start.
    router = dtensor_random._rng_tracker
    assert isinstance(router, dtensor_random.OffsetBasedRNGTracker)
    spec = dtensor((8, 8), [S(0), S(1)])._spec
    before, cursor = len(fake.sets[ctx.rank]), manager.cursor
    out["hop"] = {
        "cursor": cursor,
        "offsets": router._compute_rng_offsets(spec),
        "upstream": upstream._compute_rng_offsets(spec),
        "sets": fake.sets[ctx.rank][before:],
        "cursor_after": manager.cursor,
    }

    # CUDA keeps the Philox offset as int64: an op that would reach 2^63 is refused, and
    # leaves the stream where it was.
    tracker.set_offset(group, (1 << 63) - 32)
    try:
        dtensor((8, 8), [R(), R()]).uniform_()
    except OffsetsExhausted as e:
        out["exhausted"] = str(e)
    out["cursor_after_refusal"] = manager.cursor
    before = len(fake.sets[ctx.rank])
    dtensor((4, 4), [R(), R()]).uniform_()
    out["last_sets"] = fake.sets[ctx.rank][before:]
    tracker.close()
    return out


def main() -> None:
    mode, name, rank_s, world_s, outdir_s, args_s = sys.argv[1:7]
    world, outdir, args = int(world_s), Path(outdir_s), json.loads(args_s)
    import parity_programs
    import torch

    fn = {**PROGRAMS, **parity_programs.PROGRAMS}[name]
    if mode == "gloo":
        rank = int(rank_s)
        out = fn(Ctx(rank, world, outdir, args))
        torch.save(out, outdir / f"rank{rank}.pt")
        import torch.distributed as dist

        dist.destroy_process_group()
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

    _install_threaded_pg()  # type: ignore[no-untyped-call]
    # Per-thread process-group state, as PyTorch's threaded test harness sets it.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
    store = dist.HashStore()  # type: ignore[attr-defined]
    failures: list[str] = []

    def worker(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            out = fn(Ctx(rank, world, outdir, args))
            torch.save(out, outdir / f"rank{rank}.pt")
        except BaseException:
            failures.append(f"rank {rank}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
