"""Which random op DTensor is running, read from the frames that call the tracker, and the
stream that writes each op it accounts to the per-op trace (``install(trace=PATH)``).

DTensor hands the tracker a DTensorSpec, never the op: the op, and its scalar arguments, are
locals of the two places in torch that call into the tracker (``_CALLERS``), which
:mod:`rngcoord.client._compat` checks at install time. The tracker fingerprints each op by
its name and global shape, so that ranks agree on every op of a stream.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from rngcoord.client import _portable, _traced
from rngcoord.client._leases import StreamState
from rngcoord.client._router import random_op
from rngcoord.client._trace import OpTrace

if TYPE_CHECKING:
    from rngcoord.client._tracker import Stream

__all__ = ["TracedStream", "caller_args", "caller_op", "op_name"]


def op_name(op: object) -> str:
    # OpOverloads print as "aten.uniform_.default"; functions (torch.rand) have no stable
    # repr (it holds an address), so use the name.
    if isinstance(op, torch._ops.OpOverload):
        return str(op)
    return f"torch.{getattr(op, '__name__', type(op).__name__)}"


def _dispatch_code() -> types.CodeType | None:
    from torch.distributed.tensor import _dispatch

    slow_path = getattr(_dispatch.OpDispatcher, "_dispatch_get_local_results_slow_path", None)
    return getattr(slow_path, "__code__", None)


def _init_helper_code() -> types.CodeType | None:
    from torch.distributed.tensor import _api

    return getattr(getattr(_api, "_dtensor_init_helper", None), "__code__", None)


# The two places in torch that call into the tracker, and the local holding the random op:
# OpDispatcher._dispatch_get_local_results_slow_path (op_call; both the _distribute_region
# and the run_dtensor_rng_op path) and the DTensor factories' _dtensor_init_helper (init_op,
# torch.rand / torch.randn). rngcoord.client._compat checks both at install time.
_CALLERS: dict[types.CodeType | None, str] = {
    _dispatch_code(): "op_call",
    _init_helper_code(): "init_op",
    # The router's handler of the random ops DTensor leaves alone; wrapped by
    # torch.compiler.disable, and the frame that calls the tracker is the inner one.
    getattr(random_op, "__wrapped__", random_op).__code__: "op_call",
    # A compiled graph's rngcoord::draw, which sets op_call to the op DTensor's frame held
    # when the graph was traced: compiled and eager ops fingerprint alike.
    _traced._run.__code__: "op_call",
}
_CALLERS.pop(None, None)


def caller_args(frame: types.FrameType | None, op: object) -> dict[str, Any]:
    """The scalar arguments of the random op (``p`` of ``bernoulli_``...), read from the
    calling frame's ``args`` and ``kwargs`` (the router's handler has them), for the trace;
    empty where they cannot be read."""
    for _ in range(4):
        if frame is None or not isinstance(op, torch._ops.OpOverload):
            return {}
        if frame.f_code in _CALLERS:
            args, kwargs = frame.f_locals.get("args"), frame.f_locals.get("kwargs")
            if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
                return {}
            try:
                bound = _portable.bind_op_args(op, args, kwargs)
            except (TypeError, ValueError):
                return {}
            return {k: v for k, v in bound.items() if isinstance(v, (int, float, bool))}
        frame = frame.f_back
    return {}


def caller_op(frame: types.FrameType | None) -> object | None:
    """The random op that DTensor is running, read from the frame that called the tracker
    or one of the few above it (torch.compiler.disable puts its wrapper in between)."""
    for _ in range(4):
        if frame is None:
            return None
        local = _CALLERS.get(frame.f_code)
        if local is not None:
            return frame.f_locals.get(local)
        frame = frame.f_back
    return None


class TracedStream:
    """A stream that writes each op it accounts to the trace (install(trace=PATH))."""

    def __init__(
        self,
        stream: Stream,
        trace: OpTrace,
        group: str,
        spec: DTensorSpec,
        caller: types.FrameType | None,
    ) -> None:
        self._stream = stream
        self._trace = trace
        self._group = group
        self._spec = spec
        self._caller = caller

    @property
    def seed(self) -> int:
        return self._stream.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._stream.seed = value

    @property
    def cursor(self) -> int:
        return self._stream.cursor

    @property
    def digest(self) -> bytes:
        return self._stream.digest

    @property
    def state(self) -> StreamState:
        return self._stream.state

    def advance(self, size: int, op_key: bytes) -> int:
        base = self._stream.advance(size, op_key)
        meta = self._spec.tensor_meta
        dtype = str(meta.dtype).removeprefix("torch.") if meta is not None else "unknown"
        op = caller_op(self._caller)
        name = "<unknown op>" if op is None else op_name(op)
        self._trace.record(
            self._group,
            base,
            size,
            tuple(self._spec.shape),
            dtype,
            name,
            caller_args(self._caller, op),
        )
        return base
