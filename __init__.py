"""Not a module: the root of a checkout of the rngcoord repository.

The package ``rngcoord`` is a namespace package split across three roots of this repository:
``proto/rngcoord`` (rngcoord.v1), ``server/rngcoord`` (rngcoord.server) and
``client/rngcoord`` (rngcoord.client). A checkout cloned into a directory named ``rngcoord``
looks like a fourth portion of it to Python whenever the clone's parent directory is on
sys.path: the current directory for ``python -c``, ``python -m`` and the REPL, a script's own
directory, or PYTHONPATH. Without this file the clone became the namespace package itself and
its ``client/`` directory an empty ``rngcoord.client`` (ImportError: cannot import name
'LeaseManager' from 'rngcoord.client' (unknown location)): an editable install is found by a
meta path finder that Python consults only after sys.path has produced that namespace.

This file makes the clone a regular package, which Python prefers to namespace portions, so
that the import runs this code and it can tell what happened:

- an installed rngcoord whose portions are on sys.path (a wheel, or an editable install in
  compat mode) is used, as before this file existed, with the clone taken out of its path;
- otherwise (an editable install, or none) the import fails with an error that names the
  clone and the sys.path entry that put it there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _entry_of(directory: Path) -> str:
    for entry in sys.path:
        if Path(entry or os.getcwd()).resolve() == directory:
            return entry
    return str(directory)


def _installed_portions(clone: Path) -> list[str]:
    # A portion counts only if it holds a regular subpackage, as an installed rngcoord does:
    # another clone beside this one is no better than this one.
    found: list[str] = []
    for entry in sys.path:
        portion = Path(entry or os.getcwd()) / "rngcoord"
        try:
            if portion.resolve() == clone or not portion.is_dir():
                continue
        except OSError:
            continue
        if any((portion / sub / "__init__.py").is_file() for sub in ("client", "server", "v1")):
            found.append(str(portion))
    return found


if __name__ == "rngcoord":
    _clone = Path(__file__).resolve().parent
    _portions = _installed_portions(_clone)
    if _portions:
        __path__ = _portions
    else:
        _entry = _entry_of(_clone.parent)
        _where = f"the current directory, {os.getcwd()}" if _entry == "" else repr(_entry)
        raise ImportError(
            f"{_clone} is a checkout of the rngcoord repository, not the rngcoord package, and "
            f"it shadows the installed package: its parent directory is on sys.path as "
            f"{_where}, so `import rngcoord` found the checkout first. Run Python from another "
            f"directory (or take {_clone.parent} off PYTHONPATH); to use this checkout, "
            f"install it: pip install -e {_clone}",
            name="rngcoord",
            path=__file__,
        )
