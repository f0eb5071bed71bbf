"""The per-op trace of one rank (``install(trace=PATH)``): one JSON line per random op drawn
from the tracker's streams, for ``rngcoord replay --trace``.

Each line is ``{"op_index", "rank", "group", "policy", "cursor", "size", "shape", "dtype",
"op", "args"}``: the op's index among this rank's drawn ops (from 0), the group (stream) it drew
from, the tracker's policy, the group's cursor before the op and the offsets it moved by, the
global shape, the dtype, the op (``aten.bernoulli_.float``) and its scalar arguments
(``{"p": 0.75}``: DTensor's dropout draws ``bernoulli_`` with the keep probability). Writes
are buffered and the trace talks to nobody: no RPC and no device sync on the hot path. Lines
reach the file when the buffer fills and at ``tracker.close()``; a crashed process loses its
buffered tail.

``{rank}`` in PATH is replaced by the rank's global rank; the path must differ per rank.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any


def trace_path(path: str | os.PathLike[str], rank: int) -> Path:
    """PATH with ``{rank}`` replaced by ``rank``."""
    return Path(str(os.fspath(path)).replace("{rank}", str(rank)))


class OpTrace:
    """An open trace file of one rank."""

    def __init__(self, path: str | os.PathLike[str], rank: int, policy: str) -> None:
        self.path = trace_path(path, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("w", buffering=1 << 16)
        self._rank = rank
        self._policy = policy
        self._index = 0
        self._lock = threading.Lock()

    def record(
        self,
        group: str,
        cursor: int,
        size: int,
        shape: Sequence[int],
        dtype: str,
        op: str,
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """Append one op (a buffered write)."""
        with self._lock:
            if self._file is None:
                return
            line = {
                "op_index": self._index,
                "rank": self._rank,
                "group": group,
                "policy": self._policy,
                "cursor": cursor,
                "size": size,
                "shape": list(shape),
                "dtype": dtype,
                "op": op,
                "args": dict(args or {}),
            }
            self._index += 1
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Flush and close the file; later records are dropped."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_trace(text: str) -> list[dict[str, Any]]:
    """The records of a trace file, in order."""
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number} of the trace is not JSON: {e}") from None
        if not isinstance(record, dict) or "op_index" not in record:
            raise ValueError(f"line {number} is not a trace record (install(trace=PATH))")
        records.append(record)
    return records
