"""Groups: which ranks share a random stream, and the names the coordinator knows them by.

By default every distinct DeviceMesh that runs a random op is its own group. A mesh is
identified by its dimension names, its shape and the global ranks it holds in flattened
order; a rank joins the group with its position in that order as the group rank. Ranks
outside a sub-mesh never join its group, so they hold none of its state.

Names are readable where they can be and satisfy the contract's name rule
(:data:`rngcoord.v1.rules.NAME_PATTERN`), falling back to a digest when the readable form is
too long or has other characters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from rngcoord.v1.rules import NAME_PATTERN

_MAX_NAME = 128
_SHARED_PREFIX = "all@"


@dataclass(frozen=True)
class GroupSpec:
    """One group as seen from one rank.

    Attributes:
        name: The group's name on the coordinator.
        rank: This rank's position in the group, in [0, world_size).
        world_size: Number of ranks in the group.
    """

    name: str
    rank: int
    world_size: int


def _ranks_text(ranks: Sequence[int]) -> str:
    """Ranks in order, with runs of consecutive ranks written ``a-b``: ``0-3``, ``0.2``."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(
            f"{ranks[i]}-{ranks[j]}" if j > i + 1 else ".".join(map(str, ranks[i : j + 1]))
        )
        i = j + 1
    return ".".join(parts)


def group_name(dim_names: Sequence[str] | None, shape: Sequence[int], ranks: Sequence[int]) -> str:
    """The coordinator name of the mesh with these dimension names, shape and ranks.

    >>> group_name(("dp", "tp"), (2, 2), [0, 1, 2, 3])
    'dp:2,tp:2[0-3]'
    >>> group_name(("tp",), (2,), [2, 3])
    'tp:2[2.3]'
    >>> group_name(None, (4,), [0, 2, 4, 6])
    'd0:4[0.2.4.6]'

    Names that would break the coordinator's rule (too long, other characters) keep a readable
    prefix where possible and end in a digest of the whole identity:

    >>> group_name(("dp",), (64,), list(range(0, 128, 2)))
    'dp:64[sha:b255db686f49bb79]'
    """
    names = list(dim_names) if dim_names else [f"d{i}" for i in range(len(shape))]
    dims = ",".join(f"{n}:{s}" for n, s in zip(names, shape, strict=True))
    readable = f"{dims}[{_ranks_text(ranks)}]"
    if NAME_PATTERN.fullmatch(readable):
        return readable
    identity = repr((tuple(names), tuple(shape), tuple(ranks))).encode()
    digest = f"[sha:{hashlib.sha256(identity).hexdigest()[:16]}]"
    prefix = dims if NAME_PATTERN.fullmatch(dims + digest) else "mesh"
    return prefix + digest


def mesh_group(mesh: DeviceMesh, global_rank: int) -> GroupSpec:
    """The group of ``mesh`` as seen by ``global_rank``, which must be one of its ranks."""
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if global_rank not in ranks:
        raise ValueError(f"rank {global_rank} is not part of {mesh}")
    name = group_name(mesh.mesh_dim_names, tuple(mesh.mesh.shape), ranks)
    return GroupSpec(name=name, rank=ranks.index(global_rank), world_size=len(ranks))


def shared_group(mesh: DeviceMesh, global_rank: int) -> GroupSpec:
    """The one group that every mesh shares with ``shared_stream=True``: the install mesh's
    ranks, named ``all@`` followed by the mesh's name."""
    own = mesh_group(mesh, global_rank)
    name = _SHARED_PREFIX + own.name
    if len(name) > _MAX_NAME:
        name = (
            _SHARED_PREFIX + "mesh[sha:" + hashlib.sha256(own.name.encode()).hexdigest()[:16] + "]"
        )
    return GroupSpec(name=name, rank=own.rank, world_size=own.world_size)
