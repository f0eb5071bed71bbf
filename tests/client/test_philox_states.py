"""The exact Philox states the tracker sets, on a registered fake cuda-like device.

The device ("fakegpu", tests/client/programs.py) keeps a 16-byte (seed uint64, offset int64)
generator state like CUDA's and logs every state set. Four thread-ranks on a 2x2 mesh run
uniform_, normal_, bernoulli_, dropout and rand_like with lease size 32, so ops span and cross
lease boundaries. Before each op the device must hold (group seed, base + shard start) and
after it (group seed, base + roundup4(numel)), where the group seed is the coordinator's
documented derivation from the job's root seed, the bases are the running sum of the ops'
sizes, and the shard starts follow rngcoord's layout (tracker.shard_offsets, checked as a
property in test_layout.py): upstream DTensor's own `_compute_rng_offsets` where its shards
cannot overlap, the aligned layout elsewhere.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from programs import run_threads

pytestmark = pytest.mark.slow

ROOT_SEED = 424242
GROUP = "dp:2,tp:2[0-3]"
# The ops (by index) whose shards upstream lays out without overlap: their offsets are kept.
UPSTREAM_LAYOUT = {0, 3, 5}


def group_seed(job_seed: int, group: str) -> int:
    """The coordinator's group seed (SPEC: proto/rngcoord/v1/seeds.py), computed independently."""
    digest = hashlib.sha256(
        b"rngcoord/v1/group-seed\0" + job_seed.to_bytes(8, "big") + group.encode("utf-8")
    ).digest()
    return int.from_bytes(digest[:8], "big")


def test_tracker_sets_dtensor_philox_states(coordinator: Any, tmp_path: Path) -> None:
    results = run_threads("fake_device", 4, tmp_path, addr=coordinator.address, seed=ROOT_SEED)
    seed = group_seed(ROOT_SEED, GROUP)
    for rank, result in enumerate(results):
        assert result["group"] == GROUP and result["job_seed"] == ROOT_SEED
        base = 0
        for i, op in enumerate(result["ops"]):
            start, end = op["offsets"]
            if i in UPSTREAM_LAYOUT:
                assert op["offsets"] == op["upstream"]
            assert op["sets"] == [(seed, base + start), (seed, base + end)], (rank, op)
            base += end
        # Six ops over leases of 32: most span or cross a boundary. normal_ (5, 3), bernoulli_
        # (6,) and rand_like (3, 7) have shards of 9, 3 and 8 elements that upstream would
        # overlap: aligned, they end at 24, 8 and 32 instead of 16, 8 and 24.
        assert [op["offsets"][1] for op in result["ops"]] == [64, 24, 8, 40, 32, 40]
        assert base == 208

        # CUDA's path: _compute_rng_offsets sets (seed, base) and returns DTensor's offsets.
        hop = result["hop"]
        assert hop["cursor"] == base
        assert hop["offsets"] == hop["upstream"]
        assert hop["sets"] == [(seed, base)]
        assert hop["cursor_after"] == base + hop["upstream"][1]

        # An op reaching 2^63 is refused with a clear error and leaves the stream alone.
        cursor = (1 << 63) - 32
        assert "signed 64-bit" in result["exhausted"] and "2^63" in result["exhausted"]
        assert result["cursor_after_refusal"] == cursor
        assert result["last_sets"] == [(seed, cursor), (seed, cursor + 16)]
    # Replicas of a shard get the same states, and the shards of an op different ones.
    first = [r["ops"][0]["sets"][0] for r in results]
    assert len(set(first)) == 4
    dropout = [r["ops"][3]["sets"] for r in results]
    assert all(d == dropout[0] for d in dropout)
