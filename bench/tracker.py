"""Per-op overhead of rngcoord's DTensor tracker in steady state, measured side by side.

One run, on a 2x2 ("dp", "tp") mesh of four thread-ranks (PyTorch's multi-threaded process
group) and a coordinator this script starts (or RNGCOORD_ADDR / --addr). Rank 0 measures; the
other ranks only join the groups. The spec is a [1024, 1024] float32 DTensor placed
[Shard(0), Replicate()], so one op takes 1M offsets and a 2^32-offset lease lasts 4096 ops.

- **tracker**: the hook DTensor calls, ``_rng_tracker._distribute_region(spec)`` entered and
  left, measured inside DTensor's real dispatch: ``uniform_`` on a 4-element local shard
  with the tracker enabled, minus the same op with ``distribute_region_enabled = False``.
  That covers the router, the op-name lookup, the fingerprint, the lease check, the CPU
  stream key, and the CPU state set and restore.
- **upstream**: what upstream's tracker does per op on the same spec:
  ``OffsetBasedRNGTracker._compute_rng_offsets(spec)``, the ``_PhiloxState`` pre- and
  post-op offset arithmetic, and a generator state save, set and restore (its fork_rng).
- **kernel**: ``torch.rand`` of 1M float32 on CPU, for scale.

RPCs are counted by thread: ops never send one (leases come from a background thread), so
``rpcs_per_1000_ops`` counts those of the op thread; the background ones are shown apart.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor as dt
import torch.distributed.tensor._random as dtensor_random
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

from rngcoord.client import OffsetBasedRNGTracker, install

SHAPE = (1024, 1024)
WORLD = 4


def start_coordinator(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = workdir / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rngcoord.server.cli", "serve", "--listen", "127.0.0.1:0",
         "--db", f"sqlite:///{workdir / 'bench.db'}", "--metrics", "off",
         "--ready-file", str(ready), "--log-level", "WARNING", "--init"],
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the coordinator did not start")
        time.sleep(0.05)
    return proc, ready.read_text().strip()


def per_op_us(fn: Callable[[], object], ops: int, trials: int) -> float:
    """Median over trials of the mean time of one call, in microseconds."""
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(ops):
            fn()
        samples.append((time.perf_counter() - start) / ops * 1e6)
    return statistics.median(samples)


class RPCCounter:
    """Counts the client's RPC attempts by calling thread."""

    def __init__(self, tracker: OffsetBasedRNGTracker) -> None:
        self.by_thread: dict[str, int] = {}
        client = tracker.client
        call = client._call

        def counted(*args: Any, **kwargs: Any) -> Any:
            name = threading.current_thread().name
            self.by_thread[name] = self.by_thread.get(name, 0) + 1
            return call(*args, **kwargs)

        client._call = counted  # type: ignore[method-assign]


def measure(mesh: Any, tracker: OffsetBasedRNGTracker, ops: int, trials: int) -> dict[str, Any]:
    placements = (Shard(0), Replicate())
    meta = TensorMeta(torch.Size(SHAPE), (SHAPE[1], 1), torch.float32)
    spec = DTensorSpec(mesh, placements, tensor_meta=meta)
    router = dtensor_random._rng_tracker
    assert router is not None

    # Upstream's per-op bookkeeping on the same spec (its tracker cannot be built on CPU;
    # _compute_rng_offsets uses no instance state).
    upstream = object.__new__(dtensor_random.OffsetBasedRNGTracker)
    philox = torch.zeros(16, dtype=torch.uint8)
    generator = torch.default_generator
    other_state = generator.get_state()

    def upstream_op() -> None:
        start, end = upstream._compute_rng_offsets(spec)
        state = dtensor_random._PhiloxState(philox)
        old = state.offset.clone()
        state.offset = old + start
        saved = generator.get_state()
        generator.set_state(other_state)
        state.offset = old + end
        generator.set_state(saved)

    # Ours, inside DTensor's dispatch: a 4-element local shard keeps the kernel negligible.
    tiny = dt.zeros((8, 2), device_mesh=mesh, placements=list(placements))
    tiny.uniform_()  # joins the group, fills the plan cache

    def dispatch_with() -> None:
        tiny.uniform_()

    def dispatch_without() -> None:
        tracker.distribute_region_enabled = False
        tiny.uniform_()
        tracker.distribute_region_enabled = True

    def toggle_only() -> None:
        tracker.distribute_region_enabled = False
        tracker.distribute_region_enabled = True

    def ours_direct() -> None:
        with router._distribute_region(spec):
            pass

    kernel_out = torch.empty(SHAPE)
    counter = RPCCounter(tracker)
    op_thread = threading.current_thread().name
    (manager,) = (m for name, m in tracker.leases.items() if name.startswith("dp:2,tp:2"))
    stalls_before, cursor_before = manager.stats.stalls, manager.cursor
    results: dict[str, list[float]] = {k: [] for k in ("with", "without", "toggle", "up", "direct")}
    for _ in range(trials):  # interleaved, so that load on the machine hits all alike
        results["with"].append(per_op_us(dispatch_with, ops, 1))
        results["without"].append(per_op_us(dispatch_without, ops, 1))
        results["toggle"].append(per_op_us(toggle_only, ops, 1))
        results["up"].append(per_op_us(upstream_op, ops, 1))
        results["direct"].append(per_op_us(ours_direct, ops, 1))
    kernel = per_op_us(lambda: kernel_out.uniform_(), max(ops // 50, 20), trials)
    m = {k: statistics.median(v) for k, v in results.items()}
    overhead = m["with"] - (m["without"] - m["toggle"])
    # Every tracked op moved the cursor: 16 offsets in dispatch, 1M offsets when direct.
    total_ops = 2 * trials * ops
    assert manager.cursor - cursor_before == trials * ops * (16 + SHAPE[0] * SHAPE[1])
    background = sum(n for t, n in counter.by_thread.items() if t != op_thread)
    return {
        "overhead_us_per_op": overhead,
        "direct_us_per_op": m["direct"],
        "upstream_us_per_op": m["up"],
        "kernel_1m_us": kernel,
        "op_thread_rpcs": counter.by_thread.get(op_thread, 0),
        "background_rpcs": background,
        "ops": total_ops,
        "stalls": manager.stats.stalls - stalls_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default=os.environ.get("RNGCOORD_ADDR"))
    parser.add_argument("--ops", type=int, default=2000, help="ops per trial (default 2000)")
    parser.add_argument("--trials", type=int, default=7, help="trials (default 7)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = (None, args.addr) if args.addr else start_coordinator(Path(tmp))
        try:
            result = run(addr, args.ops, args.trials)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait()
    print(f"tracker hook in DTensor dispatch : {result['overhead_us_per_op']:8.2f} us/op")
    print(f"tracker hook, called directly    : {result['direct_us_per_op']:8.2f} us/op")
    print(f"upstream offsets + state set     : {result['upstream_us_per_op']:8.2f} us/op")
    print(f"torch.rand kernel, 1M float32    : {result['kernel_1m_us']:8.2f} us")
    print(
        f"RPCs: {result['op_thread_rpcs']} on the op thread, {result['background_rpcs']} in "
        f"the background, over {result['ops']} ops; {result['stalls']} ops waited for a lease"
    )
    summary = {
        "overhead_ratio_vs_upstream": round(
            result["overhead_us_per_op"] / result["upstream_us_per_op"], 3
        ),
        "overhead_us_per_op": round(result["overhead_us_per_op"], 2),
        "rpcs_per_1000_ops": round(1000 * result["op_thread_rpcs"] / result["ops"], 3),
        "background_rpcs_per_1000_ops": round(1000 * result["background_rpcs"] / result["ops"], 3),
        "direct_us_per_op": round(result["direct_us_per_op"], 2),
        "upstream_us_per_op": round(result["upstream_us_per_op"], 2),
        "overhead_ratio_vs_kernel_1m": round(
            result["overhead_us_per_op"] / result["kernel_1m_us"], 4
        ),
    }
    print(json.dumps(summary))


def run(addr: str, ops: int, trials: int) -> dict[str, Any]:
    _install_threaded_pg()  # type: ignore[no-untyped-call]
    # Per-thread process-group state, as PyTorch's threaded test harness sets it.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
    store = dist.HashStore()  # type: ignore[attr-defined]
    joined = threading.Barrier(WORLD)
    done = threading.Event()
    out: dict[str, Any] = {}
    failures: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            tracker = install(mesh, addr, job=f"bench-{os.getpid()}", seed=1)
            dt.zeros((2, 2), device_mesh=mesh, placements=[Replicate(), Replicate()]).uniform_()
            joined.wait()
            if rank == 0:
                out.update(measure(mesh, tracker, ops, trials))
                done.set()
            done.wait()
            tracker.close()
        except BaseException as e:
            failures.append(e)
            done.set()
            joined.abort()
            raise

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}") for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise SystemExit(f"benchmark failed: {failures[0]!r}")
    return out


if __name__ == "__main__":
    main()
