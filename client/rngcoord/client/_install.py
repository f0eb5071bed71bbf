"""Entry points: :func:`install` puts a coordinator-backed tracker under DTensor, and
:func:`init_mesh` sets up the dispatchable process group and the DeviceMesh."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from types import TracebackType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rngcoord.client import _router
from rngcoord.client._compat import check_torch
from rngcoord.client._connection import CoordinatorClient
from rngcoord.client._coordinated import OffsetBasedRNGTracker
from rngcoord.client._devices import device_handle, dispatchable_backend
from rngcoord.client._errors import InvalidRequest, RNGCoordError, refused
from rngcoord.client._leases import ATTEST_MIN_S
from rngcoord.client._tracker import CompiledOps, Policy
from rngcoord.v1.rules import RuleViolation, check_name

logger = logging.getLogger("rngcoord.client.install")

#: The outage budget of install() when neither ``outage_s`` nor RNGCOORD_OUTAGE_S say.
DEFAULT_OUTAGE_S = 600.0


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
    outage_s: float | None = None,
    connect_timeout_s: float = 30.0,
    split_dims: Sequence[str] | None = None,
    policy: Policy = "offsets",
    compiled_random_ops: CompiledOps = "eager",
    trace: str | os.PathLike[str] | None = None,
    takeover: bool = False,
    attest_min_s: float = ATTEST_MIN_S,
    replica: str | None = None,
) -> OffsetBasedRNGTracker:
    """Make DTensor random ops on this rank draw from coordinator leases.

    Call it on every rank after the process group exists (see :func:`init_mesh`). It
    registers the returned tracker under this rank's global rank in the router that DTensor
    sees as its tracker, so every rank, including each thread of a multi-threaded process
    group, has its own. Groups are joined lazily, on the first random op of each mesh
    (:meth:`OffsetBasedRNGTracker.join` joins several ahead, in one message).

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
            (:class:`~rngcoord.client._leases.LeaseSchedule`), so that RPCs per training step
            stay bounded whatever the tensor sizes.
        shared_stream: One stream for every mesh over ``mesh``'s ranks (like upstream's
            single generator) instead of one per (sub)mesh. Default ``False``.
        tls_ca: PEM CA bundle to verify the coordinator (TLS). Default ``None``:
            RNGCOORD_TLS_CA, else plaintext.
        join_timeout_s: How long a group's join barrier waits for its ranks. Default 60.0.
        deadline_s: Deadline of each RPC attempt. Default 10.0.
        outage_s: The outage budget, in seconds: how long a coordinator outage (a restart, an
            upgrade, a failover between ``target``'s replicas) may last mid-run. Meanwhile
            random ops keep drawing from the leases held (requested ahead to last 30 s), an op
            that needs a new lease waits, and calls retry with capped, fully jittered
            backoff; rank 0 logs one warning when an outage begins and one line when it
            ends. Past the budget, the op that needs a lease raises
            :class:`~rngcoord.client.CoordinatorUnavailable`. Default ``None``:
            RNGCOORD_OUTAGE_S, else 600.
        connect_timeout_s: How long install() tries to reach the coordinator before it
            returns (a GetGroup that proves the address and the token), apart from the
            outage budget. Default 30.0.
        split_dims: Names of ``mesh``'s dims whose sub-mesh copies draw separate numbers,
            such as pipeline stages. Default ``None``: dims named ``pp*`` or ``pipe*``; the
            copies of a sub-mesh along every other dim draw the same numbers, as in DTensor
            (:func:`rngcoord.client._groups.stream_group`).
        policy: ``"offsets"`` (default): DTensor's offset semantics, bitwise upstream's where
            shards are even. ``"sharding_invariant"``: each shard gets exactly the slice one
            device would have drawn, on any device, and the stream is named independently of
            the mesh, so a job resized from 4 ranks to 2 draws the same numbers
            (:mod:`rngcoord.client._invariant`).
        compiled_random_ops: ``"eager"`` (default; the name is kept for compatibility):
            a traced graph (torch.compile, make_fx, export) draws each DTensor random op from
            the leases when it runs, as the eager op would (``rngcoord::draw``), bitwise
            equal to eager mode, ``fullgraph=True`` included; ``"device"``: traced ops draw
            from the device generator as it stands, outside the leases and the audit
            (upstream's behaviour), warned once.
        trace: Write one JSON line per random op (op index, group, cursor, shape, dtype,
            op) to this path, ``{rank}`` replaced by the rank: the input of ``rngcoord
            replay --trace``. Buffered, no RPC; flushed at ``tracker.close()``. Default
            ``None``: off.

        takeover: Replace the job's groups even if another launch of the job is training
            them (its ranks then fail with StaleEpochError: rank 0 of each group within a
            15 s heartbeat, the others at their next call). Default
            ``False``: a join that would replace an epoch whose members were active within
            the last 180 s, formed by another launch (:func:`launch_id`), is refused with
            reason JOB_IN_USE, naming that launch's hosts. A torchelastic restart of this
            launch (higher TORCHELASTIC_RESTART_COUNT) replaces it without asking.
        attest_min_s: Attest op fingerprints about this often at most (every 1,024 ops,
            stretched to a power-of-two multiple of 1,024 ops that lasts this long), so that
            attestations do not grow with the draw rate. Ranks that ran different ops are
            caught within 1,024 ops or about twice this many seconds of drawing, whichever
            comes later (docs/design.md §6.1); 0 attests every 1,024 ops. Default 30.0.
        replica: The replica group this process belongs to, in a job of several replicas
            that train the same model side by side (torchft). Each replica's groups are its
            own (``/replica:<replica>`` in their names), with seeds of their own, so replicas
            draw different masks. A new process of a replica takes over that replica's
            groups as a new epoch at once (its launch is the replica,
            ``replica:<job>/<replica>`` unless RNGCOORD_LAUNCH names one), never another
            replica's. Default ``None``: the REPLICA_GROUP_ID environment variable that
            torchft's launchers set, else none.

    While installed, ``torch.distributed.tensor._random.manual_seed(seed, mesh)``, however it
    was imported, makes the draws that follow those of a fresh job with the root seed and the
    seed's base (:meth:`OffsetBasedRNGTracker.manual_seed`); ``torch.manual_seed`` does not
    touch DTensor draws, which come from the leases.

    Returns:
        This rank's tracker; :meth:`OffsetBasedRNGTracker.close` undoes the install.

    Raises:
        UnsupportedTorchError: this torch lacks the DTensor internals the tracker needs.
        InvalidRequest: a missing job name, a mesh without the calling rank, or a bad
            argument.
        CoordinatorUnavailable: no coordinator target answered within
            ``connect_timeout_s``; the message names the targets and RNGCOORD_ADDR.
        AuthenticationError: the coordinator refused the token for ``job``
            (:class:`~rngcoord.client.PermissionDeniedError`: its role or jobs).
    """
    install_excepthook(dist.get_rank() if dist.is_initialized() else _env_rank())
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
    if replica is None:
        replica = os.environ.get("REPLICA_GROUP_ID", "").strip() or None
    if outage_s is None:
        outage_s = _env_outage_s()
    client = CoordinatorClient(
        target,
        token=token,
        tls_ca=tls_ca,
        deadline_s=deadline_s,
        outage_s=outage_s,
        # One warning per outage for the whole job, not one per rank.
        log_outages=dist.get_rank() == 0,
        session=True,
    )
    client.launch, client.restart_count = launch_id()
    if replica is not None and not os.environ.get("RNGCOORD_LAUNCH", "").strip():
        # A replica's groups are only its own: whatever launched its new process (a fresh
        # torchrun, with another run id and rendezvous port), it is the replica's launch.
        client.launch, client.restart_count = f"replica:{job}/{replica}", 0
    client.takeover = takeover
    try:
        # Fail fast on a wrong address or token, rather than at the first random op.
        client.probe(job, within_s=connect_timeout_s)
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
            trace=trace,
            attest_min_s=attest_min_s,
            replica=replica,
        )
    except BaseException:
        client.close()
        raise
    previous = _router.register(tracker)
    if isinstance(previous, OffsetBasedRNGTracker):
        try:
            previous.close()
        except RNGCoordError as e:
            logger.warning("rngcoord: closing the replaced tracker of rank %d: %s", tracker.rank, e)
    return tracker


def launch_id(env: dict[str, str] | None = None) -> tuple[str, int]:
    """Which launch of a job this process belongs to, and its restart count: the same on every
    rank of one launch, without a collective, and different for two launches that run at
    once.

    RNGCOORD_LAUNCH, when set, names the launch (``{host}`` in it is replaced by this host's
    name), and its restart count is 0: the name outlives the supervisor it is given to (a
    container that Docker restarts, a requeued Slurm job), whose torchelastic run id and
    restart count start over, so a restart of the whole launch rejoins at once instead of
    waiting 180 s for its own crashed epoch to go idle. Give each deployment a name of its
    own: two launches that share one are one launch to the coordinator.

    Else torchelastic's TORCHELASTIC_RUN_ID (``--rdzv-id``; a fresh uuid with
    ``--standalone``) names it, unless it is torchrun's default ``"none"``. Else the
    rendezvous address MASTER_ADDR:MASTER_PORT does (two launches running at once cannot
    share it), with the host name added when MASTER_ADDR is a loopback address (single-host
    launches on two hosts may both use 127.0.0.1:29500). Without any, "" (no launch check).
    The restart count is TORCHELASTIC_RESTART_COUNT (0 without it).

    >>> launch_id({"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "2"})
    ('torchelastic:r1', 2)
    >>> launch_id({"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"})
    ('master:10.0.0.7:29500', 0)
    >>> launch_id({"RNGCOORD_LAUNCH": "trainer-a", "TORCHELASTIC_RUN_ID": "r1",
    ...            "TORCHELASTIC_RESTART_COUNT": "2"})
    ('named:trainer-a', 0)
    """
    env = dict(os.environ) if env is None else env
    named = env.get("RNGCOORD_LAUNCH", "").strip()
    if named:
        return "named:" + named.replace("{host}", socket.gethostname()), 0
    text = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    restarts = int(text) if text.isdigit() else 0
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchelastic:{run_id}", restarts
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not addr or not port:
        return "", restarts
    if addr in ("localhost", "::1") or addr.startswith("127."):
        addr = f"{socket.gethostname()}/{addr}"
    return f"master:{addr}:{port}", restarts


def _env_rank() -> int:
    text = os.environ.get("RANK", "0")
    return int(text) if text.isdigit() else 0


def one_line(rank: int, error: BaseException) -> str:
    """The line a fatal rngcoord error prints on every rank:
    ``[rank N] rngcoord: ClassName: message``, the message on one line."""
    message = " ".join(str(error).split())
    return f"[rank {rank}] rngcoord: {type(error).__name__}: {message}\n"


def _debug() -> bool:
    return os.environ.get("RNGCOORD_DEBUG", "") not in ("", "0")


_hook_lock = threading.Lock()
_hook_rank: int | None = None


def install_excepthook(rank: int) -> None:
    """Make an :class:`RNGCoordError` that escapes the program (or a thread) print one line
    on this rank, the full traceback only on rank 0 (on every rank with RNGCOORD_DEBUG=1).

    Wraps ``sys.excepthook`` and ``threading.excepthook`` once per process; any other
    exception goes to the hooks that were there before, as it did. torchelastic's ``@record``
    is unaffected: it writes its error file (with the traceback) before re-raising, and the
    exception reaches these hooks after it. Idempotent: a later call only updates the rank.
    """
    global _hook_rank
    with _hook_lock:
        first = _hook_rank is None
        _hook_rank = rank
        if not first:
            return
        previous = sys.excepthook
        previous_thread = threading.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            if not _report(value):
                previous(kind, value, tb)

        def thread_hook(args: threading.ExceptHookArgs) -> None:
            if args.exc_value is None or not _report(args.exc_value):
                previous_thread(args)

        sys.excepthook = hook
        threading.excepthook = thread_hook


def _report(error: BaseException) -> bool:
    """Print `error` as a fatal rngcoord error if it is one; whether it was."""
    if not isinstance(error, RNGCoordError):
        return False
    rank = _hook_rank or 0
    try:
        if rank == 0 or _debug():
            traceback.print_exception(error, file=sys.stderr)
        sys.stderr.write(one_line(rank, error))
        sys.stderr.flush()
    except Exception:  # stderr is gone: nothing to print to
        pass
    return True


def _env_outage_s() -> float:
    text = os.environ.get("RNGCOORD_OUTAGE_S") or str(DEFAULT_OUTAGE_S)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise InvalidRequest(
            f"RNGCOORD_OUTAGE_S={text!r}: set it to the seconds a coordinator outage may last "
            "mid-run (a number >= 0), or unset it for the default of "
            f"{DEFAULT_OUTAGE_S:g}"
        )
    return value


def choose_device_type(
    accelerator: str | None, available: bool, device_count: int, local_ranks: int
) -> tuple[str, str]:
    """The device :func:`init_mesh` picks when it is not told, and why (for its log line).

    The accelerator is taken only if it is usable here and has a device for each of this
    host's ranks; otherwise CPU, with gloo. Knowing that torch was built for an accelerator is
    not enough: ``torch.accelerator.current_accelerator()`` names CUDA for every CUDA wheel,
    also on a host with no GPU (or no driver), where nccl would fail at the first collective.
    Ranks sharing a GPU would fail too (nccl refuses two ranks on one device).

    >>> choose_device_type("cuda", True, 8, 4)
    ('cuda', '8 cuda device(s) for 4 local rank(s)')
    >>> choose_device_type("cuda", False, 0, 4)[0]
    'cpu'

    Args:
        accelerator: The device type torch was built for (``None``: none).
        available: Whether that accelerator is available at run time.
        device_count: How many devices of it this process sees.
        local_ranks: How many ranks of the job run on this host.
    """
    if accelerator is None:
        return "cpu", "torch has no accelerator"
    if not available:
        return "cpu", f"torch is built for {accelerator}, but no {accelerator} is available"
    devices = f"{device_count} {accelerator} device(s) for {local_ranks} local rank(s)"
    if device_count < local_ranks:
        return "cpu", f"only {devices}"
    return accelerator, devices


def _local_ranks() -> int:
    # torchrun and torchelastic set LOCAL_WORLD_SIZE. Without it, assume every rank is on this
    # host: the same answer on all of them, where LOCAL_RANK + 1 would let the first ranks of
    # a host pick the GPU and the last ones CPU, and the mesh would never form.
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return dist.get_world_size() if dist.is_initialized() else 1


def _default_device_type() -> tuple[str, str]:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return choose_device_type(None, False, 0, _local_ranks())
    # torch.accelerator.is_available() is torch.cuda.is_available() on a CUDA build: a driver
    # and at least one visible device.
    available = torch.accelerator.is_available()
    count = torch.accelerator.device_count() if available else 0
    return choose_device_type(accelerator.type, available, count, _local_ranks())


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
    as it is. It logs the device it uses and why (a warning where it falls back to CPU
    although torch is built for an accelerator).

    Args:
        mesh_shape: The mesh's shape, e.g. ``(2, 2)``; its product is the world size.
        mesh_dim_names: Names of the mesh's dimensions, e.g. ``("dp", "tp")``. Default
            ``None``: unnamed.
        device_type: ``"cpu"``, ``"cuda"`` or a cuda-like device. Default ``None``: the
            accelerator torch is built for if it is available and has a device for each rank
            on this host (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``), else ``"cpu"`` (see
            :func:`choose_device_type`).
    """
    fell_back = False
    if device_type is None:
        device_type, reason = _default_device_type()
        fell_back = device_type == "cpu" and torch.accelerator.current_accelerator() is not None
    else:
        reason = "as asked"
    backend = None
    if not dist.is_initialized():
        handle = device_handle(device_type)
        count = getattr(handle, "device_count", None)
        set_device = getattr(handle, "set_device", None)
        if callable(count) and callable(set_device) and count() > 0:
            rank = int(os.environ.get("RANK", "0"))
            set_device(int(os.environ.get("LOCAL_RANK", rank % count())))
        backend = dispatchable_backend([device_type])
        dist.init_process_group(backend=backend)
    (logger.warning if fell_back else logger.info)(
        "rngcoord: init_mesh on rank %d uses %s (%s); process group backend %s",
        dist.get_rank(),
        device_type,
        reason,
        backend if backend is not None else "as initialised before",
    )
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    return init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=names)
