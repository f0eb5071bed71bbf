"""The CLI reference's `rngcoord serve` flag table (docs/operations.md) against the real
`rngcoord serve --help`, and every relative link in README.md, examples/README.md and docs/
resolving to a file and heading.

Every flag in one is in the other; each flag's environment variable is the same in both; and
where both give a default as one word (a number, an address, `off`), it is the same word.
The help comes from the installed console script, in a process of its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
ENV = re.compile(r"\bRNGCOORD_[A-Z0-9_]+(?:=1)?")


@dataclass
class Row:
    envs: list[str] = field(default_factory=list)
    default: str = ""


def _readme_table() -> dict[str, Row]:
    lines = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8").splitlines()
    start = next(
        i for i, line in enumerate(lines) if "`rngcoord serve` runs the coordinator" in line
    )
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("| flag | env |"))
    rows: dict[str, Row] = {}
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        # `\|` inside a cell is a literal bar (`--metrics HOST:PORT\|off`).
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        flags, envs = FLAG.findall(cells[0]), ENV.findall(cells[1])
        assert len(envs) in (0, 1, len(flags)), f"README row {line!r}: which env is whose?"
        for i, flag in enumerate(flags):
            own = [envs[i]] if len(envs) == len(flags) else envs
            rows[flag] = Row(own, cells[2].strip("`"))
    return rows


def _help() -> dict[str, Row]:
    script = Path(sys.executable).with_name("rngcoord")
    env = {**os.environ, "COLUMNS": "400"}  # one line per option where argparse allows it
    out = subprocess.run(
        [str(script), "serve", "--help"], env=env, capture_output=True, text=True, check=True
    ).stdout
    options = out.split("options:", 1)[1]
    blocks = re.split(r"\n(?=  -)", options)
    rows: dict[str, Row] = {}
    for block in blocks:
        text = " ".join(block.split())
        invocation = re.split(r"\s{2,}", block.strip(), maxsplit=1)[0]
        flags = [f for f in FLAG.findall(invocation) if f != "--help"]
        if not flags:
            continue
        default = re.search(r"default ([^\s;)]+)\)", text)
        rows[flags[0]] = Row(ENV.findall(text), default.group(1) if default else "")
    return rows


@pytest.fixture(scope="module")
def tables() -> tuple[dict[str, Row], dict[str, Row]]:
    return _readme_table(), _help()


def test_every_flag_is_in_both(tables: tuple[dict[str, Row], dict[str, Row]]) -> None:
    readme, help_ = tables
    assert len(help_) > 20, help_  # the parse found the options
    assert sorted(set(help_) - set(readme)) == [], "in --help, missing from README's table"
    assert sorted(set(readme) - set(help_)) == [], "in README's table, not in --help"


def test_environment_variables_agree(tables: tuple[dict[str, Row], dict[str, Row]]) -> None:
    readme, help_ = tables
    wrong = {
        flag: (readme[flag].envs, row.envs)
        for flag, row in help_.items()
        if flag in readme and readme[flag].envs != row.envs
    }
    assert wrong == {}, "flag: (README, --help)"


def test_one_word_defaults_agree(tables: tuple[dict[str, Row], dict[str, Row]]) -> None:
    readme, help_ = tables
    compared = {
        flag: (readme[flag].default, row.default)
        for flag, row in help_.items()
        if flag in readme and row.default and " " not in readme[flag].default
    }
    assert len(compared) >= 10, compared
    wrong = {flag: pair for flag, pair in compared.items() if pair[0] != pair[1]}
    assert wrong == {}, "flag: (README, --help)"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: Path) -> set[str]:
    """GitHub's anchors of a file's headings: lower case, punctuation dropped, spaces as -."""
    anchors = set()
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_relative_link_in_the_docs_resolves() -> None:
    pages = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted(ROOT.glob("docs/*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
