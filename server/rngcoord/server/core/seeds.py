"""Seeds: the job's root seed, drawn here when the first join of a job carries none.

A job's root seed is fixed by the first JoinGroup that names the job. Group seeds derive from
it and the group's name by the contract's rule, `rngcoord.v1.seeds.group_seed` (with a worked
example), which the client checks loaded states against too; it is re-exported here as
`rngcoord.server.group_seed`.
"""

from __future__ import annotations

import secrets

from rngcoord.v1.seeds import GROUP_SEED_DOMAIN, group_seed

__all__ = ["GROUP_SEED_DOMAIN", "draw_job_seed", "group_seed"]


def draw_job_seed() -> int:
    """A fresh uniformly random uint64 root seed, from the OS's CSPRNG."""
    return secrets.randbits(64)
