"""Group seeds: derived from the job's root seed and the group's name, by both sides.

Every group's seed is a pure function of the root seed and the group's name, so two jobs with
the same root seed and the same group names get the same seeds (each group starts at cursor
0), which is what makes a run reproducible from its root seed alone. The coordinator derives
them when a group is created (rngcoord.server.core.barrier) and checks them (`rngcoord verify`);
the client checks a loaded state's streams against them before it restores anything.

The derivation, `group_seed`, is part of the contract:

    digest = SHA-256(b"rngcoord/v1/group-seed\\0" || job_seed as 8 bytes big-endian
                     || group name as UTF-8)
    group_seed = the first 8 bytes of digest, as a big-endian uint64

Worked example: root seed 42, group "tp".

    input  = 72 6e 67 63 6f 6f 72 64 2f 76 31 2f 67 72 6f 75 70 2d 73 65 65 64 00
             ("rngcoord/v1/group-seed\\0")
             00 00 00 00 00 00 00 2a   (42)
             74 70                     ("tp")
    digest = 6ad612a92a154db65facd08f56d15175f617fb945f4ffe8850c67491f4bc8c19
    seed   = 0x6ad612a92a154db6 = 7698361130801253814

>>> group_seed(42, "tp")
7698361130801253814
>>> hex(group_seed(42, "tp"))
'0x6ad612a92a154db6'
"""

from __future__ import annotations

import hashlib
from typing import Final

__all__ = ["GROUP_SEED_DOMAIN", "group_seed"]

GROUP_SEED_DOMAIN: Final = b"rngcoord/v1/group-seed\0"
"""Prefix of the hashed input; it keeps these digests apart from any other use of SHA-256."""


def group_seed(job_seed: int, group: str) -> int:
    """The seed of `group` in a job whose root seed is `job_seed` (a uint64)."""
    data = GROUP_SEED_DOMAIN + job_seed.to_bytes(8, "big") + group.encode("utf-8")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
