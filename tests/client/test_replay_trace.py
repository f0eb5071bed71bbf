"""rngcoord replay knows which groups it can replay, and replays any op of a run from a
per-op trace (install(trace=PATH)); a resume across a resize under the offsets policy says
that the random stream cannot rewind.

The unit tests run in-process; the e2e ones run examples/train_tp.py under torchrun."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_invariant import BATCH, SEED, _full_masks

from harness import run_cli
from rngcoord import demo
from rngcoord.client import _replay
from rngcoord.client._coordinated import resize_message
from rngcoord.client._groups import mesh_of_name, policy_of
from rngcoord.client._trace import OpTrace, read_trace
from rngcoord.client._tracker import RNGStateTracker
from rngcoord.v1 import coordinator_pb2 as pb

P = "p=0.25"  # train_tp.py's default --dropout


def _export(job: str, groups: dict[str, int]) -> list[str]:
    return [
        json.dumps({"kind": "group", "job": job, "group": g, "detail": {"seed": s}})
        for g, s in groups.items()
    ]


def test_policy_shows_in_group_names() -> None:
    assert policy_of("invariant") == "sharding_invariant"
    assert policy_of("invariant[pp:1]") == "sharding_invariant"
    assert policy_of("invariant/seed:9") == "sharding_invariant"
    for name in ("tp:2[0-1]", "tp:4[0-3]", "invariant:4[0-3]", "all@tp:2[0-1]", "dp:2,tp:2[0-3]"):
        assert policy_of(name) == "offsets", name
    assert mesh_of_name("all@tp:4[0-3]/seed:3") == (("tp",), (4,), [0, 1, 2, 3])
    assert mesh_of_name("dp:64[sha:b255db686f49bb79]") is None


def test_replay_refuses_offsets_groups_naming_the_policy() -> None:
    lines = _export("j", {"tp:4[0-3]": 5})
    with pytest.raises(ValueError, match="offsets policy") as e:
        _replay.group_facts(lines, "j", "tp:4[0-3]")
    assert "sharding_invariant" in str(e.value)
    # The default group on an offsets job: the policy is named, not the export's time window.
    with pytest.raises(ValueError, match="no sharding_invariant group") as e:
        _replay.group_facts(lines, "j", "invariant")
    assert "tp:4[0-3]" in str(e.value) and "time window" not in str(e.value)
    with pytest.raises(ValueError, match="no record of job 'other'"):
        _replay.group_facts(lines, "other", "invariant")
    assert _replay.group_facts(_export("j", {"invariant": 7}), "j", "invariant") == (7, [])


def test_trace_records_every_op_and_replay_reads_it(tmp_path: Path) -> None:
    trace = OpTrace(tmp_path / "t-{rank}.jsonl", 3, "sharding_invariant")
    trace.record("invariant", 0, 128, (8, 64), "float32", "aten.native_dropout.default")
    trace.record("invariant", 128, 32, (8, 16), "float32", "aten.native_dropout.default")
    trace.close()
    trace.record("invariant", 160, 4, (1,), "float32", "x")  # after close: dropped
    text = (tmp_path / "t-3.jsonl").read_text()
    records = read_trace(text)
    assert [r["op_index"] for r in records] == [0, 1] and records[1]["rank"] == 3
    op = _replay.traced_op(text, 1)
    assert (op.group, op.cursor, op.op, op.shape, op.dtype) == (
        "invariant",
        128,
        "native_dropout",
        (8, 16),
        "float32",
    )
    with pytest.raises(ValueError, match="no op 2"):
        _replay.traced_op(text, 2)
    offsets = OpTrace(tmp_path / "o.jsonl", 0, "offsets")
    offsets.record("tp:2[0-1]", 0, 512, (8, 64), "float32", "aten.native_dropout.default")
    offsets.close()
    with pytest.raises(ValueError, match="offsets policy"):
        _replay.traced_op((tmp_path / "o.jsonl").read_text(), 0)


def test_trace_is_off_by_default() -> None:
    assert RNGStateTracker(rank=0)._trace is None


def test_resize_message_names_both_groups() -> None:
    text = resize_message("tp:4[0-3]", "tp:2[0-1]")
    assert "cannot rewind onto another mesh" in text
    assert "'tp:4[0-3]'" in text and "'tp:2[0-1]'" in text
    assert 'policy="sharding_invariant"' in text


def _trace_ops(path: Path) -> list[dict[str, Any]]:
    return read_trace(path.read_text())


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_replay_a_later_op_from_the_trace(coordinator: Any, tmp_path: Path) -> None:
    """train_tp --policy sharding_invariant --record-masks writes each rank's trace; replay
    of op 6 (step 2's second hidden dropout, a sharded op at a later cursor) from rank 1's
    trace and the audit export equals the mask the ranks drew, bitwise. An offsets-policy
    job's export is refused, naming the policy."""
    spec = demo.JobSpec("replay-inv", 2, 2, seed=SEED, policy="sharding_invariant")
    run = demo.run_job(spec, coordinator.address, tmp_path / "inv")
    assert run.returncode == 0, run.log_tail()
    trace = run.records / "incarnation-0" / "rank-1" / "trace.jsonl"
    ops = _trace_ops(trace)
    assert [r["op_index"] for r in ops] == list(range(8))  # 2 steps x 4 dropouts
    assert len({r["cursor"] for r in ops}) == 8 and ops[6]["cursor"] > 0
    assert ops[6]["group"] == "invariant" and ops[6]["shape"] == [BATCH, 64]
    # DTensor's dropout draws bernoulli_ with the keep probability: the trace has it.
    assert ops[6]["op"] == "aten.bernoulli_.float" and ops[6]["args"] == {"p": 0.75}
    # Every rank traced the same op sequence.
    rank0 = _trace_ops(run.records / "incarnation-0" / "rank-0" / "trace.jsonl")
    assert [{**r, "rank": 1} for r in rank0] == ops

    export = run_cli("audit", "--db", coordinator.db_url, "--json", "--job", "replay-inv")
    assert export.returncode == 0, export.stderr
    (tmp_path / "audit.jsonl").write_text(export.stdout)
    out = tmp_path / "op6.pt"
    done = run_cli(
        "replay",
        str(tmp_path / "audit.jsonl"),
        "--job",
        "replay-inv",
        "--trace",
        str(trace),
        "--op-index",
        "6",
        "-o",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"at cursor {ops[6]['cursor']} of 'invariant'" in done.stdout
    assert "granted: epoch 1" in done.stdout
    values = torch.load(out)
    dropped = values == 0
    step2 = _full_masks(run.records, range(2, 3))
    expected = step2[(2, "1.hidden_dropout")].to(torch.uint8)
    assert torch.equal(dropped.to(torch.uint8), expected)
    assert 0 < int(expected.sum()) < expected.numel()
    # A later op is not the first op: their masks differ.
    assert not torch.equal(expected, step2[(2, "0.hidden_dropout")].to(torch.uint8))

    offsets = demo.run_job(
        demo.JobSpec("replay-off", 2, 1, seed=SEED), coordinator.address, tmp_path / "off"
    )
    assert offsets.returncode == 0, offsets.log_tail()
    export = run_cli("audit", "--db", coordinator.db_url, "--json", "--job", "replay-off")
    (tmp_path / "off.jsonl").write_text(export.stdout)
    base = ["replay", str(tmp_path / "off.jsonl"), "--job", "replay-off"]
    op = ["--cursor", "0", "--op", "dropout", "--shape", f"{BATCH},64", "--arg", P]
    default = run_cli(*base, *op)
    assert default.returncode == 2 and "offsets policy" in default.stderr
    assert "time window" not in default.stderr
    named = run_cli(*base, "--group", "tp:2[0-1]", *op)
    assert named.returncode == 2, named.stdout
    assert "'tp:2[0-1]' was drawn under the offsets policy" in named.stderr
    off_trace = offsets.records / "incarnation-0" / "rank-0" / "trace.jsonl"
    traced = run_cli(*base, "--trace", str(off_trace), "--op-index", "1", "--arg", P)
    assert traced.returncode == 2 and "offsets policy" in traced.stderr


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_offsets_resume_across_a_resize_says_it_cannot_rewind(
    coordinator: Any, tmp_path: Path
) -> None:
    """A 4-rank offsets checkpoint resumed on 2 ranks: the run says that the stream cannot
    rewind onto the new mesh, names both groups and recommends sharding_invariant, and does
    not claim that the stream rewinds."""
    first = demo.run_job(
        demo.JobSpec("off-resize", 4, 2, seed=SEED, checkpoint_every=1),
        coordinator.address,
        tmp_path,
    )
    assert first.returncode == 0, first.log_tail()
    resized = demo.run_job(
        demo.JobSpec("off-resize", 2, 3, seed=SEED, checkpoint_every=1, resume=True),
        coordinator.address,
        tmp_path,
    )
    assert resized.returncode == 0, resized.log_tail()
    log = resized.log.read_text()
    assert "resuming after step 2" in log
    assert "the random stream rewinds with it" not in log
    assert "cannot rewind onto another mesh" in log
    assert "'tp:4[0-3]'" in log and "'tp:2[0-1]'" in log
    assert 'policy="sharding_invariant"' in log
    # Audited once (by the new group's rank 0), with where the saved stream stood.
    records = list(
        coordinator.stub().ListAudit(
            pb.ListAuditRequest(job="off-resize", kinds=["resize"]), timeout=10
        )
    )
    assert [(r.group, r.actor.split(" member")[0]) for r in records] == [("tp:2[0-1]", "rank 0")]
    detail = json.loads(records[0].detail)
    assert detail["saved_group"] == "tp:4[0-3]" and detail["saved_cursor"] > 0
    (formed,) = [
        json.loads(r.detail)["epoch"]
        for r in coordinator.stub().ListAudit(
            pb.ListAuditRequest(job="off-resize", group="tp:2[0-1]", kinds=["epoch"]), timeout=10
        )
    ]
    assert detail["epoch"] == formed
