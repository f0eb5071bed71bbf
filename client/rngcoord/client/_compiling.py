"""What the client needs from torch.compile: a typed way to keep Dynamo out of its code.

DTensor's dispatch runs the tracker's Python code from frames that Dynamo resumes after a
graph break; Dynamo would try to compile that code too (and fail in its guards). Everything
the tracker runs on behalf of DTensor is therefore wrapped in :func:`not_compiled`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def not_compiled(fn: _F) -> _F:
    """``torch.compiler.disable`` with its type kept: Dynamo never compiles ``fn`` or what it
    calls."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]
