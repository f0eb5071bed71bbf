"""How long a torchft heal waits on rngcoord, side by side with a restart that does not heal.

A heal (rngcoord.client.torchft) reaches the coordinator when the healed replica's first
random op joins its group: every rank joins the group's new epoch, restores the peer's
position (one Restore, voted by every rank) and takes its first lease. A replica that comes
back without a heal does the same but the Restore. Both are measured here, at 2 and at 64
ranks per replica, from the moment the peer's state has arrived to the last rank's first
lease, on real LeaseManagers (the tracker's per-group client) against a coordinator this
script starts (SQLite), one thread per simulated rank.

Each trial is a job of its own with three replicas: replica 0 draws (the peer), then the
replicas 1 and 2 draw and die (their members never leave); then replica 1 comes back and
heals from replica 0's state, and replica 2 comes back without one. The last line printed is
one JSON object.

    python bench/heal.py [--trials 5] [--worlds 2,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rngcoord.client import CoordinatorClient, LeaseManager
from rngcoord.client._leases import LeaseSchedule, StreamState
from tracker import start_coordinator

SEED = 0x4EA1
OP = (b"dropout(64, 256)", 16384)  # one op's key and offsets
OPS_BEFORE = 20


def epoch(
    client: CoordinatorClient,
    job: str,
    group: str,
    world: int,
    tag: str,
    resume: StreamState | None = None,
) -> tuple[float, list[LeaseManager]]:
    """Every rank joins the group's next epoch (with ``resume``, restoring it) and draws one
    op. Returns the seconds from the start to the last rank's first op, and the managers."""
    managers: list[LeaseManager | None] = [None] * world
    done = [0.0] * world
    failures: list[BaseException] = []
    go = threading.Barrier(world + 1)

    def rank_main(rank: int) -> None:
        try:
            go.wait()
            member = f"{tag}-{rank}"
            joined = client.join_group(
                job, group, rank=rank, world_size=world, member_id=member, job_seed=SEED,
                launch=f"replica:{job}/{group}",
            )  # fmt: skip
            manager = LeaseManager(
                client, job, group, rank=rank, member_id=member, joined=joined,
                schedule=LeaseSchedule(), resume=resume,
            )  # fmt: skip
            manager.advance(OP[1], OP[0])
            done[rank] = time.perf_counter()
            managers[rank] = manager
        except BaseException as exc:  # reported below, with the rank
            failures.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return max(done) - start, [m for m in managers if m is not None]


def trial(client: CoordinatorClient, world: int, n: int) -> tuple[float, float]:
    """(heal seconds, restart seconds) of one job."""
    job = f"heal-{world}-{n}"
    name = f"tp:{world}[0-{world - 1}]"
    peers: dict[str, list[LeaseManager]] = {}
    for replica in ("0", "1", "2"):
        _, ranks = epoch(client, job, f"{name}/replica:{replica}", world, f"r{replica}a")
        for manager in ranks:
            for _ in range(OPS_BEFORE - 1 if replica == "0" else OPS_BEFORE // 2):
                manager.advance(OP[1], OP[0])
        peers[replica] = ranks
    sent = peers["0"][0].state
    for replica, ranks in peers.items():
        for manager in ranks:
            # Replica 0 lives on; the members of replicas 1 and 2 die without leaving.
            manager.close(leave=replica == "0")
    # Replica 1 heals from replica 0's position; replica 2 comes back without a heal.
    heal_s, healed = epoch(client, job, f"{name}/replica:1", world, "r1b", resume=sent)
    restart_s, restarted = epoch(client, job, f"{name}/replica:2", world, "r2b")
    assert all(m.state.cursor == sent.cursor + OP[1] for m in healed), "the heal did not restore"
    for manager in (*healed, *restarted):
        manager.close()
    return heal_s, restart_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--worlds", default="2,64", help="ranks per replica, comma-separated")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_coordinator(Path(tmp))
        try:
            client = CoordinatorClient(addr)
            for world in worlds:
                heals, restarts = [], []
                for n in range(args.trials):
                    heal_s, restart_s = trial(client, world, n)
                    heals.append(heal_s)
                    restarts.append(restart_s)
                    print(
                        f"  {world} ranks, trial {n + 1}/{args.trials}: heal {heal_s * 1e3:.0f} ms"
                        f", restart {restart_s * 1e3:.0f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
                heal, restart = statistics.median(heals), statistics.median(restarts)
                results[str(world)] = {
                    "heal_ms": round(heal * 1e3, 1),
                    "restart_ms": round(restart * 1e3, 1),
                    "heal_over_restart": round(heal / restart, 2),
                }
                print(
                    f"{world:>3} ranks per replica: heal {heal * 1e3:7.1f} ms, restart without "
                    f"a heal {restart * 1e3:7.1f} ms, ratio {heal / restart:.2f} "
                    f"(medians of {args.trials})"
                )
            client.close()
        finally:
            proc.terminate()
            proc.wait()
    print(json.dumps({"trials": args.trials, "ranks_per_replica": results}))


if __name__ == "__main__":
    main()
