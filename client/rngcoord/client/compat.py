"""Which torch versions the client supports, and a check of the DTensor internals it uses.

The tracker hooks into private parts of ``torch.distributed.tensor``; :func:`check_torch`
verifies each one at install time and raises :class:`UnsupportedTorchError` naming what is
missing, rather than letting a random op fail (or draw wrongly) later.
"""

from __future__ import annotations

import types

import torch

from rngcoord.client.errors import UnsupportedTorchError

#: (major, minor) versions of torch the DTensor hooks are written and tested against.
SUPPORTED_TORCH = ((2, 13), (2, 14))


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch's)."""
    text = torch.__version__ if version is None else version
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _locals_of(function: object) -> tuple[str, ...]:
    code = getattr(function, "__code__", None)
    return code.co_varnames if isinstance(code, types.CodeType) else ()


def missing_internals() -> list[str]:
    """The DTensor internals the client relies on that this torch lacks (empty if none)."""
    from torch.distributed.tensor import _api, _dispatch
    from torch.distributed.tensor import _random as dtensor_random

    missing: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            missing.append(what)

    need(hasattr(dtensor_random, "_rng_tracker"), "torch.distributed.tensor._random._rng_tracker")
    upstream = getattr(dtensor_random, "OffsetBasedRNGTracker", None)
    need(upstream is not None, "torch.distributed.tensor._random.OffsetBasedRNGTracker")
    for attr in ("_compute_rng_offsets", "_distribute_region", "distribute_region_enabled"):
        need(hasattr(upstream, attr), f"OffsetBasedRNGTracker.{attr}")
    for name in ("_calc_shard_linear_idx", "_calc_shard_info", "_calc_first_shard_size"):
        need(hasattr(dtensor_random, name), f"torch.distributed.tensor._random.{name}")
    need(hasattr(dtensor_random, "manual_seed"), "torch.distributed.tensor._random.manual_seed")
    need(
        isinstance(getattr(_dispatch.OpDispatcher(), "_custom_op_handlers", None), dict),
        "OpDispatcher._custom_op_handlers",
    )
    slow_path = getattr(_dispatch.OpDispatcher, "_dispatch_get_local_results_slow_path", None)
    need(
        "op_call" in _locals_of(slow_path),
        "OpDispatcher._dispatch_get_local_results_slow_path (local 'op_call')",
    )
    need(
        "init_op" in _locals_of(getattr(_api, "_dtensor_init_helper", None)),
        "torch.distributed.tensor._api._dtensor_init_helper (local 'init_op')",
    )
    from torch.distributed import _functional_collectives

    need(
        hasattr(_functional_collectives, "_are_we_tracing"),
        "torch.distributed._functional_collectives._are_we_tracing",
    )
    need(
        hasattr(_dispatch, "run_dtensor_rng_op"),
        "torch.distributed.tensor._dispatch.run_dtensor_rng_op",
    )
    return missing


def check_torch(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTorchError` unless this torch is supported.

    Args:
        version: The version string to judge. Default ``None``: ``torch.__version__``.
    """
    found = torch_version(version)
    supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_TORCH)
    if found not in SUPPORTED_TORCH:
        raise UnsupportedTorchError(
            f"torch {torch.__version__ if version is None else version} is not supported by "
            f"rngcoord's DTensor hooks (supported: {supported}): install a supported torch"
        )
    missing = missing_internals()
    if missing:
        raise UnsupportedTorchError(
            f"torch {torch.__version__} lacks DTensor internals rngcoord hooks into: "
            f"{', '.join(missing)}; install a supported torch ({supported})"
        )
