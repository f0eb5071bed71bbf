"""``rngcoord replay``: regenerate an audited op's values offline, from an audit export.

Under the ``sharding_invariant`` policy an op's values are a pure function of the group's seed,
the op's cursor, the op and the global shape (:mod:`rngcoord.client.invariant`). The audit log
holds the seed (the ``group`` record) and every lease granted (``grant`` records), so from an
export (``rngcoord audit --json --job JOB > audit.jsonl``) this command checks that the op's
offsets were granted to the group, says by which leases (epoch, seq, rank, time), and writes
the whole tensor, or one shard of it, exactly as the ranks drew it::

    rngcoord audit --db sqlite:///rngcoord.db --json --job run-42 > audit.jsonl
    rngcoord replay audit.jsonl --job run-42 --group invariant --cursor 1024 \\
        --op dropout --shape 8,64 --arg p=0.25 -o mask.pt

The cursor is the group's cursor before the op (``tracker.get_offset(group)``, or the sum of
the earlier ops' sizes). Values drawn under the default ``offsets`` policy come from the
device's own generator and cannot be regenerated off the device; replay refuses nothing about
them, but only the portable values are what it writes.

It reads no store and needs no coordinator: only the export and torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rngcoord.client import portable

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


@dataclass(frozen=True)
class Grant:
    """A lease of the audit log: ``[start, end)`` of group ``group``'s seed."""

    epoch: int
    seq: int
    start: int
    end: int
    rank: int
    time: str


def _records(lines: Iterable[str]) -> Iterable[dict[str, Any]]:
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {number} of the export is not JSON: {e}") from None
            if not isinstance(record, dict) or "kind" not in record:
                raise ValueError(f"line {number} is not an audit record (rngcoord audit --json)")
            yield record


def group_facts(lines: Iterable[str], job: str, group: str) -> tuple[int, list[Grant]]:
    """The group's seed and its grants, from an audit export."""
    seed = None
    grants = []
    for record in _records(lines):
        if record.get("job") != job or record.get("group") != group:
            continue
        detail = record.get("detail") or {}
        if record["kind"] == "group":
            seed = int(detail["seed"])
        elif record["kind"] == "grant":
            grants.append(
                Grant(
                    detail["epoch"],
                    detail["seq"],
                    detail["start"],
                    detail["end"],
                    detail["rank"],
                    record.get("time", ""),
                )
            )
    if seed is None:
        raise ValueError(
            f"the export has no 'group' record of job {job!r} group {group!r}: export the "
            "whole job (rngcoord audit --json --job JOB), not a time window"
        )
    return seed, grants


def covering(grants: Sequence[Grant], start: int, end: int) -> list[Grant]:
    """Grants that together cover ``[start, end)``, in offset order; empty if none do."""
    chosen: list[Grant] = []
    at = start
    for grant in sorted(grants, key=lambda g: (g.start, -g.end)):
        if at >= end:
            break
        if grant.start <= at < grant.end:
            chosen.append(grant)
            at = grant.end
    return chosen if at >= end else []


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rngcoord replay",
        description="Regenerate a sharding_invariant DTensor random op's values from an "
        "audit export (rngcoord audit --json).",
    )
    parser.add_argument("export", type=Path, help="the audit export, JSON lines ('-': stdin)")
    parser.add_argument("--job", required=True, help="the job")
    parser.add_argument("--group", default="invariant", help="the group (default: invariant)")
    parser.add_argument(
        "--cursor", type=int, required=True, help="the group's cursor before the op"
    )
    parser.add_argument(
        "--op",
        required=True,
        help=f"the op: {', '.join(sorted(portable.SUPPORTED_OPS))}",
    )
    parser.add_argument("--shape", required=True, help="the global shape, e.g. 8,64")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an argument of the op, e.g. p=0.25 or from=-1; repeatable",
    )
    parser.add_argument(
        "--ranges",
        help="only this box of the global tensor: START:LEN per dim, e.g. 0:8,32:32 "
        "(default: all of it)",
    )
    parser.add_argument("-o", "--output", type=Path, help="write the tensor here (torch.save)")
    return parser.parse_args(argv)


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        return float(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rngcoord replay``; returns the exit status (2: bad input or not granted)."""
    args = _parse_args(argv)
    try:
        shape = tuple(int(n) for n in args.shape.split(",") if n)
        op_args = {}
        for item in args.arg:
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--arg {item!r} is not NAME=VALUE")
            op_args[name] = _number(value)
        ranges: list[tuple[int, int]] | None = None
        if args.ranges:
            ranges = []
            for part in args.ranges.split(","):
                first, _, length = part.partition(":")
                ranges.append((int(first), int(length)))
        dtype = _DTYPES[args.dtype]
        text = sys.stdin.read() if str(args.export) == "-" else args.export.read_text()
        seed, grants = group_facts(text.splitlines(), args.job, args.group)
        if args.cursor % 4:
            raise ValueError(f"--cursor must be a multiple of 4, got {args.cursor}")
        blocks = portable.offsets_consumed(args.op, shape, dtype, **op_args)
        start, end = args.cursor, args.cursor + 4 * blocks
        used = covering(grants, start, end) if blocks else []
        if blocks and not used:
            raise ValueError(
                f"offsets [{start}, {end}) of group {args.group!r} were never granted in the "
                f"export ({len(grants)} grants): wrong cursor, group or job"
            )
        op = args.op
        if op in ("dropout", "native_dropout"):
            local = torch.ones([n for _, n in ranges] if ranges else shape, dtype=dtype)
        else:
            local = torch.empty([n for _, n in ranges] if ranges else shape, dtype=dtype)
        portable.portable_fill_(
            op,
            local,
            seed=seed,
            base_offset=start // 4,
            global_shape=shape,
            local_ranges=ranges,
            **op_args,
        )
    except (ValueError, TypeError, NotImplementedError, KeyError, OSError) as e:
        print(f"rngcoord replay: error: {e}", file=sys.stderr)
        return 2
    for grant in used:
        print(
            f"granted: epoch {grant.epoch} seq {grant.seq} [{grant.start}, {grant.end}) to "
            f"rank {grant.rank} at {grant.time}"
        )
    digest = hashlib.sha256(local.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    print(
        f"{op}{list(shape)} {args.dtype} at cursor {start} of {args.group!r} (seed {seed}): "
        f"{local.numel()} values, sha256 {digest[:16]}; next cursor {end}"
    )
    if args.output is not None:
        torch.save(local, args.output)
        print(f"written to {args.output}")
    else:
        print(local)
    return 0


if __name__ == "__main__":
    sys.exit(main())
