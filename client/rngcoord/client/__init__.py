"""rngcoord client: connection, leases and the DTensor RNG tracker.

``install(mesh, target, job)`` makes DTensor random ops on this rank draw from coordinator
leases; ``init_mesh`` sets up the dispatchable process group and the DeviceMesh. Supported
torch versions: :data:`SUPPORTED_TORCH`.
"""

from __future__ import annotations

from rngcoord.client.compat import SUPPORTED_TORCH
from rngcoord.client.connection import CoordinatorClient
from rngcoord.client.coordinated import OffsetBasedRNGTracker
from rngcoord.client.errors import (
    AuthenticationError,
    CoordinatorUnavailable,
    DivergenceError,
    FailedPreconditionError,
    InvalidRequest,
    JoinTimeoutError,
    NotFoundError,
    NotMemberError,
    OffsetsExhausted,
    PermissionDeniedError,
    RestoreTimeoutError,
    RNGCoordError,
    StaleEpochError,
    StoreMismatchError,
    UnsupportedTorchError,
)
from rngcoord.client.install import init_mesh, install
from rngcoord.client.leases import LeaseManager
from rngcoord.client.tracker import RNGStateTracker

__all__ = [
    "SUPPORTED_TORCH",
    "AuthenticationError",
    "CoordinatorClient",
    "CoordinatorUnavailable",
    "DivergenceError",
    "FailedPreconditionError",
    "InvalidRequest",
    "JoinTimeoutError",
    "LeaseManager",
    "NotFoundError",
    "NotMemberError",
    "OffsetBasedRNGTracker",
    "OffsetsExhausted",
    "PermissionDeniedError",
    "RNGCoordError",
    "RNGStateTracker",
    "RestoreTimeoutError",
    "StaleEpochError",
    "StoreMismatchError",
    "UnsupportedTorchError",
    "init_mesh",
    "install",
]
