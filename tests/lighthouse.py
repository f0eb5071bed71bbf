"""A real torchft Lighthouse (the ``torchft_lighthouse`` command of the torchft extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ports import free_port

__all__ = ["Lighthouse"]


class Lighthouse:
    """A ``torchft_lighthouse`` subprocess on 127.0.0.1 that forms a quorum of
    ``min_replicas`` or more replicas, and notices a dead one within a second.

    Args:
        workdir: where its log goes.
        min_replicas: the fewest replicas a quorum has.
    """

    def __init__(self, workdir: Path, min_replicas: int = 1) -> None:
        self.port = free_port()
        binary = Path(sys.executable).with_name("torchft_lighthouse")
        self.log = (workdir / f"lighthouse-{self.port}.log").open("w")
        self.proc = subprocess.Popen(
            [str(binary), f"--min_replicas={min_replicas}", f"--bind=127.0.0.1:{self.port}",
             "--join_timeout_ms=1000", "--heartbeat_timeout_ms=1000"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
