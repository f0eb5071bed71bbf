"""A client process for test_replicas.py: members of groups that reserve leases in a loop.

    python tests/server/replica_client.py --targets A,B --job J --member GROUP:RANK ...
        --world-size 2 --stop PATH --ready PATH

Each `--member` runs in its own thread with its own `CoordinatorClient` (the targets in the
order given, so the first one is its replica until that fails). It joins the group, then asks
for lease seq 0, 1, 2, ... until the file `--stop` exists; the file `--ready` is created once
every member has joined. Every reply is printed at once as
one JSON object per line: {"group", "rank", "member_id", "secret", "epoch", "seq", "seed",
"start", "end", "existing"} (secret: the member's credential, in hex, so that the test can
read the leases back as that member). Exit 0 when every member stopped cleanly, 1 (with the
error on stderr) when any call failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":
    # First, before the imports that take seconds (torch, under rngcoord.client): a storm
    # that stalls asks for every thread's stack (Storm.diagnostics), and one that is still
    # starting shows where, rather than dying of the signal.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

from rngcoord.client import CoordinatorClient
from rngcoord.client._connection import member_secret

FINGERPRINT = b"\x01" * 16


def lease_size(seq: int) -> int:
    """Lease sizes vary with seq, so a misplaced start shows up as an overlap."""
    return 4096 * (1 + seq % 7)


def run_member(
    targets: list[str],
    job: str,
    group: str,
    rank: int,
    world_size: int,
    stop: Path,
    joined: Callable[[], None] = lambda: None,
) -> None:
    """Join `group` as `rank`, call `joined`, then reserve leases until `stop` exists,
    printing each."""
    member_id = f"m{rank}-{uuid.uuid4().hex[:8]}"
    with CoordinatorClient(targets, deadline_s=5.0, outage_s=10.0, backoff_s=0.05) as client:
        epoch = client.join_group(
            job, group, rank=rank, world_size=world_size, member_id=member_id, timeout_s=60
        ).epoch
        joined()
        seq = 0
        while not stop.exists():
            lease = client.reserve(
                job,
                group,
                epoch=epoch,
                seq=seq,
                size=lease_size(seq),
                fingerprint=FINGERPRINT,
                rank=rank,
                member_id=member_id,
            )
            record = {
                "group": group,
                "rank": rank,
                "member_id": member_id,
                "secret": member_secret(member_id).hex(),
                "epoch": epoch,
                "seq": seq,
                "seed": lease.seed,
                "start": lease.start,
                "end": lease.end,
                "existing": lease.existing,
            }
            # One write per line, flushed: a reader sees whole lines even while we run.
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()
            seq += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", required=True, help="comma-separated HOST:PORT list")
    parser.add_argument("--job", required=True)
    parser.add_argument("--member", action="append", required=True, help="GROUP:RANK")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--stop", type=Path, required=True, help="stop once this file exists")
    parser.add_argument(
        "--ready", type=Path, required=True, help="created once every member has joined"
    )
    args = parser.parse_args()

    targets = args.targets.split(",")
    failures: list[BaseException] = []
    lock, waiting = threading.Lock(), [len(args.member)]

    def joined() -> None:
        with lock:
            waiting[0] -= 1
            if waiting[0] == 0:
                args.ready.touch()

    def member(spec: str) -> None:
        group, _, rank = spec.rpartition(":")
        try:
            run_member(targets, args.job, group, int(rank), args.world_size, args.stop, joined)
        except BaseException as exc:
            failures.append(exc)
            print(f"member {spec} failed: {exc!r}", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=member, args=(spec,)) for spec in args.member]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
