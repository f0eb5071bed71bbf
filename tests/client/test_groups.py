"""rngcoord.client._groups: group names follow the contract's rule, read well, and differ."""

from __future__ import annotations

import doctest

from hypothesis import given
from hypothesis import strategies as st

from rngcoord.client import (
    _groups,
)
from rngcoord.v1.rules import NAME_PATTERN


def test_docstring_examples() -> None:
    """The worked examples in the module's docstrings hold."""
    result = doctest.testmod(_groups, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


@given(
    names=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3),
    ranks=st.lists(st.integers(0, 4096), min_size=1, max_size=80, unique=True),
)
def test_group_names_follow_the_coordinators_rule(names: list[str], ranks: list[int]) -> None:
    shape = [len(ranks)] + [1] * (len(names) - 1)
    name = _groups.group_name(names, shape, ranks)
    assert NAME_PATTERN.fullmatch(name), name
    assert name != _groups.group_name(names, shape, ranks[::-1]) or len(ranks) == 1


def test_group_names_are_readable_and_distinct() -> None:
    assert _groups.group_name(("dp", "tp"), (2, 2), [0, 1, 2, 3]) == "dp:2,tp:2[0-3]"
    assert _groups.group_name(("dp", "tp"), (1, 4), [0, 1, 2, 3]) == "dp:1,tp:4[0-3]"
    assert _groups.group_name(("pp",), (3,), [4, 5, 9]) == "pp:3[4-5.9]"
    assert _groups.group_name(("x y",), (2,), [0, 1]).startswith("mesh[sha:")
