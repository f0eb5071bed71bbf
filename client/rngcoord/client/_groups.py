"""Groups: which ranks share a random stream, and the names the coordinator knows them by.

A mesh is identified by its dimension names, its shape and the global ranks it holds in
flattened order; a rank joins the group with its position in that order as the group rank.
The install mesh (the *root*) and every mesh that is not a slice of it are their own groups.

A **sub-mesh** (a slice of the root, such as ``root["tp"]``) has copies along the root's
other dimensions. As in DTensor, whose one device generator is shared by every copy, the
copies along *replicate* dimensions draw the same numbers: they form one group, named after
the sub-mesh's dims and shape and the union of their ranks. Copies along *split* dimensions
(pipeline stages by default: dims named ``pp*`` or ``pipe*``) run different op sequences, so
each keeps its own group: they never share numbers, and never trip a false divergence.
(:func:`stream_group`; docs/design.md §5.4.) Ranks outside a group never join it, and a
sub-mesh's ops never move another group's cursor.

- dp x tp root ``("dp", "tp")`` = ``[[0, 1], [2, 3]]``: ``root["tp"]`` on rank 2 is ``[2, 3]``;
  its copy ``[0, 1]`` lies along ``dp``, a replicate dim, so both are the group
  ``tp:2[0-3]`` and rank 2 draws what rank 0 draws: a TP weight is equal on every dp replica.
- dp x pp x tp root ``(2, 2, 2)``: ``root["tp"]`` on rank 5 (dp 1, pp 0, tp 1) is ``[4, 5]``; its
  copies along ``dp`` join it, those along ``pp`` do not: the group is ``tp:2[0-1.4-5]``,
  and stage pp=1 draws from ``tp:2[2-3.6-7]``.
- HSDP ``("dp_replicate", "dp_shard", "tp")``: every dim replicates, so ``root["tp"]`` is one
  group over all 8 ranks and ``root["dp_replicate", "dp_shard"]`` another: FSDP-sharded TP
  weights match upstream's layout.

Which policy drew a group shows in its name: ``sharding_invariant`` streams are named
``invariant`` or ``invariant[<split dims>]`` (:func:`invariant_group`), and no mesh's name has
that form, since a mesh's name always gives its dims as ``name:size`` (:func:`policy_of`).

Names are readable where they can be and satisfy the contract's name rule
(:data:`rngcoord.v1.rules.NAME_PATTERN`), falling back to a digest when the readable form is
too long or has other characters.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from rngcoord.v1.rules import NAME_PATTERN

_MAX_NAME = 128
_SHARED_PREFIX = "all@"
#: Name prefixes of the root's dims that split sub-mesh streams by default (pipeline stages).
SPLIT_PREFIXES = ("pp", "pipe")


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
    """Ranks in order, ``.``-separated, each run of consecutive ranks written ``a-b``: ``0-3``,
    ``0-1.4-5``, ``0.2``. One form for every run, so a 2-rank group reads like a 4-rank one."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(f"{ranks[i]}-{ranks[j]}" if j > i else str(ranks[i]))
        i = j + 1
    return ".".join(parts)


def group_name(dim_names: Sequence[str] | None, shape: Sequence[int], ranks: Sequence[int]) -> str:
    """The coordinator name of the mesh with these dimension names, shape and ranks.

    >>> group_name(("dp", "tp"), (2, 2), [0, 1, 2, 3])
    'dp:2,tp:2[0-3]'
    >>> group_name(("tp",), (2,), [2, 3])
    'tp:2[2-3]'
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


def is_split_dim(name: str | None, split_dims: Collection[str] | None) -> bool:
    """Whether copies of a sub-mesh along the root dim ``name`` draw separate numbers:
    ``name`` is in ``split_dims``, or, when that is None, starts with ``pp`` or ``pipe``."""
    if name is None:
        return False
    if split_dims is None:
        return name.startswith(SPLIT_PREFIXES)
    return name in split_dims


def _locate(root: DeviceMesh, ranks: torch.Tensor) -> torch.Tensor | None:
    """The coordinates in ``root`` of each of ``ranks`` (one row each), or None when one of
    them is not in ``root``. Tensor ops throughout: a root of 10^5 ranks takes milliseconds."""
    grid = root.mesh.flatten()
    size = int(max(int(grid.max()), int(ranks.max()))) + 1
    where = torch.full((size,), -1, dtype=torch.long)
    where[grid] = torch.arange(grid.numel())
    positions = where[ranks]
    if bool((positions < 0).any()):
        return None
    return torch.stack(torch.unravel_index(positions, tuple(root.mesh.shape)), dim=1)


def _ranks_with(root: DeviceMesh, coordinate: torch.Tensor, dims: Collection[int]) -> list[int]:
    """The root's ranks, sorted, whose coordinates on ``dims`` are ``coordinate``'s."""
    index = tuple(int(coordinate[d]) if d in dims else slice(None) for d in range(root.ndim))
    return sorted(int(r) for r in root.mesh[index].flatten().tolist())


def stream_group(
    mesh: DeviceMesh,
    global_rank: int,
    root: DeviceMesh | None,
    split_dims: Collection[str] | None = None,
) -> GroupSpec:
    """The group whose stream random ops on ``mesh`` draw from, seen by ``global_rank``.

    ``mesh``'s own group unless it is a proper slice of ``root`` with copies along replicate
    dims (see the module docstring); then the union of those copies.

    Args:
        mesh: The mesh of the DTensor; must hold ``global_rank``.
        global_rank: The calling rank.
        root: The install mesh. None: every mesh is its own group.
        split_dims: Names of root dims whose copies draw separately. Default None: dims named
            ``pp*`` or ``pipe*``.
    """
    own = mesh_group(mesh, global_rank)
    if root is None:
        return own
    ranks = mesh.mesh.flatten()
    if ranks.numel() == root.mesh.numel():
        return own  # the root itself, perhaps reshaped
    coords = _locate(root, ranks)
    if coords is None:
        return own  # a mesh across roots
    mine = coords[own.rank]
    fixed = [d for d in range(root.ndim) if bool((coords[:, d] == mine[d]).all())]
    # The mesh's ranks all lie in the slice through `mine` along the other dims; it is that
    # slice when it holds as many distinct ranks.
    slice_size = math.prod(root.mesh.shape[d] for d in range(root.ndim) if d not in fixed)
    if torch.unique(ranks).numel() != ranks.numel() or ranks.numel() != slice_size:
        return own  # not a slice: a hand-built mesh of some of the root's ranks
    names = root.mesh_dim_names or (None,) * root.ndim
    split = [d for d in fixed if is_split_dim(names[d], split_dims)]
    union = _ranks_with(root, mine, split)
    if len(union) == ranks.numel():
        return own
    name = group_name(mesh.mesh_dim_names, tuple(mesh.mesh.shape), union)
    return GroupSpec(name=name, rank=bisect.bisect_left(union, global_rank), world_size=len(union))


def invariant_group(
    root: DeviceMesh, global_rank: int, split_dims: Collection[str] | None = None
) -> GroupSpec:
    """The stream of every mesh under the ``sharding_invariant`` policy: one per job and
    pipeline stage, named without the mesh's shape or ranks so that a resized job joins the
    same stream (``invariant``, or ``invariant[pp:1]`` with the stage's coordinates on the
    split dims). Its members are the root's ranks with this rank's split coordinates."""
    located = _locate(root, torch.tensor([global_rank]))
    if located is None:
        raise ValueError(f"rank {global_rank} is not part of {root}")
    mine = located[0]
    names = root.mesh_dim_names or (None,) * root.ndim
    split = [d for d in range(root.ndim) if is_split_dim(names[d], split_dims)]
    ranks = _ranks_with(root, mine, split)
    suffix = ",".join(f"{names[d]}:{int(mine[d])}" for d in split)
    name = f"invariant[{suffix}]" if suffix else "invariant"
    return GroupSpec(name=name, rank=bisect.bisect_left(ranks, global_rank), world_size=len(ranks))


_INVARIANT_NAME = re.compile(r"invariant(\[[^\]]*\])?(/replica:[A-Za-z0-9._-]+)?(/seed:\d+)?")
_MESH_NAME = re.compile(
    r"(?:all@)?(?P<dims>[^\[]*)\[(?P<ranks>[0-9.\-]+)\](?:/replica:[A-Za-z0-9._-]+)?(?:/seed:\d+)?"
)


def replica_name(name: str, replica: str) -> str:
    """The name of group ``name`` among replica ``replica``'s groups: ``name`` with
    ``/replica:<replica>`` appended, or a digest of ``name`` where that would be too long for
    the contract's name rule. Each replica of a job draws from groups of its own, whose seeds
    differ (they derive from the group name).

    >>> replica_name("dp:2,tp:2[0-3]", "1")
    'dp:2,tp:2[0-3]/replica:1'
    """
    return with_suffix(name, f"/replica:{replica}")


def with_suffix(name: str, suffix: str) -> str:
    """``name`` with ``suffix`` appended, or a digest of ``name`` with it where that would
    break the contract's name rule (too long): the counterpart of a group among another set
    of streams (a replica's, a manual_seed base's)."""
    if NAME_PATTERN.fullmatch(name + suffix):
        return name + suffix
    return f"sha:{hashlib.sha256(name.encode()).hexdigest()[:32]}{suffix}"


def policy_of(name: str) -> str:
    """The policy whose streams have group name ``name``: ``"sharding_invariant"`` for
    :func:`invariant_group`'s names (scoped by manual_seed or not), ``"offsets"`` otherwise.

    >>> policy_of("invariant"), policy_of("invariant[pp:1]/seed:5"), policy_of("tp:2[0-1]")
    ('sharding_invariant', 'sharding_invariant', 'offsets')
    """
    return "sharding_invariant" if _INVARIANT_NAME.fullmatch(name) else "offsets"


def mesh_of_name(name: str) -> tuple[tuple[str, ...], tuple[int, ...], list[int]] | None:
    """The dim names, shape and ranks of an offsets-policy group name, or None where the name
    does not give them (a digest, an invariant stream).

    >>> mesh_of_name("dp:2,tp:2[0-3]")
    (('dp', 'tp'), (2, 2), [0, 1, 2, 3])
    >>> mesh_of_name("tp:2[0-1]/seed:7")
    (('tp',), (2,), [0, 1])
    >>> mesh_of_name("tp:2[0-1]/replica:1")
    (('tp',), (2,), [0, 1])
    """
    match = _MESH_NAME.fullmatch(name)
    if match is None:
        return None
    try:
        dims = [part.rsplit(":", 1) for part in match["dims"].split(",")]
        names = tuple(d for d, _ in dims)
        shape = tuple(int(n) for _, n in dims)
        ranks: list[int] = []
        for part in match["ranks"].split("."):
            first, _, last = part.partition("-")
            ranks.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        return None
    return names, shape, ranks
