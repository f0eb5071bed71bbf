"""Train a small tensor-parallel MLP with dropout, drawing its random numbers from rngcoord.

Start a coordinator (``rngcoord serve``), then run on one host::

    RNGCOORD_ADDR=localhost:29520 RNGCOORD_JOB=tp-example \\
        torchrun --nproc-per-node=4 examples/train_tp.py

The model is two residual MLP blocks. Each block's first linear layer is split by columns and
its second by rows over a 1-D ``"tp"`` DeviceMesh (``ColwiseParallel`` then
``RowwiseParallel``), so every rank holds one shard of each. The hidden dropout acts on a
sharded DTensor: each shard draws different bits. The output dropout acts on a replicated
DTensor: every rank draws the same bits. ``rngcoord.client.install`` puts a tracker in charge
of those draws; it places them in a Philox stream whose offsets are leased from the
coordinator, so no rank depends on the others having made the same calls since step 0.

The script runs on CPU (gloo) and on CUDA (nccl), whichever the host has, and takes its
coordinator settings from RNGCOORD_ADDR, RNGCOORD_JOB, RNGCOORD_TOKEN and RNGCOORD_SEED unless
flags override them. A coordinator outage mid-run (a restart, a failover) costs it a wait, not
the run, for up to RNGCOORD_OUTAGE_S seconds (10 minutes by default).

Elastic runs: under ``torchrun --nnodes=1:N --rdzv-backend=c10d --max-restarts=1`` a crashed
rank (``--fail-at-step``) makes torchelastic restart every worker. The new workers join a new
epoch of the group. By default it continues from the group's high-water mark, so no random
number is drawn twice. With ``--resume`` they load the latest checkpoint instead, and the
tracker restores the checkpoint's stream cursor, so the run continues bitwise exactly as an
uninterrupted run with the same root seed would have.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from rngcoord.client import LeaseManager, OffsetBasedRNGTracker, init_mesh, install

CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


def add_coordinator_args(
    parser: argparse.ArgumentParser, job: str, job_help: str = "job name"
) -> argparse._ArgumentGroup:
    """--addr, --job, --token and --seed, with their RNGCOORD_* environment defaults."""
    env_seed = os.environ.get("RNGCOORD_SEED")
    coord = parser.add_argument_group("coordinator")
    coord.add_argument(
        "--addr",
        default=os.environ.get("RNGCOORD_ADDR"),
        help="coordinator targets, comma-separated (env RNGCOORD_ADDR; unset: localhost:29520)",
    )
    coord.add_argument(
        "--job",
        default=os.environ.get("RNGCOORD_JOB", job),
        help=f"{job_help} (env RNGCOORD_JOB)",
    )
    coord.add_argument(
        "--token",
        default=os.environ.get("RNGCOORD_TOKEN"),
        help="bearer token (env RNGCOORD_TOKEN)",
    )
    coord.add_argument(
        "--seed",
        type=int,
        default=int(env_seed) if env_seed else None,
        help="the job's root seed (env RNGCOORD_SEED; unset: the coordinator draws one)",
    )
    return coord


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    coord = add_coordinator_args(parser, "train-tp")
    coord.add_argument(
        "--policy",
        choices=("offsets", "sharding_invariant"),
        default="offsets",
        help="how DTensor random ops draw: DTensor's offsets, or the same numbers on any mesh "
        "(so a job resized with --resume continues bitwise)",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=8, help="optimizer steps to run")
    train.add_argument("--dim", type=int, default=16, help="model width")
    train.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    train.add_argument("--batch", type=int, default=8, help="rows in the synthetic batch")
    train.add_argument("--dropout", type=float, default=0.25, help="dropout probability")
    train.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    train.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device of the mesh",
    )
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", type=Path, help="where checkpoints go (unset: none)")
    ckpt.add_argument(
        "--checkpoint-every", type=int, default=2, help="checkpoint after every N steps"
    )
    ckpt.add_argument(
        "--resume",
        action="store_true",
        help="load the latest checkpoint, including the random stream's cursor",
    )
    testing = parser.add_argument_group("testing")
    testing.add_argument(
        "--record-masks",
        type=Path,
        metavar="DIR",
        help="write each step's dropout masks, each rank's group membership and its per-op "
        "trace (trace.jsonl, for rngcoord replay --trace) under DIR",
    )
    testing.add_argument(
        "--fail-at-step",
        type=int,
        metavar="N",
        help="crash at the start of step N (first incarnation only), to exercise restarts",
    )
    testing.add_argument("--fail-rank", type=int, default=0, help="the rank that crashes")
    testing.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="sleep S seconds per step, standing in for a real model's compute (so that a "
        "test can stop the coordinator mid-run)",
    )
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    return args


class Block(nn.Module):
    """A residual MLP block: ``x + dropout(down(dropout(gelu(up(x)))))``.

    Args:
        dim: width of the block's input and output.
        hidden: width of the hidden layer.
        p: dropout probability of both dropout layers.
    """

    def __init__(self, dim: int, hidden: int, p: float) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.hidden_dropout = nn.Dropout(p)
        self.down = nn.Linear(hidden, dim)
        self.out_dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden_dropout(F.gelu(self.up(x)))
        out: torch.Tensor = x + self.out_dropout(self.down(h))
        return out


def build_model(args: argparse.Namespace, mesh: DeviceMesh) -> nn.Sequential:
    """Two blocks, tensor-parallel over ``mesh``; every rank starts from the same weights."""
    # The full weights come from one fixed seed on the default generator, which rngcoord does
    # not touch; parallelize_module then hands each rank its shard.
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.dim, args.hidden, args.dropout) for _ in range(2)))
    model.to(args.device)
    plan: dict[str, Any] = {}
    for i in range(len(model)):
        # use_local_output=False keeps the activations DTensors, so both dropouts are DTensor
        # random ops: sharded after the column-parallel layer, replicated after the row one.
        plan[f"{i}.up"] = ColwiseParallel(use_local_output=False)
        plan[f"{i}.down"] = RowwiseParallel(use_local_output=False)
    parallelize_module(model, mesh, plan)
    return model


def synthetic_batch(args: argparse.Namespace, mesh: DeviceMesh) -> tuple[DTensor, DTensor]:
    """A fixed (input, target) pair, replicated on every rank."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(args.batch, args.dim, generator=gen)
    target = torch.randn(args.batch, args.dim, generator=gen)
    return (
        distribute_tensor(x.to(args.device), mesh, [Replicate()]),
        distribute_tensor(target.to(args.device), mesh, [Replicate()]),
    )


class MaskRecorder:
    """Records which elements each dropout layer dropped in the latest forward pass.

    Args:
        model: the model whose ``nn.Dropout`` modules are watched.
    """

    def __init__(self, model: nn.Module) -> None:
        self.masks: dict[str, torch.Tensor] = {}
        self.sharded: set[str] = set()
        for name, module in model.named_modules():
            if isinstance(module, nn.Dropout):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[DTensor, ...], DTensor], None]:
        def record(_module: nn.Module, inputs: tuple[DTensor, ...], output: DTensor) -> None:
            # A zero in the output where the input was not zero is a dropped element.
            dropped = (output.to_local() == 0) & (inputs[0].to_local() != 0)
            self.masks[name] = dropped.cpu()
            if any(p.is_shard() for p in output.placements):
                self.sharded.add(name)

        return record

    def to_json(self) -> dict[str, Any]:
        """The masks (hex of one 0/1 byte per local element) and the layers on shards."""
        return {
            "masks": {
                name: bytes(mask.to(torch.uint8).flatten().tolist()).hex()
                for name, mask in self.masks.items()
            },
            "sharded": sorted(self.sharded),
        }


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` (DCP writes .metadata last), or None."""
    found = [
        (int(m.group(1)), path)
        for path in root.glob("step-*")
        if (m := CHECKPOINT_NAME.match(path.name)) and (path / ".metadata").exists()
    ]
    return max(found) if found else None


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tracker: OffsetBasedRNGTracker,
) -> Path:
    path = root / f"step-{step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    # The tracker's state is per rank. It is written before dcp.save, whose collective finish
    # writes .metadata, so a checkpoint that has .metadata has every rank's tracker file.
    torch.save(tracker.state_dict(), path / f"rng-rank{dist.get_rank()}.pt")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return path


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tracker: OffsetBasedRNGTracker,
) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # dcp.load fills the tensors of these dicts in place.
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    tracker.load_state_dict(torch.load(path / f"rng-rank{dist.get_rank()}.pt"))


def joined_group(tracker: OffsetBasedRNGTracker) -> LeaseManager:
    """The group that the "tp" mesh forms; the tracker joins it on the first random op."""
    (group,) = tracker.leases.values()
    return group


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchelastic counts restarts; the first incarnation of the workers is 0.
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def log(message: str) -> None:
        if rank == 0:
            print(f"[train_tp] {message}", flush=True)

    record_dir = None
    if args.record_masks is not None:
        record_dir = args.record_masks / f"incarnation-{incarnation}" / f"rank-{rank}"
        record_dir.mkdir(parents=True, exist_ok=True)
    mesh = init_mesh((world,), ("tp",), device_type=args.device)
    tracker = install(
        mesh,
        target=args.addr,
        job=args.job,
        seed=args.seed,
        token=args.token,
        policy=args.policy,
        # One JSON line per random op (group, cursor, shape, dtype, op), for rngcoord replay.
        trace=None if record_dir is None else record_dir / "trace.jsonl",
    )
    model = build_model(args, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x, target = synthetic_batch(args, mesh)
    recorder = MaskRecorder(model)

    first_step = 1
    if args.resume:
        found = latest_checkpoint(args.checkpoint_dir)
        if found is None:
            log("--resume: no checkpoint yet, starting at step 1")
        else:
            done, path = found
            load_checkpoint(path, model, optimizer, tracker)
            first_step = done + 1
            if tracker.unrestorable:
                # The offsets policy's streams belong to their mesh: a resized job cannot
                # rewind them (the tracker warns on every rank; say it once here).
                for saved, current in tracker.unrestorable.items():
                    log(
                        f"resuming after step {done} from {path}: model and optimizer "
                        f"restored, but its random stream cannot rewind onto another mesh: it "
                        f"was saved in group {saved!r}, and this mesh draws from {current!r} "
                        "(the tracker's RuntimeWarning says what that does to the draws)"
                    )
            else:
                log(f"resuming after step {done} from {path}; the random stream rewinds with it")

    for step in range(first_step, args.steps + 1):
        if step == args.fail_at_step and rank == args.fail_rank and incarnation == 0:
            print(f"[train_tp] rank {rank}: simulated crash at step {step}", flush=True)
            os._exit(17)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        optimizer.zero_grad()
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        group = joined_group(tracker)
        if step == first_step:
            log(
                f"incarnation {incarnation}: {world} ranks joined group '{group.group}' "
                f"of job '{group.job}' in epoch {group.epoch}"
            )
            if record_dir is not None:
                member = {
                    "job": group.job,
                    "group": group.group,
                    "epoch": group.epoch,
                    "rank": group.rank,
                    "member_id": group.member_id,
                }
                (record_dir / "member.json").write_text(json.dumps(member))
        loss_value = loss.full_tensor().item()
        log(f"step {step}/{args.steps}  loss {loss_value:.6f}  epoch {group.epoch}")
        if record_dir is not None:
            record = {"step": step, "loss": loss_value.hex(), **recorder.to_json()}
            (record_dir / f"step-{step:04d}.json").write_text(json.dumps(record))
        if args.checkpoint_dir is not None and step % args.checkpoint_every == 0:
            path = save_checkpoint(args.checkpoint_dir, step, model, optimizer, tracker)
            log(f"checkpoint {path}")

    log("done")
    # Leave the group (the coordinator records it) and stop the lease prefetching.
    tracker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
