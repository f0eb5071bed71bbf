"""rngcoord client: connection, leases and the DTensor RNG tracker.

``install(mesh, target, job)`` makes DTensor random ops on this rank draw from coordinator
leases; ``init_mesh`` sets up the dispatchable process group and the DeviceMesh. Supported
torch versions: :data:`SUPPORTED_TORCH`.

The names below are the whole public API, and :mod:`rngcoord.client.torchft` (``attach``) the
one public submodule (it is not imported here: torchft is an optional extra). The modules
with a leading underscore are private and may move. Their loggers keep the names users
configure, ``rngcoord.client.<concern>`` (``connection`` for outages, ``compat``, ``install``,
``leases``, ``tracker``, ``coordinated``, ``router``), whichever module holds the code.
"""

from __future__ import annotations

from rngcoord.client._compat import SUPPORTED_TORCH
from rngcoord.client._connection import CoordinatorClient
from rngcoord.client._coordinated import OffsetBasedRNGTracker
from rngcoord.client._errors import (
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
from rngcoord.client._install import init_mesh, install
from rngcoord.client._leases import LeaseManager
from rngcoord.client._tracker import RNGStateTracker

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
