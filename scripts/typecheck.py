"""Run mypy over the rngcoord packages.

The import packages live in server/, client/ and proto/rngcoord/v1 (see pyproject.toml's
package-dir). mypy maps files to modules by directory name, so this script lays a tree of
symbolic links, .build/typecheck/rngcoord/{server,client,v1}, and checks that.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKS = {"server": ROOT / "server", "client": ROOT / "client", "v1": ROOT / "proto/rngcoord/v1"}


def main() -> int:
    pkg = ROOT / ".build" / "typecheck" / "rngcoord"
    pkg.mkdir(parents=True, exist_ok=True)
    for name, target in LINKS.items():
        link = pkg / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["-p", "rngcoord.server", "-p", "rngcoord.client"]
    return subprocess.call(cmd, cwd=pkg.parent, env={"MYPYPATH": str(pkg.parent), "PATH": ""})


if __name__ == "__main__":
    sys.exit(main())
