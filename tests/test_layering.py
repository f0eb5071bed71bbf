"""The layering of docs/design.md §3, checked on the code: data flows proto → server and
proto → client, the server never imports torch (the coordinator image has none), the
client never imports the server, and examples/ uses only the client's public API.

Every module's import statements are read from its source (static: a function-level import
counts too), and the server package is also imported in a fresh interpreter to see that torch
stays out of sys.modules.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# root folder -> module prefixes its modules must never import
FORBIDDEN = {
    "proto": ("rngcoord.server", "rngcoord.client", "torch"),
    "server": ("rngcoord.client", "torch"),
    "client": ("rngcoord.server",),
    # The library every rank imports never loads the demo that lives beside it.
    "client/rngcoord/client": ("rngcoord.server", "rngcoord.demo"),
    # The examples are what users copy: the public API only, never a private module.
    "examples": (
        "rngcoord.server",
        *sorted(
            f"rngcoord.client.{p.stem}"
            for p in (ROOT / "client" / "rngcoord" / "client").glob("_*.py")
            if p.stem != "__init__"
        ),
    ),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (one import style: absolute)"
            assert node.module is not None
            found.add(node.module)
            # `from pkg import mod` imports pkg.mod when mod is a module.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("root", sorted(FORBIDDEN))
def test_imports_follow_the_layers(root: str) -> None:
    files = sorted((ROOT / root).rglob("*.py"))
    assert files, f"no modules under {root}/"
    broken = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(_imports(path))
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[root])
    ]
    assert not broken, "\n".join(broken)


def test_server_package_loads_without_torch() -> None:
    # Every module, subpackages included (rngcoord.server.core.coordinator, ...).
    top = ROOT / "server"
    modules = sorted(
        ".".join(p.relative_to(top).with_suffix("").parts)
        for p in (top / "rngcoord" / "server").rglob("*.py")
        if p.stem != "__init__"
    )
    assert "rngcoord.server.core.coordinator" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "sys.exit('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or "importing rngcoord.server loaded torch"


def test_server_public_names_load_lazily() -> None:
    code = (
        "import sys, rngcoord.server as server\n"
        "assert 'grpc' not in sys.modules, 'the package imported grpc eagerly'\n"
        "missing = [n for n in server.__all__ if getattr(server, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert sorted(server.__all__) == sorted(server._EXPORTS)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_client_loads_neither_torchft_nor_the_demo() -> None:
    # torchft is an optional extra: rngcoord.client.torchft uses the Manager it is given.
    # Every rank imports the client; the demo is for `rngcoord demo` alone. One process
    # checks both (each import of torch costs seconds).
    code = (
        "import sys, rngcoord.client, rngcoord.client.torchft\n"
        "loaded = [m for m in ('torchft', 'rngcoord.demo') if m in sys.modules]\n"
        "sys.exit(f'importing rngcoord.client loaded {loaded}' if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_lint_imports_names_the_contract_a_wrong_import_breaks(tmp_path: Path) -> None:
    # make lint runs the contracts on the tree; here one wrong import is written into a copy
    # of the server (the rules importing grpc), to see that they catch it and say which.
    for part in ("server", "proto"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with (tmp_path / "server" / "rngcoord" / "server" / "core" / "seeds.py").open("a") as f:
        f.write("import grpc  # the wrong import\n")
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--config", "pyproject.toml"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'server'}{os.pathsep}{tmp_path / 'proto'}"},
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0, result.stdout
    assert "2 kept, 1 broken" in result.stdout, result.stdout
    assert "The rules (core) never import a transport" in result.stdout
    assert "rngcoord.server.core.seeds -> grpc" in result.stdout
