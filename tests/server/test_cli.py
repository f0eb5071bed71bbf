"""The `rngcoord` command line: audit output, verify exit codes, serve's refusals, help.

The stores are filled through the real Coordinator in this process; the CLI runs as a
subprocess (`python -m rngcoord.server.cli`), as a user would run it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import (
    CountingStore,
    InProcess,
    LoopThread,
    ManualClock,
    caller,
    form,
    run_cli,
    secret_for,
    token_leaks,
)
from rngcoord.server.audit.verify import UNANCHORED_NOTE
from rngcoord.server.core.membership import Caller
from rngcoord.server.storage.sqlite import SqliteStore

JOB = "cli-job"
ACTOR = "trainer-identity: rank 0 member m0 @ ipv4:127.0.0.1:40000"


def _grant(h: InProcess, group: str, seqs: range) -> None:
    for seq in seqs:
        h.run(
            h.coord.reserve(
                Caller(JOB, group, 1, 0, "m0", secret_for("m0"), ACTOR),
                seq=seq,
                size=1024,
                fingerprint=b"fp",
            )
        )


@contextlib.contextmanager
def _coordinator(path: Path, *, create: bool = False) -> Iterator[InProcess]:
    loop = LoopThread()
    store = CountingStore(SqliteStore(path, create=create))
    h = InProcess(loop, store, ManualClock())
    try:
        yield h
    finally:
        h.close()
        store.close()
        loop.close()


@pytest.fixture
def filled(tmp_path: Path) -> Iterator[str]:
    """A SQLite store with 2 groups: 1 job + 2 group + 2 epoch + 5 grant + 1 restore records."""
    url = f"sqlite:///{tmp_path / 'filled.db'}"
    with _coordinator(tmp_path / "filled.db", create=True) as h:
        for group, leases in (("tp", 3), ("dp", 2)):
            form(h, group, ("m0",), job=JOB, job_seed=7)
            _grant(h, group, range(leases))
        h.run(h.coord.restore(caller("m0", group="tp", job=JOB), seq=3, cursor=0))
    yield url


def test_audit_prints_a_table(filled: str) -> None:
    result = run_cli("audit", "--db", filled)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == [
        "ID",
        "TIME",
        "(UTC)",
        "JOB",
        "GROUP",
        "KIND",
        "DETAIL,",
        "by",
        "ACTOR",
    ]
    # Not a terminal, no --width: one line per record, the actor last and whole.
    assert len(rows) == 11
    kinds = [row.split()[5] for row in rows[1:]]
    assert kinds.count("grant") == 5 and kinds.count("restore") == 1
    grant = next(row for row in rows if " grant " in row)
    assert "start=0" in grant and "end=1024" in grant and "size=1024" in grant
    assert grant.endswith(f"  by {ACTOR}")


@pytest.mark.parametrize("width", [60, 100])
def test_audit_table_fits_the_width_and_never_cuts_an_identity(filled: str, width: int) -> None:
    result = run_cli("audit", "--db", filled, "--width", str(width))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # Only a word longer than the DETAIL column may pass the width, whole.
    assert all(len(line) <= width or " " not in line.strip() for line in lines)
    assert "…" not in result.stdout
    records = []
    for line in lines[1:]:
        if line[:4].strip():
            records.append(line)
        else:
            records[-1] += " " + line.strip()
    assert len(records) == 11
    grants = [" ".join(r.split()) for r in records if " grant " in r]
    assert len(grants) == 5 and all(g.endswith(f"by {ACTOR}") for g in grants)


@pytest.mark.slow
def test_audit_follow_prints_new_records_until_ctrl_c(filled: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rngcoord.server.cli", "audit", "--db", filled, "--json",
         "--follow", "--poll", "0.05", "--group", "dp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        stdout = proc.stdout
        assert stdout is not None
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            for line in stdout:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()

        def read(n: int) -> list[dict[str, object]]:
            return [json.loads(lines.get(timeout=30)) for _ in range(n)]

        assert [r["kind"] for r in read(3)] == ["group", "epoch", "grant"]
        assert [r["kind"] for r in read(1)] == ["grant"]
        with _coordinator(tmp_path / "filled.db") as h:
            _grant(h, "tp", range(3, 5))  # filtered out
            _grant(h, "dp", range(2, 4))
        new = read(2)
        assert [(r["group"], r["detail"]["seq"]) for r in new] == [("dp", 2), ("dp", 3)]  # type: ignore[index]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
        assert lines.empty()
    finally:
        proc.kill()
        proc.wait()


def test_audit_follow_refuses_until_and_limit(filled: str) -> None:
    result = run_cli("audit", "--db", filled, "--follow", "--limit", "3")
    assert result.returncode == 2 and "takes no --until or --limit" in result.stderr


@pytest.mark.slow
def test_audit_json_lines_and_filters(filled: str) -> None:
    result = run_cli("audit", "--db", filled, "--json")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["id"] for r in records] == list(range(1, 12))
    for previous, record in itertools.pairwise(records):
        assert record["prev_hash"] == previous["hash"]
    assert records[0]["prev_hash"] == "0" * 64
    assert set(records[0]) == {
        "id", "ts_us", "time", "job", "group", "kind", "actor", "detail", "prev_hash", "hash",
    }  # fmt: skip
    assert records[0]["detail"] == {"seed": 7}

    grants = run_cli("audit", "--db", filled, "--json", "--kind", "grant", "--group", "tp")
    lines = [json.loads(line) for line in grants.stdout.splitlines()]
    assert [(r["kind"], r["group"], r["detail"]["seq"]) for r in lines] == [
        ("grant", "tp", 0),
        ("grant", "tp", 1),
        ("grant", "tp", 2),
    ]
    limited = run_cli("audit", "--db", filled, "--json", "--kind", "grant", "--kind", "restore")
    assert len(limited.stdout.splitlines()) == 6
    two = run_cli("audit", "--db", filled, "--json", "--limit", "2")
    assert [json.loads(line)["id"] for line in two.stdout.splitlines()] == [1, 2]
    future = run_cli("audit", "--db", filled, "--since", "2999-01-01T00:00:00")
    assert future.returncode == 0 and future.stdout.strip() == "no audit records match"
    past = run_cli("audit", "--db", filled, "--json", "--until", "1000000000")
    assert past.returncode == 0 and past.stdout == ""


def test_verify_exits_0_when_intact_1_when_tampered_2_when_missing(
    filled: str, tmp_path: Path
) -> None:
    ok = run_cli("verify", "--db", filled)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines() == [
        f"note: {UNANCHORED_NOTE}",
        "ok: 11 records, 5 grants in 2 groups, chain intact, no overlaps; "
        "its tail unchecked (no --anchor)",
    ]

    # Rewriting history, even to something plausible, breaks the record's hash.
    with sqlite3.connect(filled.removeprefix("sqlite:///")) as db:
        db.execute("UPDATE audit SET actor = 'someone else' WHERE id = 6")
    tampered = run_cli("verify", "--db", filled)
    assert tampered.returncode == 1, tampered.stdout + tampered.stderr
    assert "record 6" in tampered.stdout
    assert tampered.stdout.splitlines()[-1].startswith("FAILED:")

    missing = run_cli("verify", "--db", f"sqlite:///{tmp_path / 'absent.db'}")
    assert missing.returncode == 2
    assert f"no rngcoord store at {tmp_path / 'absent.db'}" in missing.stderr
    assert not (tmp_path / "absent.db").exists()


def test_serve_refuses_a_bad_token_file_a_busy_port_and_half_a_tls_setup(
    tmp_path: Path,
) -> None:
    db = ["--db", f"sqlite:///{tmp_path / 's.db'}", "--metrics", "off", "--init"]
    tokens = tmp_path / "tokens"
    tokens.write_text("job-a secret\njob-b s3cr3t-b extra\n")
    bad_tokens = run_cli("serve", "--listen", "127.0.0.1:0", *db, "--tokens", str(tokens))
    assert bad_tokens.returncode == 2
    assert (
        f"{tokens}:2: expected 'NAME ROLE JOBS TOKEN' (or the older 'JOB TOKEN'), got 3 fields"
        in bad_tokens.stderr
    )
    assert "s3cr3t" not in bad_tokens.stderr

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = run_cli("serve", "--listen", f"127.0.0.1:{port}", *db)
    assert taken.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in taken.stderr

    half = run_cli("serve", *db, "--tls-cert", str(tokens))
    assert half.returncode == 2
    assert "TLS needs both --tls-cert and --tls-key" in half.stderr


@pytest.mark.parametrize(
    "line",
    [
        "ops tk-0123456789abcdef member job-a",  # the token where the role goes
        "ops member tk-0123456789abcdef/x job-a",  # where the job patterns go
        "tk-0123456789abcdef! member job-a secret-2",  # where the name goes
        "tk-0123456789abcdef!! secret-2",  # where an older line's job goes
    ],
)
def test_a_token_file_error_never_shows_any_field_of_the_line(tmp_path: Path, line: str) -> None:
    # A line in the wrong order may hold its token in any field: none is ever echoed.
    tokens = tmp_path / "tokens"
    tokens.write_text(line + "\n")
    db = ["--db", f"sqlite:///{tmp_path / 's.db'}", "--metrics", "off", "--init"]
    refused = run_cli("serve", "--listen", "127.0.0.1:0", *db, "--tokens", str(tokens))
    assert refused.returncode == 2
    assert f"{tokens}:1: field" in refused.stderr
    assert "tk-0123" not in refused.stderr + refused.stdout


def test_the_suite_wide_token_scan_finds_a_token_in_any_file(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tokens").write_text(
        "ops admin * a-long-test-token\nbroken line tok3n-xyz-9\n"
    )
    (tmp_path / "b.log").write_text('{"event":"x","fields":{"t":"a-long-test-token"}}\n')
    (tmp_path / "c.log").write_text("nothing here\n")
    assert token_leaks(tmp_path) == [f"{tmp_path / 'b.log'}: a-lo..."]
    (tmp_path / "c.log").write_text("... tok3n-xyz-9 ...\n")
    assert len(token_leaks(tmp_path)) == 2
    # These leaks are on purpose: the session's own scan (conftest.py) must not see them.
    (tmp_path / "a" / "tokens").unlink()


# `demo --help` imports the client package, and with it torch (several seconds): slow tier.
@pytest.mark.parametrize(
    "command",
    [
        [],
        ["serve"],
        ["audit"],
        ["report"],
        ["verify"],
        pytest.param(["demo"], marks=pytest.mark.slow),
    ],
)
def test_help_reads_well(command: list[str]) -> None:
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: rngcoord")
    if command == ["serve"]:
        for env in ("RNGCOORD_LISTEN", "RNGCOORD_DB", "RNGCOORD_METRICS", "RNGCOORD_TOKENS"):
            assert env in result.stdout
    if command == ["demo"]:
        assert "--workers" in result.stdout and "--keep-dir" in result.stdout
