"""Throughput of rngcoord's portable (sharding-invariant) random ops against torch's own.

One run, side by side on each device (CPU always, CUDA when torch sees a GPU), for 2^24
float32 values (``--log2-size``):

- **rand**: ``portable_fill_("uniform_", ...)`` into a preallocated tensor vs ``torch.rand``.
- **randn**: ``portable_fill_("normal_", ...)`` vs ``torch.randn``.
- **dropout**: ``_portable.dropout`` (output and mask, p=0.1) vs ``torch.native_dropout``.

Each figure is the median of ``--trials`` timed runs after one warm-up (CUDA synchronized
around each); ``--threads`` sets torch's CPU threads for both sides. The portable ops run
~100-150 kernels per 2^18-block chunk, so on an oversubscribed CPU each kernel's thread
barrier costs far more than in torch's single-kernel ops: compare on an idle machine. The
portable ops draw the whole tensor as one shard, the tracker's heaviest case. Progress lines
go to stdout; the last line printed is one JSON object with ``ratio_to_torch_<op>_<device>``
(portable time / torch time) and the elements per second of both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from rngcoord.client import _portable

SEED = 0x5EED_0F_7E57
P_DROP = 0.1


def timed(fn: Callable[[], object], device: torch.device, trials: int) -> float:
    """Median seconds of ``fn`` over ``trials`` runs, after one warm-up run."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cases(
    n: int, device: torch.device
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """op -> (portable, torch) callables for ``n`` float32 values on ``device``."""
    out = torch.empty(n, device=device)
    x = torch.ones(n, device=device)
    where: dict[str, Any] = {
        "seed": SEED,
        "base_offset": 0,
        "global_shape": (n,),
        "local_ranges": None,
    }
    return {
        "rand": (
            lambda: _portable.portable_fill_("uniform_", out, **where),
            lambda: torch.rand(n, device=device),
        ),
        "randn": (
            lambda: _portable.portable_fill_("normal_", out, **where),
            lambda: torch.randn(n, device=device),
        ),
        "dropout": (
            lambda: _portable.dropout(SEED, 0, (n,), None, x, p=P_DROP),
            lambda: torch.native_dropout(x, P_DROP, True),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-size", type=int, default=24, help="values per op: 2^N (24)")
    parser.add_argument("--trials", type=int, default=5, help="timed runs per figure (5)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads for both sides (0: torch's)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = 1 << args.log2_size
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    summary: dict[str, float | int | str] = {
        "elements": n,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
    }
    for device in devices:
        for op, (ours, theirs) in cases(n, device).items():
            t_ours = timed(ours, device, args.trials)
            t_theirs = timed(theirs, device, args.trials)
            ratio = t_ours / t_theirs
            print(
                f"{device.type:4} {op:8} portable {n / t_ours / 1e6:9.1f} M/s   "
                f"torch {n / t_theirs / 1e6:9.1f} M/s   ratio {ratio:5.2f}",
                flush=True,
            )
            summary[f"ratio_to_torch_{op}_{device.type}"] = round(ratio, 3)
            summary[f"portable_{op}_{device.type}_elements_per_s"] = round(n / t_ours)
            summary[f"torch_{op}_{device.type}_elements_per_s"] = round(n / t_theirs)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
