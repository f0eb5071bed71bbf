"""The coordinator-backed tracker of one rank: :class:`OffsetBasedRNGTracker`.

The default policy: one stream per group (by default one per (sub)mesh), whose seed, epoch
and leases come from the coordinator; it joins each group on its first random op, draws
from prefetched leases (:mod:`rngcoord.client._leases`), and saves and loads the streams'
positions (``state_dict``/``load_state_dict``: resume, resize, a replica's heal). It
subclasses PyTorch's ``OffsetBasedRNGTracker`` because DTensor's CUDA path asserts that
class; it never runs the upstream ``__init__``, which raises on CPU meshes and broadcasts
rank 0's device state. How an op's offsets are laid out and reach the device is
:class:`rngcoord.client.RNGStateTracker`'s, which it extends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import types
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed.tensor._random as dtensor_random
from torch.distributed.device_mesh import DeviceMesh

from rngcoord.client._connection import CoordinatorClient
from rngcoord.client._errors import (
    CoordinatorUnavailable,
    InvalidRequest,
    JoinTimeoutError,
    NotFoundError,
    RNGCoordError,
    StoreMismatchError,
)
from rngcoord.client._groups import (
    GroupSpec,
    is_split_dim,
    mesh_of_name,
    policy_of,
    replica_name,
    shared_group,
    with_suffix,
)
from rngcoord.client._leases import (
    ATTEST_MIN_S,
    INITIAL_DIGEST,
    LeaseManager,
    LeaseSchedule,
    StreamState,
)
from rngcoord.client._router import unregister
from rngcoord.client._tracker import (
    CompiledOps,
    Policy,
    RNGStateTracker,
    Stream,
    check_in_mesh,
    streams_of,
)
from rngcoord.v1.rules import REPLICA_PATTERN
from rngcoord.v1.seeds import group_seed
from rngcoord.v1.types import JoinResult

logger = logging.getLogger("rngcoord.client.coordinated")
_T = TypeVar("_T")


# mypy sees upstream's @contextmanager _distribute_region and ours as different signatures;
# both return a context manager over the region.
class OffsetBasedRNGTracker(  # type: ignore[misc]
    RNGStateTracker, dtensor_random.OffsetBasedRNGTracker
):
    """The coordinator-backed tracker of one rank: DTensor's offset policy over leases.

    Each group (by default each (sub)mesh that runs a random op; with ``shared_stream`` one
    group for every mesh) is joined on its first random op: a JoinGroup barrier of the
    mesh's ranks that returns the group's seed, epoch and start cursor. Ops then draw from
    leases that a background thread prefetches; see :mod:`rngcoord.client._leases`.

    Args:
        device_mesh: The job's mesh. Its device type picks the generator, and with
            ``shared_stream`` its ranks form the one group.
        client: The coordinator connection.
        job: The job name.
        seed: The job's root seed (uint64). Default ``None``: the job's recorded seed, or one
            the coordinator draws when the job is new.
        lease_size: Offsets in every lease, a multiple of 4, equal on every rank. Default
            ``None``: leases sized to the work (:class:`~rngcoord.client._leases.LeaseSchedule`),
            so that the RPCs per step stay bounded whatever the tensor sizes.
        shared_stream: One stream for every mesh, over ``device_mesh``'s ranks, instead of
            one per (sub)mesh. Default ``False``.
        join_timeout_s: How long a JoinGroup barrier waits for the mesh's other ranks.
            Default 60.0.
        owns_client: Close ``client`` in :meth:`close`. Default ``False``.
        split_dims: Names of ``device_mesh``'s dims whose sub-mesh copies draw separate
            numbers (:func:`rngcoord.client._groups.stream_group`). Default ``None``: dims
            named ``pp*`` or ``pipe*``; every other dim replicates, as in DTensor.
        policy: ``"offsets"`` (default) or ``"sharding_invariant"``; see
            :class:`RNGStateTracker`.
        compiled_random_ops: What a traced DTensor random op does. Default ``"eager"``: the
            graph draws it from the leases when it runs, as eager would. See
            :class:`RNGStateTracker`.
        trace: A per-op JSONL trace path (``{rank}``: the rank), flushed at :meth:`close`;
            see :class:`RNGStateTracker`. Default ``None``.
        attest_min_s: Attest about this often at most; see
            :class:`~rngcoord.client.LeaseManager`. Default 30.0.
        replica: The replica group this process belongs to (a torchft replica): its groups
            are its own, named with ``/replica:<replica>``, so that same-shaped meshes of
            different replicas never share a group, and their seeds differ. Default
            ``None``: no replica.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        client: CoordinatorClient,
        job: str,
        seed: int | None = None,
        lease_size: int | None = None,
        shared_stream: bool = False,
        join_timeout_s: float = 60.0,
        owns_client: bool = False,
        split_dims: Sequence[str] | None = None,
        policy: Policy = "offsets",
        compiled_random_ops: CompiledOps = "eager",
        trace: str | os.PathLike[str] | None = None,
        attest_min_s: float = ATTEST_MIN_S,
        replica: str | None = None,
    ) -> None:
        # Upstream's __init__ is deliberately not called: it raises on CPU meshes and
        # broadcasts rank 0's device state, which the coordinator makes unnecessary.
        RNGStateTracker.__init__(
            self,
            device_mesh.device_type,
            root=device_mesh,
            split_dims=split_dims,
            policy=policy,
            compiled_random_ops=compiled_random_ops,
            trace=trace,
        )
        check_in_mesh(device_mesh, self.rank, "install()")
        if seed is not None and not 0 <= seed < 1 << 64:
            raise InvalidRequest(f"seed must be a uint64, got {seed}")
        if replica is not None and not REPLICA_PATTERN.fullmatch(replica):
            raise InvalidRequest(
                f"replica must be 1 to 48 letters, digits, '.', '_' or '-', starting with a "
                f"letter or digit; got {replica!r}"
            )
        self.replica = replica
        # A bad size fails here, at install(), not at the first random op. Offsets past 2^63
        # on Philox devices are refused per op (_devices.check_philox_offset), since CPU
        # streams may use the whole uint64 range.
        self.schedule = LeaseSchedule(fixed=lease_size)
        self.client = client
        self.job = job
        self.shared_stream = shared_stream
        self.join_timeout_s = join_timeout_s
        self.attest_min_s = attest_min_s
        self.member_id = f"r{self.rank}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.device_mesh = device_mesh
        self._job_seed = seed
        self._owns_client = owns_client
        self._managers: dict[str, LeaseManager] = {}
        self._recording = False  # record_ops(): groups joined from now on record too
        self._pending: dict[str, dict[str, Any]] = {}
        # The job whose state a pending stream came from, where not this one (audited).
        self._pending_from: dict[str, str] = {}
        self._join_lock = threading.Lock()
        self._shared = shared_group(device_mesh, self.rank) if shared_stream else None
        self._expected_store: str | None = None
        self._saved_head = ""
        # The base seed whose streams ops draw from (manual_seed), None for the root seed's,
        # and the scope of every joined group.
        self._scope: int | None = None
        self._scopes: dict[str, int | None] = {}
        #: Streams of the last loaded state that cannot rewind onto this mesh (a resize under
        #: the offsets policy): saved group -> this mesh's group. See :meth:`load_state_dict`.
        self.unrestorable: dict[str, str] = {}
        # This mesh's group -> (saved group, saved cursor) of those streams, until the group
        # is joined and its rank 0 has audited them (RecordResize).
        self._resized: dict[str, list[tuple[str, int]]] = {}

    @property
    def job_seed(self) -> int | None:
        """The job's root seed: known once a group is joined, or when given."""
        return self._job_seed

    @property
    def leases(self) -> Mapping[str, LeaseManager]:
        """The lease manager of every group this rank has joined, by group name."""
        return types.MappingProxyType(self._managers)

    def _find_group(self, mesh: DeviceMesh) -> GroupSpec:
        group = self._unscoped_group(mesh)
        if self._scope is None:
            return group
        return GroupSpec(scoped_name(group.name, self._scope), group.rank, group.world_size)

    def _unscoped_group(self, mesh: DeviceMesh) -> GroupSpec:
        """The group of ``mesh`` before manual_seed's scope: among this replica's own groups
        where there is a replica."""
        if self._shared is not None:
            if mesh.get_coordinate() is not None and not set(mesh.mesh.flatten().tolist()) <= set(
                self.device_mesh.mesh.flatten().tolist()
            ):
                raise InvalidRequest(
                    f"{mesh} has ranks outside the shared stream's mesh {self.device_mesh}: "
                    "install() with the job's root mesh"
                )
            group = self._shared
        else:
            group = super()._find_group(mesh)
        if self.replica is None:
            return group
        return GroupSpec(replica_name(group.name, self.replica), group.rank, group.world_size)

    def _stream_for(self, mesh: DeviceMesh) -> Stream:
        group = self._group_of(mesh)
        manager = self._managers.get(group.name)
        if manager is None:
            with self._join_lock:
                manager = self._managers.get(group.name) or self._join(group)
        return manager

    def join(self, *meshes: DeviceMesh) -> None:
        """Join the groups of ``meshes`` now, in one message (JoinGroups), instead of one
        join each at its first random op: for a rank's root mesh and the sub-meshes it
        draws on, e.g. ``tracker.join(mesh, mesh["tp"])``. Every rank of each group must do
        the same (each group's barrier waits for all its ranks). Groups already joined are
        skipped; a group never drawn on holds its epoch and costs nothing more.
        """
        with self._join_lock:
            groups: dict[str, GroupSpec] = {}
            for mesh in meshes:
                group = self._group_of(mesh)
                if group.name not in self._managers:
                    groups.setdefault(group.name, group)
            if len(groups) == 1:
                self._join(*groups.values())
            elif groups:
                specs = list(groups.values())
                results = self._joined(
                    lambda: self.client.join_groups(
                        self.job,
                        [(g.name, g.rank, g.world_size, self._position(g.name)) for g in specs],
                        member_id=self.member_id,
                        job_seed=self._job_seed,
                        timeout_s=self.join_timeout_s,
                    )
                )
                for group, joined in zip(specs, results, strict=True):
                    self._start(group, joined)

    def _join(self, group: GroupSpec) -> LeaseManager:
        joined = self._joined(
            lambda: self.client.join_group(
                self.job,
                group.name,
                rank=group.rank,
                world_size=group.world_size,
                member_id=self.member_id,
                job_seed=self._job_seed,
                timeout_s=self.join_timeout_s,
                position=self._position(group.name),
            )
        )
        return self._start(group, joined)

    def _position(self, group: str) -> int:
        """Where this rank knows ``group``'s grants reach (JoinGroupRequest.position): the
        cursor of this job's checkpoint it loaded, so that a store which lost grants since
        (a database failover) starts the epoch past them; 0 when it loaded none."""
        pending = self._pending.get(group)
        if pending is None or not isinstance(pending.get("epoch"), int):
            return 0
        return int(pending["offset"])

    def _joined(self, join: Callable[[], _T]) -> _T:
        """`join()`, its timeout told in terms of manual_seed's base when one is set."""
        try:
            return join()
        except JoinTimeoutError as e:
            if self._scope is None:
                raise
            raise JoinTimeoutError(
                f"{e}; this rank draws from the streams of base seed {self._scope} "
                f"(manual_seed): ranks that passed manual_seed another base (after their "
                "stage offset) wait in another group",
                code=e.code,
                reason=e.reason,
                metadata=e.metadata,
            ) from e

    def _start(self, group: GroupSpec, joined: JoinResult) -> LeaseManager:
        """The lease manager of `group`, just joined as `joined`."""
        self._scopes[group.name] = self._scope
        self._job_seed = joined.job_seed
        resume = None
        pending = self._pending.pop(group.name, None)
        if pending is not None:
            _check_seed(group.name, pending["seed"], joined.seed)
            _check_forward(group.name, pending, joined, self.client.store_id)
            resume = StreamState(
                pending["offset"], pending["digest"], pending["origin"], pending["largest_op"]
            )
        manager = LeaseManager(
            self.client,
            self.job,
            group.name,
            rank=group.rank,
            member_id=self.member_id,
            joined=joined,
            schedule=self.schedule,
            resume=resume,
            restore_timeout_s=self.join_timeout_s,
            attest_min_s=self.attest_min_s,
            resume_from=self._pending_from.pop(group.name, ""),
        )
        self._managers[group.name] = manager
        self._streams[group.name] = manager
        if self._recording:
            manager.record_ops()
        self._record_resizes()
        return manager

    def _record_resizes(self) -> None:
        """Audit the resizes :meth:`load_state_dict` found, once their group is joined: its
        rank 0 sends one RecordResize per saved group (the coordinator keeps one record per
        epoch and saved group, so a repeat is harmless)."""
        for current in [name for name in self._resized if name in self._managers]:
            manager = self._managers[current]
            for saved, cursor in self._resized.pop(current):
                if manager.rank == 0:
                    self.client.record_resize(
                        self.job,
                        current,
                        epoch=manager.epoch,
                        saved_group=saved,
                        saved_cursor=cursor,
                        rank=manager.rank,
                        member_id=self.member_id,
                    )

    def set_seed(self, tag: str, seed: int) -> None:
        """Refused: group seeds are derived by the coordinator from the job's root seed."""
        raise InvalidRequest(
            f"the seed of group {tag!r} comes from the coordinator: pass seed= (the job's "
            "root seed) to rngcoord.client.install() instead"
        )

    def set_offset(self, tag: str, offset: int) -> None:
        """Move group ``tag`` to ``offset`` with a Restore (audited by the coordinator).

        Every rank of the group must do the same at the same point of its op sequence.
        """
        manager = self._managers.get(tag)
        if manager is None:
            raise InvalidRequest(
                f"group {tag!r} is not joined on rank {self.rank} (joined: "
                f"{sorted(self._managers)}): run a random op on its mesh first, or use "
                "load_state_dict()"
            )
        manager.restore(offset, manager.digest)

    def manual_seed(self, seed: int, mesh: DeviceMesh) -> None:
        """DTensor's ``manual_seed(seed, mesh)`` (rngcoord.client.install routes it here):
        the draws that follow are those of a fresh job with the root seed and the seed's
        *base*, from their start.

        - The base is ``seed`` less this rank's stage offset: its coordinates on the install
          mesh's split dims (``pp*`` by default), mixed radix in the mesh's dim order. So
          torchtitan's ``set_determinism`` and upstream's tests, which pass ``seed + pp_rank``
          on stage ``pp_rank``, give every rank the same base. Stages need no seeds of their
          own: they already draw from separate streams (split dims, docs/design.md §5.4).
        - No group joined and no root seed yet: the base becomes the job's root seed.
        - The base is the root seed: every group goes back to offset 0.
        - Any other base selects the base's streams: every group is then joined under the
          name of the root-seed group with ``/seed:<base>`` appended, so the coordinator
          derives other seeds for them. A group of the base that has already drawn goes back
          to offset 0.

        Going back to offset 0 is an audited Restore that every rank of the group must make at
        the same point, as upstream requires of ``manual_seed``; it is the one way a draw
        repeats, and only when asked for. Before any draw (torchtitan calls it at start-up)
        nothing is sent. The same root seed and base reproduce the same values in any job.

        Raises:
            InvalidRequest: the rank is not in ``mesh``, or ``seed`` is not a uint64.
        """
        check_in_mesh(mesh, self.rank, "manual_seed")
        if not 0 <= seed < 1 << 64:
            raise InvalidRequest(f"seed must be a uint64, got {seed}")
        base = (seed - self.stage_offset()) % (1 << 64)
        if self._job_seed is None and not self._managers:
            self._job_seed = base
            self._set_scope(None)
            return
        self._set_scope(None if base == self._job_seed else base)
        for name, manager in self._managers.items():
            if self._scopes.get(name) == self._scope:
                manager.restore(0, INITIAL_DIGEST)

    def stage_offset(self) -> int:
        """What a per-stage seed adds to the base seed on this rank: its coordinates on the
        install mesh's split dims, mixed radix in dim order (torchtitan's
        ``distinct_seed_mesh_dims``; ``pp_rank`` with one ``pp`` dim). 0 without split dims."""
        coordinate = self.device_mesh.get_coordinate()
        assert coordinate is not None
        names = self.device_mesh.mesh_dim_names or (None,) * self.device_mesh.ndim
        offset, radix = 0, 1
        for dim, name in enumerate(names):
            if is_split_dim(name, self.split_dims):
                offset += coordinate[dim] * radix
                radix *= self.device_mesh.size(dim)
        return offset

    @property
    def seed_scope(self) -> int | None:
        """The base seed whose streams the rank draws from, ``None`` for the root seed's."""
        return self._scope

    def _set_scope(self, scope: int | None) -> None:
        if scope != self._scope:
            self._scope = scope
            # Meshes map to the scope's groups from now on.
            self._groups.clear()
            self._plans.clear()

    def record_ops(self) -> None:
        """Record every group's ops from now on, those of groups joined later included (a
        later call starts over): :meth:`LeaseManager.recorded_ops` of ``leases[group]``."""
        self._recording = True
        for manager in self._managers.values():
            manager.record_ops()

    def state_dict(self) -> dict[str, Any]:
        """The position of every group: ``{"format", "job", "job_seed", "store_id",
        "audit_head", "seed_scope", "streams": {group: {"seed", "offset", "digest", "origin",
        "largest_op", "epoch"}}}``, groups loaded but not joined yet included. ``seed_scope``
        is the base seed whose streams ops draw from (:meth:`manual_seed`), loaded with the
        streams.

        ``store_id`` is the coordinator store the streams came from: loading the state into
        the same job where another store answers raises
        :class:`~rngcoord.client.StoreMismatchError`, as does a group whose epoch or
        high-water mark is behind the state's.
        ``audit_head`` is the latest audit chain head the coordinator sent (for
        ``rngcoord verify --anchor``).
        """
        state = super().state_dict()
        for tag, manager in self._managers.items():
            state["streams"][tag]["epoch"] = manager.epoch
        state["streams"].update({tag: dict(entry) for tag, entry in self._pending.items()})
        state["job"] = self.job
        state["job_seed"] = self._job_seed
        state["store_id"] = self.client.store_id or self._expected_store
        state["audit_head"] = self.client.audit_head or self._saved_head
        state["seed_scope"] = self._scope
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue every group of ``state`` bitwise where it was saved.

        A joined group sends a Restore at once, for the first lease seq this rank has not
        requested; a group not joined yet restores when it joins. Every rank of a group must
        load at the same point of its op sequence. If no root seed was given and no group
        is joined, the job adopts the state's root seed (a new job then draws the same
        values as the saved one). Groups absent from ``state`` (they had not drawn when it
        was saved) are left alone: they start at their high-water mark when joined, so save
        once every mesh has drawn for a bitwise resume of everything.

        Raises:
            InvalidRequest: the state is malformed, or it was saved under another root seed
                than this job's (a stream's seed is not its group's seed here), found when the
                state is loaded, before anything is restored: pass the saved job's root seed
                to install().
            StoreMismatchError: the state is this job's, and another store answers, or a
                group's epoch or high-water mark is behind the state's.
            RestoreTimeoutError: the group's other members did not load it too in time.

        Under the offsets policy a group is its mesh's shape and ranks: a state saved on
        another mesh (a job resized from 4 ranks to 2) names groups this mesh never joins,
        whose cursors cannot be restored. Such streams are listed in :attr:`unrestorable`
        (saved group -> this mesh's group), warned about (:func:`resize_message`) and audited
        (kind ``resize``, sent by the group's rank 0 once it is joined); this mesh's groups
        then start at their own high-water mark. The sharding_invariant
        policy's streams do not depend on the mesh and resume across a resize.
        """
        streams = streams_of(state)
        self._check_root_seed(state, streams)
        self.unrestorable = {} if self.policy != "offsets" else self._foreign_streams(streams)
        for saved, current in self.unrestorable.items():
            warnings.warn(resize_message(saved, current), RuntimeWarning, stacklevel=2)
            self._resized.setdefault(current, []).append((saved, int(streams[saved]["offset"])))
        self._record_resizes()
        if state.get("job") == self.job:
            # The same job continues: its streams must come from the same store, and move
            # only forward. A state loaded into another job continues that job's groups of
            # the same names at the saved cursors (an audited Restore each, under this job's
            # seeds, which _check_root_seed made sure are the state's); the other job's
            # epochs and store say nothing about this one.
            store_id, head = state.get("store_id"), state.get("audit_head")
            if isinstance(store_id, str) and store_id:
                self.client.expect_store(store_id)
                self._expected_store = store_id
            if isinstance(head, str):
                self._saved_head = head
        else:
            for entry in streams.values():
                entry.pop("epoch", None)
        saved_seed = state.get("job_seed")
        if self._job_seed is None and not self._managers and isinstance(saved_seed, int):
            self._job_seed = saved_seed
        scope = state.get("seed_scope")
        if "seed_scope" in state and (scope is None or isinstance(scope, int)):
            # The saved streams are the scope's: continue drawing from them.
            self._set_scope(scope)
        source = state.get("job")
        from_job = source if isinstance(source, str) and source != self.job else ""
        for tag, entry in streams.items():
            manager = self._managers.get(tag)
            if manager is None:
                self._pending[tag] = entry
                self._pending_from[tag] = from_job
                continue
            manager.restore(entry["offset"], entry["digest"], from_job=from_job)

    def _check_root_seed(self, state: Mapping[str, Any], streams: Mapping[str, Any]) -> None:
        """Refuse, before anything is restored, a state whose streams were drawn under
        another root seed than this job's: each stream's seed must be the seed its group has
        here (`rngcoord.v1.seeds.group_seed`), joined or not. The job's root seed is the one
        given to install() or met in a join; else the coordinator's, read with one GetGroup
        of a saved group; else (a new job) the state's own, which the job then adopts."""
        if not streams:
            return
        saved = state.get("job_seed")
        root = self._job_seed
        if root is None:
            # A new job or group (not found), or no coordinator now: the join checks it.
            with contextlib.suppress(NotFoundError, CoordinatorUnavailable):
                known = self.client.get_group(self.job, next(iter(streams)), members_limit=1)
                root = known.job_seed
        if root is None:
            root = saved if isinstance(saved, int) else None
        if root is None:
            return
        for tag, entry in streams.items():
            here = group_seed(root, tag)
            if entry["seed"] != here:
                named = f", root seed {saved}" if isinstance(saved, int) and saved != root else ""
                raise InvalidRequest(
                    f"the state was saved under another root seed (job {state.get('job')!r}"
                    f"{named}) than job {self.job!r} has ({root}): group {tag!r} was saved "
                    f"with seed {entry['seed']} but has seed {here} here. Pass the saved "
                    "job's root seed to install() (state_dict()['job_seed']), or load a state "
                    "of this job's root seed; nothing was restored"
                )

    def _foreign_streams(self, streams: Mapping[str, Any]) -> dict[str, str]:
        """The saved offsets-policy streams whose mesh is not this job's: ranks outside the
        install mesh, or the install mesh's dims with another shape. Maps each to the install
        mesh's group."""
        current = self._unscoped_group(self.device_mesh).name
        now = mesh_of_name(current)
        ours = {int(r) for r in self.device_mesh.mesh.flatten().tolist()}
        foreign = {}
        for tag in streams:
            saved = mesh_of_name(tag) if policy_of(tag) == "offsets" else None
            if saved is None or tag in self._managers:
                continue
            names, shape, ranks = saved
            resized = now is not None and names == now[0] and shape != now[1]
            if resized or not set(ranks) <= ours:
                foreign[tag] = current
        return foreign

    def close(self) -> None:
        """Leave every joined group, stop the prefetch threads, unregister from DTensor and
        close the client if this tracker owns it."""
        unregister(self)
        if self._trace is not None:
            self._trace.close()
        errors = []
        for manager in self._managers.values():
            try:
                manager.close()
            except RNGCoordError as e:
                errors.append(e)
        self._managers.clear()
        if self._owns_client:
            self.client.close()
        if errors:
            logger.warning("rngcoord: leaving groups failed: %s", "; ".join(map(str, errors)))


def resize_message(saved: str, current: str) -> str:
    """What a resume across a resize under the offsets policy does to the random stream."""
    return (
        f"the checkpoint's random stream cannot rewind onto another mesh: it was saved in "
        f"group {saved!r}, and this mesh draws from group {current!r}. Under the offsets "
        "policy a stream belongs to its mesh's shape and ranks, so the draws continue from "
        f"{current!r}'s own position (offset 0 if it is new), not from the saved cursor, and "
        "differ from an uninterrupted run's. Model and optimizer state are unaffected. For "
        'random streams that survive a resize, run the job with policy="sharding_invariant" '
        "(install(policy=...)) from its start"
    )


def scoped_name(name: str, scope: int) -> str:
    """The name of group ``name``'s counterpart among the streams of base seed ``scope``
    (:meth:`OffsetBasedRNGTracker.manual_seed`): ``name`` with ``/seed:<scope>`` appended, or
    a digest of ``name`` where that would be too long for the contract's name rule."""
    return with_suffix(name, f"/seed:{scope}")


def _check_forward(
    group: str, saved: Mapping[str, Any], joined: JoinResult, store_id: str | None
) -> None:
    """Refuse a join whose epoch or high-water mark is behind what a checkpoint of this job
    saw (its streams carry their epoch): the store went back in time (restored from an older
    backup), and offsets would repeat."""
    epoch = saved.get("epoch")
    if not isinstance(epoch, int):
        return  # another job's state, or one saved before epochs were kept
    behind = []
    if joined.epoch <= epoch:
        behind.append(f"epoch {joined.epoch}, not after the saved epoch {epoch}")
    if joined.start < saved["offset"]:
        behind.append(f"high-water mark {joined.start}, below the saved cursor {saved['offset']}")
    if behind:
        raise StoreMismatchError(
            f"group {group!r} came back with {' and '.join(behind)}: the coordinator's store "
            f"(id {store_id}) went back in time, e.g. restored from an older backup, and "
            "continuing could hand out offsets that were already used. Restore the latest "
            "store, or recover with `rngcoord serve --init --floor-from AUDIT_EXPORT`",
            reason="STORE_MISMATCH",
            metadata={"group": group},
        )


def _check_seed(group: str, saved: int, current: int) -> None:
    if saved != current:
        raise InvalidRequest(
            f"group {group!r} was saved with seed {saved} but has seed {current} in this "
            "job: its root seed differs; pass the saved job's root seed (state_dict()"
            "['job_seed']) to install(), or resume the same job"
        )
