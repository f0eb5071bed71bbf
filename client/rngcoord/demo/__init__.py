"""`rngcoord demo`: an elastic tensor-parallel job on CPU, from a crash to a bitwise resume.

The demo starts a coordinator (`rngcoord serve`, on SQLite in a temporary directory) and runs
examples/train_tp.py under torchelastic, three times:

1. A rank crashes mid-run. torchelastic restarts every worker; the new workers join a new
   epoch of the group, which starts at the group's high-water mark, so they draw fresh numbers.
   The members of the old epoch are then fenced: a Reserve in their name is refused.
2. A reference job runs without interruption, with a fixed root seed.
3. The same job, with the same root seed, crashes too, and restarts with ``--resume``: it loads
   the latest checkpoint, restores the tracker's cursor, and must draw exactly the dropout masks
   of the reference job.

At the end it prints the audit table and the result of ``rngcoord verify`` (no offset granted
twice, except through the recorded Restore), then one PASS or FAIL line per check. It exits 0
only if every check held.

It drives the coordinator the way an operator does, through the `rngcoord` command in
subprocesses, and talks to it over the gRPC contract (rngcoord.v1), so it imports nothing from
the server package; the training runs in ``python -m torch.distributed.run`` subprocesses of
this interpreter. It runs from a source checkout, where examples/ lives (or point
RNGCOORD_EXAMPLES at that folder). tests/e2e/test_elastic.py drives the same functions against
a coordinator subprocess.

Run it with ``rngcoord demo`` or ``python -m rngcoord.demo`` (same flags). It is a package of
its own, beside the client library that every training rank imports: it needs the client,
and no rank needs it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc

from rngcoord.v1 import coordinator_pb2, coordinator_pb2_grpc

EXAMPLES_ENV = "RNGCOORD_EXAMPLES"
"""Names the folder holding train_tp.py when the demo does not run from a source checkout."""

CHECKOUT_EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
"""examples/ of the source checkout this module was installed from (pip install -e)."""

SERVER_START_TIMEOUT_S = 60.0
"""How long `rngcoord serve` may take to write its ready file."""

JOB_TIMEOUT_S = 300.0
"""A torchrun launch that runs longer than this is killed and counts as failed."""

TAG = "[train_tp] "
"""examples/train_tp.py starts its progress lines with this; the demo shows only those."""


@dataclass(frozen=True)
class Check:
    """One property the demo asserts.

    Args:
        name: what held (or did not), in a few words.
        ok: whether it held.
        detail: the evidence, or what went wrong.
    """

    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


@dataclass(frozen=True)
class JobSpec:
    """One elastic launch of examples/train_tp.py.

    Args:
        job: the rngcoord job name (RNGCOORD_JOB).
        workers: processes on this host, which form a 1-D tensor-parallel mesh.
        steps: optimizer steps.
        seed: the job's root seed. Default None: the coordinator draws one.
        fail_at_step: rank ``fail_rank`` of the first incarnation crashes at the start of this
            step. Default None: no crash.
        fail_rank: the rank that crashes. Default 1.
        resume: restart from the latest checkpoint, restoring the random stream's cursor.
            Default False: a restart starts over at step 1 on fresh numbers.
        checkpoint_every: checkpoint after every this many steps. Default 2.
        policy: the tracker policy (train_tp.py --policy). Default "offsets".
        step_seconds: each step sleeps this long, standing in for compute (train_tp.py
            --step-seconds). Default 0.0.
    """

    job: str
    workers: int
    steps: int
    seed: int | None = None
    fail_at_step: int | None = None
    fail_rank: int = 1
    resume: bool = False
    checkpoint_every: int = 2
    policy: str = "offsets"
    step_seconds: float = 0.0


@dataclass(frozen=True)
class JobRun:
    """What a launch left behind.

    Args:
        spec: what was launched.
        returncode: torchrun's exit status (0: the job finished, maybe after a restart).
        workdir: holds ``torchrun.log`` (all output), ``checkpoints/`` and ``records/`` (what
            ``--record-masks`` wrote: per incarnation and rank, the membership and each step's
            masks).
        seconds: wall time of the launch.
    """

    spec: JobSpec
    returncode: int
    workdir: Path
    seconds: float

    @property
    def log(self) -> Path:
        return self.workdir / "torchrun.log"

    @property
    def records(self) -> Path:
        return self.workdir / "records"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def torchrun_command(spec: JobSpec, workdir: Path) -> list[str]:
    """The torchrun command line of `spec`, as this interpreter runs it."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        # One node, elastic all the same: c10d rendezvous rounds and restarts. A range such as
        # 1:2 would make every round wait last_call_timeout (30 s) for a second node.
        "--nnodes=1:1",
        f"--nproc-per-node={spec.workers}",
        "--rdzv-backend=c10d",
        # Port 0: the agent hosts the rendezvous store on a free port, as --standalone does.
        "--rdzv-endpoint=127.0.0.1:0",
        f"--rdzv-id={spec.job}",
        "--max-restarts=1",
        str(example_script()),
        # CPU and gloo even on a GPU host: several ranks may share a host with one GPU.
        "--device=cpu",
        f"--steps={spec.steps}",
        f"--checkpoint-dir={workdir / 'checkpoints'}",
        f"--checkpoint-every={spec.checkpoint_every}",
        f"--record-masks={workdir / 'records'}",
        f"--fail-rank={spec.fail_rank}",
        f"--policy={spec.policy}",
    ]
    if spec.fail_at_step is not None:
        cmd.append(f"--fail-at-step={spec.fail_at_step}")
    if spec.resume:
        cmd.append("--resume")
    if spec.step_seconds:
        cmd.append(f"--step-seconds={spec.step_seconds}")
    return cmd


def run_job(
    spec: JobSpec,
    address: str,
    workdir: Path,
    *,
    token: str | None = None,
    echo: Callable[[str], None] | None = None,
) -> JobRun:
    """Launch `spec` under torchelastic against the coordinator at `address`; wait for it.

    Args:
        spec: the launch.
        address: the coordinator's "HOST:PORT".
        workdir: an empty directory for this launch's logs, checkpoints and records.
        token: the bearer token for the job. Default None: none sent.
        echo: called with each progress line of rank 0 (without its tag). Default None.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNGCOORD_")}
    env.update(
        RNGCOORD_ADDR=address,
        RNGCOORD_JOB=spec.job,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # torchelastic's c10d rendezvous shares one TCPStore across restarts by default, and
        # gloo's setup can then read a peer address left there by the previous incarnation
        # (pytorch#135712); a store per rendezvous round avoids it.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    if spec.seed is not None:
        env["RNGCOORD_SEED"] = str(spec.seed)
    if token is not None:
        env["RNGCOORD_TOKEN"] = token
    started = time.monotonic()
    with (workdir / "torchrun.log").open("w") as log:
        proc = subprocess.Popen(
            torchrun_command(spec, workdir),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, echo), daemon=True)
        pump.start()
        try:
            returncode = proc.wait(JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = -int(signal.SIGTERM)
            log.write(f"\n[demo] stopped after {JOB_TIMEOUT_S:.0f}s\n")
        finally:
            # Also when interrupted (Ctrl-C, a test's timeout). The workers run in sessions of
            # their own; torchrun ends them when it gets SIGTERM.
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        pump.join()
    return JobRun(spec, returncode, workdir, time.monotonic() - started)


def _pump(stream: IO[str], log: IO[str], echo: Callable[[str], None] | None) -> None:
    for line in stream:
        log.write(line)
        if echo is not None and line.startswith(TAG):
            echo(line[len(TAG) :].rstrip("\n"))


# --- what a run recorded --------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One rank's membership in one incarnation, as examples/train_tp.py recorded it.

    Args:
        incarnation: torchelastic's restart count of the workers that recorded it (0 first).
        job: the job name.
        group: the group the "tp" mesh forms.
        epoch: the epoch the rank joined.
        rank: the rank in the group.
        member_id: the member id the rank's tracker joined with.
    """

    incarnation: int
    job: str
    group: str
    epoch: int
    rank: int
    member_id: str


def members(records: Path, incarnation: int) -> list[Member]:
    """The members that incarnation `incarnation` of a run recorded, by rank."""
    found = []
    for path in sorted((records / f"incarnation-{incarnation}").glob("rank-*/member.json")):
        data = json.loads(path.read_text())
        found.append(
            Member(
                incarnation,
                data["job"],
                data["group"],
                int(data["epoch"]),
                int(data["rank"]),
                data["member_id"],
            )
        )
    return sorted(found, key=lambda m: m.rank)


StepKey = tuple[int, int]
"""(rank, step)."""


def step_records(records: Path, incarnation: int | None = None) -> dict[StepKey, dict[str, Any]]:
    """Each (rank, step)'s record: from `incarnation`, or by default from the last that ran it.

    A record is {"step", "loss" (float.hex), "masks": {dropout module: hex of one 0/1 byte per
    local element}, "sharded": [the modules whose activation is sharded]}.
    """
    found: dict[StepKey, dict[str, Any]] = {}
    for inc_dir in sorted(records.glob("incarnation-*"), key=_incarnation_number):
        if incarnation is not None and _incarnation_number(inc_dir) != incarnation:
            continue
        for path in inc_dir.glob("rank-*/step-*.json"):
            rank = int(path.parent.name.removeprefix("rank-"))
            data: dict[str, Any] = json.loads(path.read_text())
            found[(rank, int(data["step"]))] = data
    return found


def _incarnation_number(path: Path) -> int:
    return int(path.name.removeprefix("incarnation-"))


# --- checks ---------------------------------------------------------------------------------


def audit(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    job: str,
    kinds: Sequence[str] = (),
    *,
    token: str | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """The job's audit records, oldest first, as (kind, detail)."""
    request = coordinator_pb2.ListAuditRequest(job=job, kinds=list(kinds))
    return [
        (rec.kind, json.loads(rec.detail))
        for rec in stub.ListAudit(request, metadata=_metadata(token), timeout=30)
    ]


def check_group_reformed(
    stub: coordinator_pb2_grpc.CoordinatorStub, job: str, *, token: str | None = None
) -> Check:
    """The restart formed epoch 2, starting at the high-water mark epoch 1 left."""
    name = "the group re-formed in a new epoch"
    high_water = 0
    epochs: list[dict[str, Any]] = []
    for kind, detail in audit(stub, job, ("epoch", "grant"), token=token):
        if kind == "grant":
            high_water = max(high_water, int(detail["end"]))
        else:
            epochs.append({**detail, "high_water": high_water})
    if [int(e["epoch"]) for e in epochs] != [1, 2]:
        return Check(name, False, f"expected epochs [1, 2] in the audit log, found {epochs}")
    first, second = epochs
    if first["members_digest"] == second["members_digest"]:
        return Check(name, False, f"epochs 1 and 2 have the same member set: {epochs}")
    if int(second["start"]) != second["high_water"] or second["high_water"] == 0:
        return Check(
            name,
            False,
            f"epoch 2 starts at {second['start']}, not at the high-water mark "
            f"{second['high_water']} of epoch 1",
        )
    return Check(
        name,
        True,
        f"epoch 1 (start {first['start']}) -> epoch 2 (start {second['start']}, the high-water "
        f"mark: nothing reused), {second['world_size']} ranks with a new member set",
    )


def check_fenced(
    stub: coordinator_pb2_grpc.CoordinatorStub, old: Sequence[Member], *, token: str | None = None
) -> Check:
    """A Reserve in the name of each old member is refused, in its epoch and in the current one.

    The requests carry the identities the first incarnation really used, sent after the new
    epoch formed: exactly what a leftover process of that incarnation would send.
    """
    name = "members of the old epoch are fenced"
    if not old:
        return Check(name, False, "the first incarnation recorded no members")
    current = stub.GetGroup(
        coordinator_pb2.GetGroupRequest(job=old[0].job, group=old[0].group),
        metadata=_metadata(token),
        timeout=10,
    ).epoch
    if any(member.epoch >= current for member in old):
        # Probing a live member would allocate (or diverge) a real lease.
        return Check(name, False, f"the group is still in epoch {current}: no newer epoch formed")
    messages: list[str] = []
    for member in old:
        for epoch in (member.epoch, current):
            request = coordinator_pb2.ReserveRequest(
                job=member.job,
                group=member.group,
                epoch=epoch,
                seq=0,
                size=4,
                fingerprint=b"leftover",
                rank=member.rank,
                member_id=member.member_id,
                # The old process and its secret are gone; fencing refuses before the
                # credential is compared, so any well-formed secret probes it.
                member_secret=secrets.token_bytes(32),
            )
            try:
                lease = stub.Reserve(request, metadata=_metadata(token), timeout=10).lease
            except grpc.RpcError as err:
                code, message = err.code(), err.details() or ""
                if code != grpc.StatusCode.FAILED_PRECONDITION:
                    return Check(name, False, f"{member} in epoch {epoch}: {code.name} {message}")
                messages.append(message)
                continue
            return Check(
                name, False, f"{member} got a lease in epoch {epoch}: [{lease.start}, {lease.end})"
            )
    return Check(
        name,
        True,
        f"{len(old)} members of epoch {old[0].epoch} refused in epoch {old[0].epoch} "
        f'("{messages[0]}") and in epoch {current} ("{messages[1]}")',
    )


def check_fresh_numbers(records: Path) -> Check:
    """After a plain restart, the steps the new incarnation re-ran drew other masks."""
    name = "the restarted job drew fresh numbers"
    before, after = step_records(records, 0), step_records(records, 1)
    both = sorted(before.keys() & after.keys())
    if not both:
        return Check(name, False, "no step ran in both incarnations")
    same = [key for key in both if before[key]["masks"] == after[key]["masks"]]
    if same:
        return Check(name, False, f"(rank, step) {same} drew the masks of the first incarnation")
    return Check(
        name, True, f"the masks of all {len(both)} (rank, step) that both incarnations ran differ"
    )


def check_ranks_agree(records: Path) -> Check:
    """Dropout on a replicated DTensor drops the same elements on every rank; dropout on a
    sharded one drops different elements on each shard; and every mask drops some, not all."""
    name = "ranks agree on replicated dropout and differ on sharded dropout"
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for (rank, step), data in step_records(records).items():
        by_step.setdefault(step, {})[rank] = data
    if not by_step:
        return Check(name, False, "no step was recorded")
    for step, ranks in sorted(by_step.items()):
        first = ranks[min(ranks)]
        for module in first["masks"]:
            masks = [ranks[r]["masks"][module] for r in sorted(ranks)]
            if module in first["sharded"]:
                kind, held = "sharded", len(set(masks)) == len(masks)
            else:
                kind, held = "replicated", len(set(masks)) == 1
            if not held:
                return Check(name, False, f"step {step}: {kind} {module} masks {masks}")
            if any(set(bytes.fromhex(m)) != {0, 1} for m in masks):
                return Check(name, False, f"step {step}: {module} dropped none or all")
    ranks_count = len(by_step[min(by_step)])
    return Check(
        name,
        True,
        f"{len(by_step)} steps on {ranks_count} ranks: masks of replicated activations "
        "identical, masks of sharded ones distinct per shard",
    )


def check_bitwise_resume(reference: Path, resumed: Path, checkpoint_step: int) -> Check:
    """Every (rank, step) of the resumed run has the reference run's masks and loss, bitwise."""
    name = "the resumed run reproduces the uninterrupted run bitwise"
    want, got = step_records(reference), step_records(resumed)
    if not want or want.keys() != got.keys():
        return Check(name, False, f"steps differ: reference {sorted(want)}, resumed {sorted(got)}")
    for key in sorted(want):
        for field in ("masks", "loss"):
            if want[key][field] != got[key][field]:
                return Check(name, False, f"(rank, step) {key}: {field} differ")
    after = sorted({step for _, step in want if step > checkpoint_step})
    ranks = len({rank for rank, _ in want})
    return Check(
        name,
        True,
        f"dropout masks and losses of steps {after[0]}..{after[-1]} (after the step-"
        f"{checkpoint_step} checkpoint) on {ranks} ranks equal the reference's",
    )


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token is not None else ()


# --- the demo -------------------------------------------------------------------------------


def plan(workers: int, steps: int) -> tuple[int, int, int]:
    """(fail_rank, fail_at_step, checkpoint_every): crash mid-run, a checkpoint or more earlier."""
    fail_at_step = steps // 2 + 1
    return min(1, workers - 1), fail_at_step, max(1, fail_at_step - 2)


def last_checkpoint_before(fail_at_step: int, checkpoint_every: int) -> int:
    return (fail_at_step - 1) // checkpoint_every * checkpoint_every


def example_script() -> Path:
    """examples/train_tp.py: from RNGCOORD_EXAMPLES, else from this source checkout.

    Raises:
        FileNotFoundError: neither holds it; the message says what to do.
    """
    named = os.environ.get(EXAMPLES_ENV)
    folder = Path(named) if named else CHECKOUT_EXAMPLES
    script = folder / "train_tp.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"rngcoord demo runs examples/train_tp.py, which is not at {script}: run it from "
            f"a source checkout (`make demo`), or set {EXAMPLES_ENV} to the examples folder"
        )
    return script


def rngcoord(*args: str, output: IO[str] | None = None) -> int:
    """Run the `rngcoord` command (this interpreter's) with `args`; return its exit status.

    Its output goes to `output`, by default this process's stdout.
    """
    sys.stdout.flush()
    cmd = [sys.executable, "-m", "rngcoord.server.cli", *args]
    return subprocess.run(cmd, stdout=output, stderr=subprocess.STDOUT, check=False).returncode


class Coordinator:
    """`rngcoord serve` on 127.0.0.1 and a free port, as a context manager giving its address.

    Args:
        db_url: the store; the demo's is new, so the server creates it (--init).
        workdir: where its ready file, log (coordinator.log), audit key (audit.key, written
            by --init) and anchor file (anchors.jsonl) go.
        tokens: a token file. Default None: no authentication.
    """

    def __init__(self, db_url: str, workdir: Path, *, tokens: Path | None = None) -> None:
        self._cmd = [
            sys.executable,
            "-m",
            "rngcoord.server.cli",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--db",
            db_url,
            "--metrics",
            "off",
            "--ready-file",
            str(workdir / "coordinator.ready"),
            "--init",
            "--audit-key",
            str(workdir / "audit.key"),
            "--anchor-file",
            str(workdir / "anchors.jsonl"),
        ]
        if tokens is not None:
            self._cmd += ["--tokens", str(tokens)]
        self._ready = workdir / "coordinator.ready"
        self._log_path = workdir / "coordinator.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        with self._log_path.open("wb") as log:
            self._proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not self._ready.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(
                    f"rngcoord serve did not start; its log ({self._log_path}):\n"
                    + self._log_path.read_text(errors="replace")[-4000:]
                )
            time.sleep(0.05)
        return self._ready.read_text().strip()

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags; `rngcoord demo` passes its arguments through to them."""
    parser = argparse.ArgumentParser(
        prog="rngcoord demo",
        description="Start a coordinator and a small elastic tensor-parallel training job with "
        "dropout on CPU; crash a rank, resume bitwise, and check what the ranks drew.",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=4,
        metavar="N",
        help="training processes (default 4)",
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=6,
        metavar="N",
        help="training steps, at least 2 (default 6)",
    )
    parser.add_argument(
        "--keep-dir",
        action="store_true",
        help="keep the demo's working directory (database, logs) instead of deleting it",
    )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (0: every check held, 1: one failed, 2: cannot
    run)."""
    args = build_parser().parse_args(argv)
    if args.steps < 2:
        print("rngcoord demo: --steps must be at least 2 (a checkpoint, then a crash)")
        return 2
    try:
        example_script()
    except FileNotFoundError as exc:
        print(f"rngcoord demo: error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="rngcoord-demo-"))
    try:
        checks = _Demo(workdir, args.workers, args.steps).run()
    finally:
        if not args.keep_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    for check in checks:
        print(check.line())
    held = all(check.ok for check in checks)
    where = f"kept in {workdir}" if args.keep_dir else "removed (--keep-dir keeps it)"
    print(
        f"\nRESULT: {'PASS' if held else 'FAIL'}: {sum(c.ok for c in checks)} of {len(checks)} "
        f"checks held in {time.monotonic() - started:.0f} s; work directory {where}"
    )
    return 0 if held else 1


class _Demo:
    """One run of the demo in `workdir`: the coordinator, three jobs, their checks."""

    def __init__(self, workdir: Path, workers: int, steps: int) -> None:
        self.workdir = workdir
        self.workers = workers
        self.steps = steps
        self.db_url = f"sqlite:///{workdir / 'rngcoord.db'}"
        self.token = secrets.token_hex(16)
        self.fail_rank, self.fail_at_step, self.every = plan(workers, steps)
        self.checks: list[Check] = []

    def run(self) -> list[Check]:
        tokens = self.workdir / "tokens"
        # One identity, a member of every job of the demo: audit records name it.
        tokens.write_text(f"trainer member demo-* {self.token}\n")
        log = self.workdir / "coordinator.log"
        with Coordinator(self.db_url, self.workdir, tokens=tokens) as address:
            print(
                f"rngcoord demo: {self.workers} CPU ranks of examples/train_tp.py under "
                f"torchelastic\n"
                f"  coordinator  {address}, store {self.db_url}, bearer tokens on\n"
                f"  logs         {self.workdir}/*/torchrun.log, {log}"
            )
            with grpc.insecure_channel(address) as channel:
                self._jobs(address, coordinator_pb2_grpc.CoordinatorStub(channel))

        print(f"\n== 4. the audit log ($ rngcoord audit --db {self.db_url})")
        rngcoord("audit", "--db", self.db_url)
        print(f"\n== 5. $ rngcoord verify --db {self.db_url}")
        status = rngcoord(
            "verify",
            "--db",
            self.db_url,
            "--audit-key",
            str(self.workdir / "audit.key"),
            "--anchor",
            str(self.workdir / "anchors.jsonl"),
        )
        self.checks.append(
            Check("rngcoord verify", status == 0, f"exit status {status}, output above")
        )
        return self.checks

    def _jobs(self, address: str, stub: coordinator_pb2_grpc.CoordinatorStub) -> None:
        crash = JobSpec(
            "demo-elastic",
            self.workers,
            self.steps,
            fail_at_step=self.fail_at_step,
            fail_rank=self.fail_rank,
            checkpoint_every=self.every,
        )
        run = self._launch(
            f"1. rank {self.fail_rank} crashes at step {self.fail_at_step}; torchelastic "
            "restarts the workers; the group re-forms",
            crash,
            address,
        )
        if run is not None:
            self._report(check_group_reformed(stub, crash.job, token=self.token))
            self._report(check_fresh_numbers(run.records))
            self._report(check_fenced(stub, members(run.records, 0), token=self.token))

        seed = secrets.randbits(64)
        reference = JobSpec(
            "demo-reference", self.workers, self.steps, seed=seed, checkpoint_every=self.every
        )
        ref_run = self._launch(
            f"2. a reference job, root seed {seed}, uninterrupted", reference, address
        )
        if ref_run is not None:
            self._report(check_ranks_agree(ref_run.records))

        checkpoint_step = last_checkpoint_before(self.fail_at_step, self.every)
        resumed = JobSpec(
            "demo-resume",
            self.workers,
            self.steps,
            seed=seed,
            fail_at_step=self.fail_at_step,
            fail_rank=self.fail_rank,
            resume=True,
            checkpoint_every=self.every,
        )
        res_run = self._launch(
            f"3. the same root seed; rank {self.fail_rank} crashes at step "
            f"{self.fail_at_step}; the restart resumes from the step-{checkpoint_step} "
            "checkpoint (--resume)",
            resumed,
            address,
        )
        if ref_run is not None and res_run is not None:
            self._report(check_bitwise_resume(ref_run.records, res_run.records, checkpoint_step))

    def _launch(self, title: str, spec: JobSpec, address: str) -> JobRun | None:
        print(f"\n== {title}\n   $ torchrun ... {' '.join(_example_args(spec))}")
        run = run_job(spec, address, self.workdir / spec.job, token=self.token, echo=self._echo)
        ok = run.returncode == 0
        detail = f"exit status {run.returncode} after {run.seconds:.0f} s"
        self.checks.append(Check(f"job {spec.job} finished", ok, detail))
        if not ok:
            print(f"   torchrun failed ({detail}); the end of {run.log}:\n{run.log_tail()}")
            return None
        return run

    def _echo(self, line: str) -> None:
        # Paths under the work directory, which the header names, print relative to it.
        print(f"   | {line.replace(f'{self.workdir}/', '')}", flush=True)

    def _report(self, check: Check) -> None:
        self.checks.append(check)
        print(f"   {check.line()}")


def _example_args(spec: JobSpec) -> list[str]:
    args = [f"--steps {spec.steps}"]
    if spec.fail_at_step is not None:
        args.append(f"--fail-at-step {spec.fail_at_step} --fail-rank {spec.fail_rank}")
    if spec.resume:
        args.append("--resume")
    return ["examples/train_tp.py", *args]
