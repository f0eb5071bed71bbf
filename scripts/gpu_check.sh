#!/usr/bin/env bash
# Checks rngcoord's DTensor tracker on a real CUDA device: the Philox state it sets, replicas
# and shards, DTensor's run_dtensor_rng_op path, user generators, and a bitwise resume; and
# that the portable (sharding-invariant) random values are the same bits on CUDA as on CPU.
#
# Usage: scripts/gpu_check.sh            (from anywhere; on the host or in a compose service)
#
# - With 2+ GPUs the check runs as a 2-rank nccl job (torch.distributed.run); with one GPU as
#   2 thread-ranks of PyTorch's multi-threaded process group sharing it (their random ops then
#   run one at a time, since the ranks share the device's generator).
# - It talks to the coordinator at RNGCOORD_ADDR when that is set, else it starts one on
#   127.0.0.1 with a throw-away SQLite store.
# - It prints PASS or FAIL per check and exits 1 if any check fails. Without CUDA it prints
#   SKIP and exits 0.
# - PYTHON picks the interpreter (default: the repository's .venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$gpus" -lt 1 ]; then
  echo "SKIP: no CUDA device visible to torch ($("$PYTHON" -c 'import torch; print(torch.__version__)')); run this on a CUDA host"
  exit 0
fi

workdir=$(mktemp -d)
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$workdir"
}
trap cleanup EXIT

if [ -z "${RNGCOORD_ADDR:-}" ]; then
  "$PYTHON" -m rngcoord.server.cli serve --listen 127.0.0.1:0 --db "sqlite:///$workdir/gpu.db" \
    --metrics off --ready-file "$workdir/ready" --log-level WARNING 2>"$workdir/server.log" &
  server_pid=$!
  for _ in $(seq 1 300); do [ -s "$workdir/ready" ] && break; sleep 0.1; done
  if [ ! -s "$workdir/ready" ]; then
    echo "FAIL: the coordinator did not start:"; cat "$workdir/server.log"; exit 1
  fi
  RNGCOORD_ADDR=$(cat "$workdir/ready")
fi
export RNGCOORD_ADDR
export RNGCOORD_JOB="gpu-check-$$-$(date +%s)"

cat >"$workdir/gpu_check.py" <<'PY'
"""Per-rank CUDA checks; rank 0 prints one PASS/FAIL line per check."""

from __future__ import annotations

import math
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor as dt
import torch.distributed.tensor._random as dtensor_random
from rngcoord.client import init_mesh, install, philox, portable
from rngcoord.client._devices import pack_philox, unpack_philox
from torch.distributed.tensor import Replicate, Shard

WORLD = 2
SERIAL = threading.RLock()  # thread-ranks sharing one GPU take turns with random ops


def set_cuda_state(seed: int, offset: int) -> None:
    torch.cuda.set_rng_state(
        torch.frombuffer(bytearray(pack_philox(seed, offset)), dtype=torch.uint8)
    )


def cuda_state() -> tuple[int, int]:
    return unpack_philox(torch.cuda.get_rng_state())


def gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * WORLD
    dist.all_gather_object(out, value)
    return out


def checks(rank: int) -> dict[str, str]:
    """name -> "" when the check passed on this rank, else what went wrong."""
    mesh = init_mesh((WORLD,), ("dp",), "cuda")
    tracker = install(mesh, seed=12345, lease_size=256)
    upstream = object.__new__(dtensor_random.OffsetBasedRNGTracker)
    results: dict[str, str] = {}

    def record(name: str, ok: bool, detail: str) -> None:
        results[name] = "" if ok else f"rank {rank}: {detail}"

    # The first random op joins the group: a barrier, so never inside SERIAL. The factory
    # path holds the tracker's own generator lock.
    dt.rand((4,), device_mesh=mesh, placements=[Replicate()])
    (manager,) = tracker.leases.values()

    # 1. The Philox state is set exactly: the local values equal a plain CUDA draw at
    #    (group seed, base + shard start), and the generator is left at base + end; on the
    #    factory path (_distribute_region) and on run_dtensor_rng_op's (uniform_ on CUDA).
    for kind in ("factory", "run_dtensor_rng_op"):
        for placements in ([Replicate()], [Shard(0)]):
            with SERIAL:
                base = manager.cursor
                if kind == "factory":
                    t = dt.rand((64, 33), device_mesh=mesh, placements=placements)
                else:
                    t = dt.zeros((64, 33), device_mesh=mesh, placements=placements).uniform_()
                after = cuda_state()
                cursor = manager.cursor
                start, end = upstream._compute_rng_offsets(t._spec)
                local = t.to_local()
                set_cuda_state(manager.seed, base + start)
                if kind == "factory":
                    expected = torch.rand(local.shape, device="cuda")
                else:
                    expected = torch.empty(local.shape, device="cuda").uniform_()
            where = f"{kind}, {placements[0]}"
            record(
                f"{where}: Philox state (seed, base + shard start) set exactly",
                torch.equal(local, expected),
                "values differ from a plain draw at that state",
            )
            record(
                f"{where}: generator left at (seed, base + roundup4(numel))",
                after == (manager.seed, base + end),
                f"{after} != {(manager.seed, base + end)}",
            )
            record(
                f"{where}: stream cursor advanced by roundup4(numel)",
                cursor == base + end,
                f"cursor {cursor} != {base + end}",
            )
            values = gather(local.cpu())
            if placements[0] == Replicate():
                same = all(torch.equal(v, values[0]) for v in values)
                record(f"{where}: replicas identical", same, "replicas differ")
            else:
                differ = not torch.equal(values[0], values[1])
                record(f"{where}: shards distinct", differ, "shards equal")

    # 2. A user generator is the user's own stream: DTensor semantics, and it advances.
    with SERIAL:
        g = torch.Generator("cuda").manual_seed(5)
        seed0, offset0 = unpack_philox(g.get_state())
        x = dt.zeros((64,), device_mesh=mesh, placements=[Shard(0)])
        x.uniform_(generator=g)
        moved = unpack_philox(g.get_state())
    shards = gather(x.to_local().cpu())
    record("user generator: shards distinct", not torch.equal(shards[0], shards[1]), "equal")
    record(
        "user generator: advanced by roundup4(numel)", moved == (seed0, offset0 + 64), f"{moved}"
    )

    # 3. Bitwise resume: state_dict(), then a new tracker of the same job (a new epoch),
    #    load_state_dict() and a Restore at its first lease: the same values again.
    def program() -> list[torch.Tensor]:
        out = [
            dt.randn((128,), device_mesh=mesh, placements=[Shard(0)]).to_local().clone()
            for _ in range(3)
        ]
        with SERIAL:
            y = dt.zeros((300,), device_mesh=mesh, placements=[Replicate()])
            out.append(y.uniform_().to_local().clone())
        return out

    saved = tracker.state_dict()
    first = program()
    dist.barrier()
    resumed = install(mesh, lease_size=256)
    resumed.load_state_dict(saved)
    again = program()
    same = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    record("state_dict, load_state_dict + Restore: bitwise resume", same, "values differ")
    resumed.close()

    # 4. Portable values: each distribution and dtype, on a shard (a different box per rank)
    #    and on a whole 2^20-element tensor, equal on CUDA and CPU bit for bit.
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

    path = "fast" if philox.fast_path_ok(torch.device("cuda")) else "exact"
    record(f"portable: Philox known answers on CUDA ({path} int64 path)", True, "")
    floats = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    draws = [
        (f"{name} {dtype}", fn, {"dtype": dtype, **kw})
        for dtype in floats
        for name, fn, kw in (
            ("uniform", portable.uniform, {}),
            ("uniform [-2, 3)", portable.uniform, {"low": -2.0, "high": 3.0}),
            ("normal", portable.normal, {"mean": 0.5, "std": 2.0}),
            ("bernoulli", portable.bernoulli, {"p": 0.3}),
        )
    ]
    draws += [
        ("randint [-5, 1000)", portable.randint, {"low": -5, "high": 1000}),
        ("randint [0, 2^50)", portable.randint, {"high": 1 << 50}),
    ]
    boxes = {"shard": ((257, 129), [(rank * 100, 100), (3, 120)]), "whole": ((1 << 20,), None)}
    for where, (shape, ranges) in boxes.items():
        for name, fn, kw in draws:
            cpu = fn(0x5EED, 12345, shape, ranges, device="cpu", **kw)
            gpu = fn(0x5EED, 12345, shape, ranges, device="cuda", **kw)
            record(
                f"portable {name}, {where}: CUDA equals CPU bitwise",
                torch.equal(raw(cpu.values), raw(gpu.values)) and cpu.offsets == gpu.offsets,
                "values or offsets differ",
            )
        for dtype in floats:
            x = torch.linspace(-3, 3, math.prod(shape), dtype=dtype).reshape(shape)
            if ranges is not None:
                x = x[tuple(slice(a, a + n) for a, n in ranges)]
            out_c, mask_c, _ = portable.dropout(0x5EED, 7, shape, ranges, x, p=0.2)
            out_g, mask_g, _ = portable.dropout(0x5EED, 7, shape, ranges, x.cuda(), p=0.2)
            record(
                f"portable dropout {dtype}, {where}: CUDA equals CPU bitwise",
                torch.equal(raw(out_c), raw(out_g)) and torch.equal(raw(mask_c), raw(mask_g)),
                "output or mask differ",
            )
    return results


def report(per_rank: list[dict[str, str]]) -> int:
    failed = 0
    for name in per_rank[0]:
        problems = [r[name] for r in per_rank if r.get(name)]
        print(
            f"{'FAIL' if problems else 'PASS'}: {name}"
            + (f" ({'; '.join(problems)})" if problems else "")
        )
        failed += bool(problems)
    print(f"{len(per_rank[0]) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main() -> int:
    if sys.argv[1:] == ["--threads"]:
        from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

        _install_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        store = dist.HashStore()
        per_rank: list[dict[str, str]] = [{} for _ in range(WORLD)]
        errors: list[str] = []

        def worker(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
                per_rank[rank] = checks(rank)
            except BaseException as e:  # report, never hang the other rank silently
                errors.append(f"rank {rank}: {e!r}")
                raise

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            print("FAIL: the check crashed: " + "; ".join(errors))
            return 1
        return report(per_rank)
    results = checks(int(os.environ["RANK"]))
    gathered = gather(results)
    code = report(gathered) if dist.get_rank() == 0 else 0
    codes = gather(code)
    dist.destroy_process_group()
    return int(max(codes))


if __name__ == "__main__":
    sys.exit(main())
PY

echo "rngcoord GPU check: $gpus GPU(s), coordinator $RNGCOORD_ADDR, job $RNGCOORD_JOB"
if [ "$gpus" -ge 2 ]; then
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 "$workdir/gpu_check.py"
else
  "$PYTHON" "$workdir/gpu_check.py" --threads
fi
