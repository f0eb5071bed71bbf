"""rngcoord.client's public face, pinned (as httpx's tests/test_exported_members.py does): the
names users import, each documented, and one exception hierarchy. A change here is a change
to every training script that uses rngcoord: make it on purpose."""

from __future__ import annotations

import inspect
import pkgutil
import re
from typing import Any

import rngcoord.client as client
from rngcoord.client import RNGCoordError

PUBLIC = [
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


def test_the_public_names_are_these() -> None:
    assert client.__all__ == PUBLIC
    assert all(hasattr(client, name) for name in PUBLIC)


def test_every_public_class_and_function_is_documented() -> None:
    undocumented = [
        name
        for name in PUBLIC
        if (inspect.isclass(obj := getattr(client, name)) or inspect.isfunction(obj))
        and not (inspect.getdoc(obj) or "").strip()
    ]
    assert undocumented == []
    # The one constant is named in the package's docstring.
    assert ":data:`SUPPORTED_TORCH`" in (client.__doc__ or "")


def test_every_public_error_is_an_rngcoord_error() -> None:
    errors = [
        getattr(client, name)
        for name in PUBLIC
        if inspect.isclass(getattr(client, name)) and issubclass(getattr(client, name), Exception)
    ]
    assert len(errors) == 15
    assert all(issubclass(error, RNGCoordError) for error in errors)


def test_every_other_module_is_private() -> None:
    # Files behind the public names may move: only rngcoord.client itself and its torchft
    # integration (imported on its own, torchft being an optional extra) are public modules.
    modules = [m.name for m in pkgutil.iter_modules(client.__path__)]
    assert [name for name in modules if not name.startswith("_")] == ["torchft"]
    assert len(modules) > 20


def _undocumented_arguments(objects: list[Any]) -> list[str]:
    # Each argument is described in the docstring's Args section: a line that starts with
    # "name:" (or "name (type):"), not merely the name somewhere in the text.
    return [
        f"{obj.__qualname__}({param})"
        for obj in objects
        for param in inspect.signature(obj).parameters
        if param not in ("self", "args", "kwargs")
        and not re.search(rf"^\s*{re.escape(param)}( \([^)]*\))?:", inspect.getdoc(obj) or "", re.M)
    ]


def test_every_argument_of_a_public_class_or_function_is_documented() -> None:
    callables = [
        obj
        for name in PUBLIC
        if (inspect.isclass(obj := getattr(client, name)) and not issubclass(obj, Exception))
        or inspect.isfunction(obj)
    ]
    assert len(callables) == 6
    assert _undocumented_arguments(callables) == []


def test_the_torchft_integration_s_public_names_are_these_and_documented() -> None:
    import rngcoord.client.torchft as torchft

    assert torchft.__all__ == ["HISTORY_STEPS", "STATE_KEY", "Attachment", "Quorum", "attach"]
    # The two constants are documented by the attribute docstrings beside them.
    assert all(
        inspect.getdoc(getattr(torchft, name)) for name in ("attach", "Attachment", "Quorum")
    )
    assert _undocumented_arguments([torchft.attach, torchft.Attachment]) == []
