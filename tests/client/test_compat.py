"""rngcoord.client.compat: the supported torch versions and the DTensor internals check."""

from __future__ import annotations

import pytest

from rngcoord.client import (
    UnsupportedTorchError,
    compat,
)


def test_torch_check() -> None:
    compat.check_torch()
    assert compat.missing_internals() == []
    assert compat.torch_version("2.14.0a0+git1234") == (2, 14)
    with pytest.raises(UnsupportedTorchError, match=r"supported: 2\.13, 2\.14"):
        compat.check_torch("2.12.1")
