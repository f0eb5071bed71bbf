"""Which torch the client can run on: a probe of the DTensor internals it hooks into.

The tracker hooks into private parts of ``torch.distributed.tensor`` (docs/design.md §9).
Support is decided by probing each of them, not by the version number: :func:`check_torch`
raises :class:`UnsupportedTorchError` naming what is missing or changed, rather than letting a
random op fail (or draw wrongly) later. A torch outside :data:`TESTED_TORCH` that passes the
probe is used, with a warning that CI has not run the suites on it.

What the probe found across the tested versions (read from the wheels):

- 2.13.0, 2.14.1 and 2.15.0 have the same ``torch/distributed/tensor/_random.py`` but for a
  type-checker comment, and the same signatures for everything below.
- ``_PhiloxState.seed`` and ``.offset`` return one-element tensors (uint64 and int64 views of
  the 16-byte state), not ints: pytorch#173876, marked BC-breaking, is already in 2.13.0, not
  new in 2.15. rngcoord never reads them to run (_devices.pack_philox writes the bytes itself);
  the probe reads them through :func:`philox_seed_offset` only to check that upstream's layout
  is still the one rngcoord writes.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable

import torch

from rngcoord.client._errors import UnsupportedTorchError

logger = logging.getLogger("rngcoord.client.compat")

#: (major, minor) versions of torch that CI runs the client suites on (`.ci/run`).
TESTED_TORCH = ((2, 13), (2, 14), (2, 15))
#: Kept under its old name: the versions rngcoord is tested with.
SUPPORTED_TORCH = TESTED_TORCH

_U64 = (1 << 64) - 1


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch's)."""
    text = torch.__version__ if version is None else version
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def philox_seed_offset(state: torch.Tensor) -> tuple[int, int]:
    """(seed, offset) of a 16-byte CUDA-style Philox state, read by upstream's ``_PhiloxState``.

    Since pytorch#173876 (BC-breaking; in 2.13 already) ``_PhiloxState.seed`` is a uint64 and
    ``.offset`` an int64 one-element tensor, where they were ints. ``int()`` of a uint64 tensor
    holding a value of 2^63 or more raises ("cannot be converted to type int64_t without
    overflow", 2.13 to 2.15), and rngcoord's group seeds use all 64 bits, so the seed is read
    through an int64 view of the same bits. ``int()`` also reads the ints of older releases.
    """
    from torch.distributed.tensor._random import _PhiloxState

    philox = _PhiloxState(state)
    seed = philox.seed
    if isinstance(seed, torch.Tensor):
        return int(seed.view(torch.int64).item()) & _U64, int(philox.offset)
    return int(seed), int(philox.offset)


def _locals_of(function: object) -> tuple[str, ...]:
    code = getattr(function, "__code__", None)
    return code.co_varnames if isinstance(code, types.CodeType) else ()


def _parameters(function: object) -> list[str] | None:
    if not callable(function):
        return None
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def missing_internals() -> list[str]:
    """The DTensor internals the client relies on that this torch lacks or has changed
    (empty if none)."""
    from torch._dynamo import exc as dynamo_exc
    from torch.distributed import _functional_collectives
    from torch.distributed.tensor import _api, _dispatch
    from torch.distributed.tensor import _random as dtensor_random

    from rngcoord.client._devices import pack_philox

    missing: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            missing.append(what)

    def need_signature(owner: object, name: str, where: str, expected: list[str]) -> None:
        # DTensor calls these with its own argument names (`_distribute_region(spec,
        # generator=...)`), and rngcoord's overrides and calls must match them.
        found = _parameters(getattr(owner, name, None))
        need(found == expected, f"{where}{name}({', '.join(expected)})")

    need(hasattr(dtensor_random, "_rng_tracker"), "torch.distributed.tensor._random._rng_tracker")
    upstream = getattr(dtensor_random, "OffsetBasedRNGTracker", None)
    need(upstream is not None, "torch.distributed.tensor._random.OffsetBasedRNGTracker")
    need(
        hasattr(upstream, "distribute_region_enabled"),
        "OffsetBasedRNGTracker.distribute_region_enabled",
    )
    tracker = "OffsetBasedRNGTracker."
    need_signature(upstream, "_distribute_region", tracker, ["self", "spec", "generator"])
    need_signature(upstream, "_compute_rng_offsets", tracker, ["self", "spec"])
    module = "torch.distributed.tensor._random."
    need_signature(dtensor_random, "_calc_shard_info", module, ["mesh_coordinate", "spec"])
    need_signature(dtensor_random, "_calc_first_shard_size", module, ["spec"])
    need_signature(dtensor_random, "_calc_shard_linear_idx", module, ["shard_coord", "shard_size"])
    need_signature(dtensor_random, "manual_seed", module, ["seed", "device_mesh"])
    # The 16-byte CUDA state: the tracker writes (seed, offset) in this layout
    # (_devices.pack_philox), so it must be the one upstream reads.
    try:
        seed, offset = (1 << 63) + 42, (1 << 62) + 4
        state = torch.frombuffer(bytearray(pack_philox(seed, offset)), dtype=torch.uint8)
        layout_ok = philox_seed_offset(state) == (seed, offset)
    except (ImportError, AttributeError, RuntimeError, TypeError):
        layout_ok = False
    need(layout_ok, "torch.distributed.tensor._random._PhiloxState (seed u64 [0:8], offset [8:16])")
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
    need(
        hasattr(_functional_collectives, "_are_we_tracing"),
        "torch.distributed._functional_collectives._are_we_tracing",
    )
    need(
        hasattr(_dispatch, "run_dtensor_rng_op"),
        "torch.distributed.tensor._dispatch.run_dtensor_rng_op",
    )
    # The graph break at a DTensor random op under torch.compile (_tracker._break_graph).
    unimplemented: Callable[..., object] | None = getattr(dynamo_exc, "unimplemented", None)
    keywords = set(_parameters(unimplemented) or ())
    need(
        {"gb_type", "context", "explanation", "hints"} <= keywords,
        "torch._dynamo.exc.unimplemented(gb_type=, context=, explanation=, hints=)",
    )
    need(callable(getattr(torch.compiler, "is_compiling", None)), "torch.compiler.is_compiling")
    # Compiled graphs draw through the custom op rngcoord::draw (rngcoord.client._traced),
    # ordered in the graph by an effect token: it needs ORDERED effects on custom ops.
    try:
        from torch._library.custom_ops import CustomOpDef
        from torch._library.effects import EffectType

        effects_ok = callable(getattr(CustomOpDef, "register_effect", None)) and hasattr(
            EffectType, "ORDERED"
        )
    except ImportError:
        effects_ok = False
    need(effects_ok, "torch._library: CustomOpDef.register_effect(EffectType.ORDERED)")
    return missing


def check_torch(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTorchError` unless this torch has the internals rngcoord hooks.

    A torch that has them but whose (major, minor) is not in :data:`TESTED_TORCH` is accepted
    with a warning.

    Args:
        version: The version string to report and judge as tested or not. Default ``None``:
            ``torch.__version__``. The probe always looks at the installed torch.
    """
    text = torch.__version__ if version is None else version
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
    missing = missing_internals()
    if missing:
        raise UnsupportedTorchError(
            f"torch {text} lacks or has changed DTensor internals rngcoord hooks into: "
            f"{', '.join(missing)}; install a torch rngcoord is tested with ({tested})"
        )
    if torch_version(text) not in TESTED_TORCH:
        logger.warning(
            "rngcoord: torch %s has every DTensor internal rngcoord hooks into, but rngcoord "
            "is tested with torch %s only",
            text,
            tested,
        )
