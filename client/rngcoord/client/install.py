"""Entry points: :func:`install` puts a coordinator-backed tracker under DTensor, and
:func:`init_mesh` sets up the dispatchable process group and the DeviceMesh."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rngcoord.client import router
from rngcoord.client.compat import check_torch
from rngcoord.client.connection import CoordinatorClient
from rngcoord.client.devices import device_handle, dispatchable_backend
from rngcoord.client.errors import InvalidRequest, RNGCoordError, refused
from rngcoord.client.tracker import CompiledOps, OffsetBasedRNGTracker, Policy
from rngcoord.v1.rules import RuleViolation, check_name

logger = logging.getLogger(__name__)


def install(
    mesh: DeviceMesh,
    target: str | Sequence[str] | None = None,
    job: str | None = None,
    seed: int | None = None,
    token: str | None = None,
    *,
    lease_size: int | None = None,
    shared_stream: bool = False,
    tls_ca: str | None = None,
    join_timeout_s: float = 60.0,
    deadline_s: float = 10.0,
    retries: int = 5,
    split_dims: Sequence[str] | None = None,
    policy: Policy = "offsets",
    compiled_random_ops: CompiledOps = "eager",
) -> OffsetBasedRNGTracker:
    """Make DTensor random ops on this rank draw from coordinator leases.

    Call it on every rank after the process group exists (see :func:`init_mesh`). It
    registers the returned tracker under this rank's global rank in the router that DTensor
    sees as its tracker, so every rank, including each thread of a multi-threaded process
    group, has its own. Groups are joined lazily, on the first random op of each mesh.

    Args:
        mesh: The job's DeviceMesh; its device type picks the generator (CPU, cuda or
            cuda-like) and, with ``shared_stream``, its ranks form the one group.
        target: Coordinator address(es), ``"HOST:PORT"``, a sequence or comma-separated.
            Default ``None``: RNGCOORD_ADDR, else ``localhost:29520``.
        job: The job name. Default ``None``: RNGCOORD_JOB (required then).
        seed: The job's root seed (uint64); the same seed reproduces a job bitwise.
            Default ``None``: the job's recorded seed, or one the coordinator draws.
        token: Bearer token for the job. Default ``None``: RNGCOORD_TOKEN, else none.
        lease_size: Offsets in every lease, a multiple of 4, equal on every rank. Default
            ``None``: leases sized to the work, growing with the stream
            (:class:`~rngcoord.client.leases.LeaseSchedule`), so that RPCs per training step
            stay bounded whatever the tensor sizes.
        shared_stream: One stream for every mesh over ``mesh``'s ranks (like upstream's
            single generator) instead of one per (sub)mesh. Default ``False``.
        tls_ca: PEM CA bundle to verify the coordinator (TLS). Default ``None``:
            RNGCOORD_TLS_CA, else plaintext.
        join_timeout_s: How long a group's join barrier waits for its ranks. Default 60.0.
        deadline_s: Deadline of each RPC attempt. Default 10.0.
        retries: Retries of an RPC on UNAVAILABLE or DEADLINE_EXCEEDED. Default 5.
        split_dims: Names of ``mesh``'s dims whose sub-mesh copies draw separate numbers,
            such as pipeline stages. Default ``None``: dims named ``pp*`` or ``pipe*``; the
            copies of a sub-mesh along every other dim draw the same numbers, as in DTensor
            (:func:`rngcoord.client.groups.stream_group`).
        policy: ``"offsets"`` (default): DTensor's offset semantics, bitwise upstream's where
            shards are even. ``"sharding_invariant"``: each shard gets exactly the slice one
            device would have drawn, on any device, and the stream is named independently of
            the mesh, so a job resized from 4 ranks to 2 draws the same numbers
            (:mod:`rngcoord.client.invariant`).
        compiled_random_ops: ``"eager"`` (default): under torch.compile each DTensor random
            op breaks the graph and runs eagerly from the leases, bitwise equal to eager
            mode; ``"device"``: compiled ops draw from the device generator, outside the
            leases and the audit (upstream's behaviour).

    While installed, ``torch.distributed.tensor._random.manual_seed(seed, mesh)`` restarts
    the streams from offset 0 (an audited Restore) if ``seed`` is the job's root seed, and
    raises otherwise (:meth:`OffsetBasedRNGTracker.manual_seed`); ``torch.manual_seed`` does
    not touch DTensor draws, which come from the leases.

    Returns:
        This rank's tracker; :meth:`OffsetBasedRNGTracker.close` undoes the install.

    Raises:
        UnsupportedTorchError: this torch lacks the DTensor internals the tracker needs.
        InvalidRequest: a missing job name, a mesh without the calling rank, or a bad
            argument.
    """
    check_torch()
    job = job or os.environ.get("RNGCOORD_JOB") or None
    if job is None:
        raise InvalidRequest("install() needs a job name: pass job=... or set RNGCOORD_JOB")
    try:
        check_name("job", job)
    except RuleViolation as violation:
        raise refused(violation) from None
    if not dist.is_initialized():
        raise InvalidRequest(
            "install() needs torch.distributed initialised: call rngcoord.client.init_mesh() "
            "or torch.distributed.init_process_group() first"
        )
    client = CoordinatorClient(
        target, token=token, tls_ca=tls_ca, deadline_s=deadline_s, retries=retries
    )
    try:
        tracker = OffsetBasedRNGTracker(
            mesh,
            client,
            job,
            seed=seed,
            lease_size=lease_size,
            shared_stream=shared_stream,
            join_timeout_s=join_timeout_s,
            owns_client=True,
            split_dims=split_dims,
            policy=policy,
            compiled_random_ops=compiled_random_ops,
        )
    except BaseException:
        client.close()
        raise
    previous = router.register(tracker)
    if isinstance(previous, OffsetBasedRNGTracker):
        try:
            previous.close()
        except RNGCoordError as e:
            logger.warning("rngcoord: closing the replaced tracker of rank %d: %s", tracker.rank, e)
    return tracker


def _default_device_type() -> str:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"


def init_mesh(
    mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None = None,
    device_type: str | None = None,
) -> DeviceMesh:
    """The job's DeviceMesh, with the dispatchable process group set up if needed.

    If torch.distributed is not initialised yet, this initialises it from the usual
    environment (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with a dispatchable
    backend, ``"cpu:gloo,cuda:nccl"`` on CUDA hosts: the default backend of each device from
    ``torch.distributed.Backend``'s registry. On an accelerator it binds this rank to device
    ``LOCAL_RANK`` (else ``rank % device_count()``) first. An existing process group is used
    as it is.

    Args:
        mesh_shape: The mesh's shape, e.g. ``(2, 2)``; its product is the world size.
        mesh_dim_names: Names of the mesh's dimensions, e.g. ``("dp", "tp")``. Default
            ``None``: unnamed.
        device_type: ``"cpu"``, ``"cuda"`` or a cuda-like device. Default ``None``: the
            current accelerator if there is one, else ``"cpu"``.
    """
    device_type = device_type or _default_device_type()
    if not dist.is_initialized():
        handle = device_handle(device_type)
        count = getattr(handle, "device_count", None)
        set_device = getattr(handle, "set_device", None)
        if callable(count) and callable(set_device) and count() > 0:
            rank = int(os.environ.get("RANK", "0"))
            set_device(int(os.environ.get("LOCAL_RANK", rank % count())))
        dist.init_process_group(backend=dispatchable_backend([device_type]))
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    return init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=names)
