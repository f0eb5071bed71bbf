"""A checkout of the repository in a directory named ``rngcoord`` on sys.path (the current
directory, PYTHONPATH) used to become the ``rngcoord`` namespace package and turn
``rngcoord.client`` into an empty one ("cannot import name 'LeaseManager' from
'rngcoord.client' (unknown location)"). The checkout's root ``__init__.py`` now names the
path doing the shadowing, or steps aside where an installed rngcoord is on sys.path.

Each case runs a real interpreter of this venv (rngcoord installed editable, as `make`
installs it) in a directory holding a copy of this checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Each test starts Python processes on a copied checkout: seconds each.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
IMPORT = "from rngcoord.client import LeaseManager; import rngcoord.client as c; print(c.__file__)"


def _clone(parent: Path, name: str = "rngcoord") -> Path:
    """What `git clone` of this repository into ``parent/name`` holds, as far as Python sees."""
    clone = parent / name
    clone.mkdir(parents=True)
    shutil.copy(ROOT / "__init__.py", clone / "__init__.py")
    for root in ("proto", "server", "client"):
        shutil.copytree(ROOT / root, clone / root, ignore=shutil.ignore_patterns("__pycache__"))
    return clone


def _python(
    code: str, cwd: Path, pythonpath: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _installed_on_sys_path() -> bool:
    return any((Path(p or ".") / "rngcoord" / "client" / "__init__.py").is_file() for p in sys.path)


@pytest.fixture
def editable_only() -> None:
    if _installed_on_sys_path():
        pytest.skip("rngcoord's portions are on sys.path here (not an editable install)")


@pytest.mark.usefixtures("editable_only")
def test_a_clone_in_the_current_directory_is_named(tmp_path: Path) -> None:
    clone = _clone(tmp_path)
    result = _python(IMPORT, cwd=tmp_path)
    assert result.returncode == 1
    assert "unknown location" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: {clone} is a checkout of the rngcoord repository"), last
    assert f"on sys.path as the current directory, {tmp_path}" in last
    assert f"pip install -e {clone}" in last


@pytest.mark.usefixtures("editable_only")
def test_a_clone_on_pythonpath_is_named(tmp_path: Path) -> None:
    clone = _clone(tmp_path / "src")
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    result = _python(IMPORT, cwd=elsewhere, pythonpath=str(clone.parent))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert f"{clone} is a checkout" in last
    assert f"on sys.path as {str(clone.parent)!r}" in last
    assert f"take {clone.parent} off PYTHONPATH" in last


def test_an_installed_package_on_sys_path_wins_over_the_clone(tmp_path: Path) -> None:
    # Portions of rngcoord on sys.path with regular subpackages: what a wheel install, or an
    # editable install in compat mode, puts there. The clone steps aside, as it did before
    # it had an __init__.py.
    _clone(tmp_path)
    roots = os.pathsep.join(str(ROOT / r) for r in ("proto", "server", "client"))
    code = IMPORT + "; import rngcoord; print(list(rngcoord.__path__))"
    result = _python(code, cwd=tmp_path, pythonpath=roots)
    assert result.returncode == 0, result.stderr
    client_file, path = result.stdout.strip().splitlines()
    assert Path(client_file) == ROOT / "client" / "rngcoord" / "client" / "__init__.py"
    assert str(tmp_path) not in path


def test_a_plain_rngcoord_directory_does_not_shadow(tmp_path: Path) -> None:
    # A directory that merely has the name (a checkpoint folder, say) is a harmless namespace
    # portion: nothing in it is named like rngcoord's subpackages.
    (tmp_path / "rngcoord" / "checkpoints").mkdir(parents=True)
    result = _python(IMPORT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(ROOT)


def test_the_checkout_root_imports_quietly_under_another_name(tmp_path: Path) -> None:
    _clone(tmp_path, name="checkout")
    result = _python("import checkout; print(checkout.__name__)", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "checkout"
