"""Rank programs for the fullgraph and torchtitan tests (tests/client/test_fullgraph.py,
tests/client/test_torchtitan.py); parity_programs.py adds them to its PROGRAMS, which the
launcher in programs.py runs."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from programs import Ctx

PROGRAMS: dict[str, Callable[[Ctx], dict[str, Any]]] = {}


def _program(fn: Callable[[Ctx], dict[str, Any]]) -> Callable[[Ctx], dict[str, Any]]:
    PROGRAMS[fn.__name__] = fn
    return fn


def _cursors(tracker: Any) -> dict[str, int]:
    return {name: m.cursor for name, m in tracker.leases.items()}


class _Block(torch.nn.Module):
    """A 2-layer MLP block with dropout inside and after it, torchtitan's shape of a
    transformer block's feed-forward: ``x + dropout(w2(dropout(relu(w1(x)))))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden)
        self.w2 = torch.nn.Linear(hidden, dim)

    def forward(self, x: Any) -> Any:
        h = torch.nn.functional.dropout(torch.relu(self.w1(x)), p=0.25, training=self.training)
        return x + torch.nn.functional.dropout(self.w2(h), p=0.1, training=self.training)


def _mlp(mesh: Any) -> torch.nn.Sequential:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)  # the same weights on every rank, before they are sharded
    model = torch.nn.Sequential(_Block(16, 32), _Block(16, 32))
    for block in model:
        # DTensors throughout, so that both dropouts are DTensor random ops: the hidden one
        # on a Shard(-1) activation, the outer one on a Replicate one.
        parallelize_module(
            block,
            mesh,
            {
                "w1": ColwiseParallel(input_layouts=Replicate(), use_local_output=False),
                "w2": RowwiseParallel(
                    input_layouts=Shard(-1), output_layouts=Replicate(), use_local_output=False
                ),
            },
        )
    return model


@_program
def fullgraph_mlp(ctx: Ctx) -> dict[str, Any]:
    """Three training steps of a 2-block TP MLP, eagerly and with each block compiled
    (torchtitan's per-block ``torch.compile``) on aot_eager and inductor, fullgraph True and
    False, each from the streams' start (manual_seed with the job's seed). Returns the
    failures of the rank's own assertions."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor._random import manual_seed

    from rngcoord.client import install

    mesh = init_device_mesh("cpu", (ctx.world,), mesh_dim_names=("tp",))
    seed = ctx.args["seed"]
    tracker = install(mesh, ctx.args["addr"], job=f"{ctx.args['prefix']}-mlp", seed=seed)
    template = _mlp(mesh)
    x = distribute_tensor(torch.randn(4, 16, generator=torch.Generator().manual_seed(1)), mesh)
    x = x.redistribute(mesh, [Replicate()])

    def steps(compile_block: Callable[[torch.nn.Module], None] | None) -> dict[str, Any]:
        model: torch.nn.Sequential = copy.deepcopy(template).train()
        if compile_block is not None:
            for block in model:
                compile_block(block)
        manual_seed(seed, mesh)
        out: dict[str, Any] = {"y": [], "grad": [], "cursors": []}
        for _ in range(3):
            model.zero_grad()
            y: Any = model(x)
            assert isinstance(y, DTensor)
            y.sum().backward()  # type: ignore[no-untyped-call]
            first: Any = model[0]
            grad = first.w1.weight.grad
            assert isinstance(grad, DTensor)
            out["y"].append(y.to_local().detach().clone())
            out["grad"].append(grad.to_local().clone())
            out["cursors"].append(_cursors(tracker))
        return out

    failures: dict[str, str | None] = {}
    eager = steps(None)
    torch._inductor.config.fallback_random = True
    for backend_name in ("aot_eager", "inductor"):
        for fullgraph in (True, False):
            name = f"{backend_name}-fullgraph={fullgraph}"
            torch._dynamo.reset()
            recorder = AotEagerAndRecordGraphs() if backend_name == "aot_eager" else None
            backend: Any = recorder or backend_name

            def compile_block(
                block: torch.nn.Module, backend: Any = backend, fullgraph: bool = fullgraph
            ) -> None:
                block.compile(backend=backend, fullgraph=fullgraph)

            try:
                got = steps(compile_block)
                for i in range(3):
                    assert torch.equal(got["y"][i], eager["y"][i]), f"output differs, step {i}"
                    # The gradients go through the same masks; AOTAutograd decomposes the
                    # backward ops (dropout's into two muls), so they agree to rounding.
                    torch.testing.assert_close(got["grad"][i], eager["grad"][i])
                assert got["cursors"] == eager["cursors"], (got["cursors"], eager["cursors"])
                if recorder is not None:
                    forward = "\n".join(g.code for g in recorder.fw_graphs)
                    backward = "\n".join(g.code for g in recorder.bw_graphs)
                    # Two blocks, two dropouts each, every one drawn in the forward graphs,
                    # and none drawn again (recomputed) in the backward graphs.
                    assert forward.count("torch.ops.rngcoord.draw.default") == 4, forward
                    assert "rngcoord" not in backward, backward
                failures[name] = None
            except Exception:
                failures[name] = traceback.format_exc()
    torch._dynamo.reset()
    # Sanity of the reference itself: the draws moved the cursor, dropout dropped.
    assert eager["cursors"][0] != eager["cursors"][1]
    tracker.close()
    dist.barrier()
    return {"failures": failures, "eager_y": eager["y"]}


# -- torchtitan --------------------------------------------------------------------------------


def _titan_on_cpu() -> None:
    """torchtitan picks cuda when no accelerator is found; point it at cpu before its
    modules bind the name."""
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = torch.cpu
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.distributed.utils as titan_dist

    titan_dims.device_type = "cpu"
    titan_dist.device_type = "cpu"
    titan_dist.device_module = torch.cpu


@_program
def titan_determinism(ctx: Ctx) -> dict[str, Any]:
    """torchtitan 0.3.0's set_determinism, unmodified, with rngcoord installed, on pp=2 x tp=2
    and on dp=2 x tp=2 (no PP): per scenario, the values of two DTensor draws on the tp mesh
    and the seed scope. A scenario is one fresh job: (install seed, debug.seed)."""
    _titan_on_cpu()
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Shard
    from torchtitan.config import DebugConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import set_determinism

    from rngcoord.client import install

    layouts = {
        "pp": ParallelDims(
            dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=2, ep=1, world_size=ctx.world
        ),
        "nopp": ParallelDims(
            dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=ctx.world
        ),
    }
    scenarios: list[tuple[str, str, int | None, int | None]] = [
        # (name, layout, install seed, debug.seed)
        ("same", "pp", 42, 42),
        ("same-again", "pp", 42, 42),
        ("root-from-titan", "pp", None, 42),
        ("other-base", "pp", 42, 7),
        ("other-base-again", "pp", 42, 7),
        ("titan-draws-seed", "pp", 42, None),
        ("nopp", "nopp", 42, 42),
        ("nopp-again", "nopp", 42, 42),
        ("nopp-other-base", "nopp", 42, 7),
    ]
    out: dict[str, Any] = {}
    for name, layout, install_seed, debug_seed in scenarios:
        dims = layouts[layout]
        root = dims.get_mesh(["pp", "tp"] if layout == "pp" else ["batch", "tp"])
        tp_mesh = dims.get_mesh("tp")
        job = f"{ctx.args['prefix']}-{name}"
        tracker = install(root, ctx.args["addr"], job=job, seed=install_seed)
        try:
            set_determinism(
                dims,
                torch.device("cpu"),
                DebugConfig(seed=debug_seed),
                distinct_seed_mesh_dims=["pp"],
            )
            a = dt.rand((4, 8), device_mesh=tp_mesh, placements=[Shard(1)]).to_local()
            b = dt.randn((4, 8), device_mesh=tp_mesh, placements=[Shard(0)]).to_local()
            out[name] = {
                "error": None,
                "rand": a,
                "randn": b,
                "scope": tracker.seed_scope,
                "job_seed": tracker.job_seed,
                "groups": sorted(tracker.leases),
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        finally:
            tracker.close()
        dist.barrier()
    return out
