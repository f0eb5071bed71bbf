"""Train train_tp.py's tensor-parallel MLP as torchft replica groups that leave and heal.

Each replica group is a torchrun of its own, with a 1-D ``"tp"`` mesh over its ranks; the
replicas average their gradients through torchft (``torchft.Manager`` over a Lighthouse) and
train without restarts while replicas die and come back. Start a coordinator and a
Lighthouse, then each replica (here two, of two ranks each)::

    rngcoord serve --init --db sqlite:///ft.db &
    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510 &
    for r in 0 1; do
      REPLICA_GROUP_ID=$r TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \\
        RNGCOORD_ADDR=localhost:29520 RNGCOORD_JOB=ft-example \\
        torchrun --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0 \\
          examples/train_torchft.py --advertise 127.0.0.1 &
    done; wait

Every replica draws from groups of its own (``tp:2[0-1]/replica:<r>``), so replicas draw
different masks, and within a replica the sharded dropout's shards differ while the
replicated one's agree. ``rngcoord.client.torchft.attach`` ties the tracker to the Manager:
kill a replica and start it again, and it heals from a live peer with the model *and* its own
streams' position, so its masks from then on are those of a run without the failure; a step
that does not commit is redone with the same masks. docs/torchft.md is the guide.

The weights are exchanged as local shards and the optimizer is plain SGD (no state), so that
a heal needs the model alone.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from rngcoord.client import init_mesh, install
from rngcoord.client.torchft import attach
from train_tp import MaskRecorder, add_coordinator_args, build_model, synthetic_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_coordinator_args(parser, "train-torchft", "job name, the same for every replica")
    ft = parser.add_argument_group("torchft")
    ft.add_argument(
        "--replica",
        default=os.environ.get("REPLICA_GROUP_ID", "0"),
        help="this replica group's name (env REPLICA_GROUP_ID)",
    )
    ft.add_argument(
        "--lighthouse",
        default=os.environ.get("TORCHFT_LIGHTHOUSE"),
        help="the Lighthouse's address, http://HOST:PORT (env TORCHFT_LIGHTHOUSE)",
    )
    ft.add_argument(
        "--min-replicas", type=int, default=1, help="the fewest replicas a step commits with"
    )
    ft.add_argument(
        "--async-quorum",
        action="store_true",
        help="compute each step's quorum while the step runs (torchft's use_async_quorum): "
        "a heal then lands in should_commit, after the healing step drew",
    )
    ft.add_argument(
        "--advertise",
        default=socket.gethostname(),
        help="the host name peers reach this replica's manager and state at",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=12, help="committed steps to train")
    train.add_argument("--dim", type=int, default=16, help="model width")
    train.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    train.add_argument("--batch", type=int, default=8, help="rows in the synthetic batch")
    train.add_argument("--dropout", type=float, default=0.25, help="dropout probability")
    train.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate")
    testing = parser.add_argument_group("testing")
    testing.add_argument(
        "--record-masks",
        type=Path,
        metavar="DIR",
        help="write each committed step's dropout masks under DIR/rank-N",
    )
    testing.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="sleep S seconds per step, standing in for a real model's compute",
    )
    testing.add_argument(
        "--fail-commit-at-step",
        type=int,
        default=None,
        metavar="N",
        help="report an error in the first attempt of step N, so that it does not commit and "
        "is redone (give it to every replica: a replica that redoes a step alone falls behind "
        "and heals)",
    )
    testing.add_argument(
        "--hold-while",
        type=Path,
        default=None,
        metavar="FILE",
        help="before each step, wait while FILE exists (a test keeps this replica from "
        "finishing before a restarted peer has come back)",
    )
    args = parser.parse_args(argv)
    if args.lighthouse is None:
        parser.error("--lighthouse (or TORCHFT_LIGHTHOUSE) is required")
    # The device is CPU and gloo: torchft's ProcessGroupGloo carries the replicas' gradients.
    args.device = "cpu"
    return args


def _shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every weight (each parameter is a DTensor after parallelize)."""
    shards = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        shards[name] = p.to_local()
    return shards


def local_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every weight: what a healing replica's same rank needs."""
    with torch.no_grad():
        return {name: shard.clone() for name, shard in _shards(model).items()}


def load_local_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, shard in _shards(model).items():
            shard.copy_(weights[name])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tag = f"[train_torchft replica {args.replica}]"

    def log(message: str) -> None:
        if rank == 0:
            print(f"{tag} {message}", flush=True)

    mesh = init_mesh((world,), ("tp",), device_type="cpu")
    tracker = install(
        mesh, target=args.addr, job=args.job, seed=args.seed, token=args.token, replica=args.replica
    )
    model = build_model(args, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, target = synthetic_batch(args, mesh)
    recorder = MaskRecorder(model)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda weights: load_local_weights(model, weights),
        state_dict=lambda: local_weights(model),
        min_replica_size=args.min_replicas,
        use_async_quorum=args.async_quorum,
        replica_id=f"train_torchft_{args.replica}",
        lighthouse_addr=args.lighthouse,
        hostname=args.advertise,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
    )
    # Before the first random op: a heal then carries this replica's stream position too.
    ft = attach(manager, tracker)
    record_dir = None
    if args.record_masks is not None:
        record_dir = args.record_masks / f"rank-{rank}"
        record_dir.mkdir(parents=True, exist_ok=True)
        (record_dir / "pid").write_text(str(os.getpid()))

    failed_once = False
    while manager.current_step() < args.steps:
        while args.hold_while is not None and args.hold_while.exists():
            time.sleep(0.05)
        manager.start_quorum()  # may heal this replica: weights and streams
        step = manager.current_step()
        if args.step_seconds:
            time.sleep(args.step_seconds)
        optimizer.zero_grad()
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        if step == args.fail_commit_at_step and not failed_once:
            failed_once = True
            manager.report_error(RuntimeError(f"--fail-commit-at-step {step}"))
        # Average each shard's gradient with the same shard of the other replicas.
        for p in model.parameters():
            assert p.grad is not None
            manager.allreduce(p.grad.to_local()).wait()
        committed = manager.should_commit()  # false: the step is redone, with the same masks
        # The step this was: under the asynchronous quorum a heal sets the step only now.
        step = manager.current_step() - 1 if committed else manager.current_step()
        if committed:
            optimizer.step()
        loss_value = loss.full_tensor().item()
        log(
            f"step {step}/{args.steps} loss {loss_value:.6f} "
            f"replicas {manager.num_participants()} {'committed' if committed else 'redone'}"
        )
        if record_dir is not None and committed:
            record: dict[str, Any] = {
                "step": step,
                "heals": ft.heals,
                "rewinds": ft.rewinds,
                **recorder.to_json(),
            }
            (record_dir / f"step-{step:04d}.json").write_text(json.dumps(record))
    log(f"done: {ft.heals} heals, {ft.rewinds} steps redone")
    manager.shutdown(wait=False)
    tracker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
