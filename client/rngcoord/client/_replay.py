"""``rngcoord replay``: regenerate an audited op's values offline, from an audit export.

Under the ``sharding_invariant`` policy an op's values are a pure function of the group's seed,
the op's cursor, the op and the global shape (:mod:`rngcoord.client._invariant`). The audit log
holds the seed (the ``group`` record) and every lease granted (``grant`` records), so from an
export (``rngcoord audit --json --job JOB > audit.jsonl``) this command checks that the op's
offsets were granted to the group, says by which leases (epoch, seq, rank, time), and writes
the whole tensor, or one shard of it, exactly as the ranks drew it::

    rngcoord audit --db sqlite:///rngcoord.db --json --job run-42 > audit.jsonl
    rngcoord replay audit.jsonl --job run-42 --group invariant --cursor 1024 \\
        --op dropout --shape 8,64 --arg p=0.25 -o mask.pt

The cursor is the group's cursor before the op (``tracker.get_offset(group)``, or the sum of
the earlier ops' sizes). A per-op trace (``install(trace=PATH)``; ``train_tp --record-masks``
writes one per rank) gives it, with the group, shape, dtype and op, for any op of the run::

    rngcoord replay audit.jsonl --job run-42 --trace trace.jsonl --op-index 5 --arg p=0.25

Only groups drawn under the ``sharding_invariant`` policy can be replayed: values drawn under
the default ``offsets`` policy come from the device's own generator, at offsets that depend
on the mesh, and cannot be regenerated off the device. The policy shows in the group's name
(:func:`rngcoord.client._groups.policy_of`: ``invariant`` or ``invariant[pp:1]``), and in
the trace; replay refuses other groups, naming their policy.

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

from rngcoord.client import _portable
from rngcoord.client._groups import policy_of
from rngcoord.client._trace import read_trace

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
    _check_policy(group, "the group")
    seed = None
    grants = []
    groups: set[str] = set()
    for record in _records(lines):
        if record.get("job") != job:
            continue
        if record.get("group"):
            groups.add(record["group"])
        if record.get("group") != group:
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
        if not groups:
            raise ValueError(f"the export has no record of job {job!r}: wrong job or export")
        invariant = sorted(g for g in groups if policy_of(g) == "sharding_invariant")
        if group not in groups and not invariant:
            raise ValueError(
                f"job {job!r} has no sharding_invariant group: its groups "
                f"({', '.join(sorted(groups))}) were drawn under the offsets policy, whose "
                "values come from the device's generator and cannot be replayed; run the job "
                'with install(policy="sharding_invariant") to replay its ops'
            )
        if group not in groups:
            raise ValueError(
                f"job {job!r} has no group {group!r} in the export; its sharding_invariant "
                f"groups: {', '.join(invariant)}"
            )
        raise ValueError(
            f"the export has records of job {job!r} group {group!r} but not its 'group' "
            "record (its seed): export the whole job (rngcoord audit --json --job JOB), not "
            "a time window"
        )
    return seed, grants


def _check_policy(group: str, where: str) -> None:
    policy = policy_of(group)
    if policy != "sharding_invariant":
        raise ValueError(
            f"{where} {group!r} was drawn under the {policy} policy: its values come from the "
            "device's generator at mesh-dependent offsets and cannot be replayed; only "
            'sharding_invariant groups can (install(policy="sharding_invariant"))'
        )


@dataclass(frozen=True)
class TracedOp:
    """One op of a trace (install(trace=PATH))."""

    group: str
    cursor: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    args: dict[str, Any]


def traced_op(text: str, index: int) -> TracedOp:
    """Op ``index`` of a trace file's text."""
    records = read_trace(text)
    found = [r for r in records if r["op_index"] == index]
    if not found:
        raise ValueError(f"the trace has no op {index} (ops 0 to {len(records) - 1})")
    record = found[0]
    policy = record.get("policy", "offsets")
    if policy != "sharding_invariant":
        raise ValueError(
            f"op {index} of the trace was drawn under the {policy} policy (group "
            f"{record['group']!r}): its values come from the device's generator at "
            "mesh-dependent offsets and cannot be replayed; only sharding_invariant ops can "
            '(install(policy="sharding_invariant"))'
        )
    op = str(record["op"])
    # "aten.native_dropout.default" -> "native_dropout"
    parts = op.split(".")
    if len(parts) == 3 and parts[0] == "aten":
        op = parts[1]
    elif op.startswith("torch."):
        op = op.removeprefix("torch.")
    if record["dtype"] not in _DTYPES:
        raise ValueError(f"op {index} of the trace has dtype {record['dtype']!r}")
    return TracedOp(
        str(record["group"]),
        int(record["cursor"]),
        op,
        tuple(int(n) for n in record["shape"]),
        str(record["dtype"]),
        dict(record.get("args") or {}),
    )


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
    parser.add_argument(
        "--trace",
        type=Path,
        help="a rank's per-op trace (install(trace=PATH)): the op's group, cursor, op, shape "
        "and dtype come from its --op-index line",
    )
    parser.add_argument("--op-index", type=int, help="the op of --trace, from 0")
    parser.add_argument("--group", help="the group (default: invariant, or the trace's)")
    parser.add_argument("--cursor", type=int, help="the group's cursor before the op")
    parser.add_argument(
        "--op",
        help=f"the op: {', '.join(sorted(_portable.SUPPORTED_OPS))}",
    )
    parser.add_argument("--shape", help="the global shape, e.g. 8,64")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="default: float32")
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an argument of the op, e.g. p=0.25 or from=-1, over the trace's; repeatable",
    )
    parser.add_argument(
        "--ranges",
        help="only this box of the global tensor: START:LEN per dim, e.g. 0:8,32:32 "
        "(default: all of it)",
    )
    parser.add_argument("-o", "--output", type=Path, help="write the tensor here (torch.save)")
    args = parser.parse_args(argv)
    if (args.trace is None) != (args.op_index is None):
        parser.error("--trace and --op-index go together")
    if args.trace is None:
        missing = [f"--{n}" for n in ("cursor", "op", "shape") if getattr(args, n) is None]
        if missing:
            parser.error(f"{', '.join(missing)} required (or --trace FILE --op-index N)")
    return args


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        return float(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rngcoord replay``; returns the exit status (2: bad input or not granted)."""
    args = _parse_args(argv)
    try:
        if args.trace is not None:
            traced = traced_op(args.trace.read_text(), args.op_index)
            if args.group is not None and args.group != traced.group:
                raise ValueError(f"op {args.op_index} of the trace is of group {traced.group!r}")
            args.group, args.cursor, args.op = traced.group, traced.cursor, traced.op
            args.shape = ",".join(map(str, traced.shape))
            args.dtype = args.dtype or traced.dtype
        args.group = args.group or "invariant"
        args.dtype = args.dtype or "float32"
        shape = tuple(int(n) for n in args.shape.split(",") if n)
        op_args: dict[str, Any] = dict(traced.args) if args.trace is not None else {}
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
        blocks = _portable.offsets_consumed(args.op, shape, dtype, **op_args)
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
        _portable.portable_fill_(
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
