"""Make the screenshots in docs/: the live status page and a job's report, in headless Chromium.

Usage: python scripts/screenshots.py [OUT_DIR]   (default: docs/ of this checkout)

It starts `rngcoord serve --init` on a fresh SQLite store in a temporary directory (token
file on: an auditor signs in through the page's login form), and plays a small job over gRPC
as its ranks would: group "tp" of 4 ranks granting leases for a few seconds; group "dp" of 2
ranks whose ranks then disagree (the divergence banner); group "elastic" of 2 ranks whose
epoch 1 grants, then whose re-formed epoch 2 restores seq 0 by both members' votes and grants
on; and job "bert-finetune", whose 2 ranks grant and then leave (a finished job). It saves
OUT_DIR/status-page.png while the page is signed in, stops the server, writes
`rngcoord report` for the job and saves OUT_DIR/report.png.

Needs the server and dev extras (selenium, matplotlib) and Chromium with chromedriver at
/usr/bin/chromium and /usr/bin/chromedriver (Debian: apt-get install chromium chromium-driver).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
JOB = "llama-tp"
WIDTH = 1280


def _member_secret(member_id: str) -> bytes:
    """A member's credential (JoinGroupRequest.member_secret); a fixed function of the member
    id is enough for this tool, whose members are its own."""
    return hashlib.sha256(b"rngcoord-tool:" + member_id.encode()).digest()


class Ranks:
    """The ranks of one group, talking to the coordinator as clients do."""

    def __init__(
        self, stub: coordinator_pb2_grpc.CoordinatorStub, token: str, group: str, job: str = JOB
    ) -> None:
        self.stub = stub
        self.job = job
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.group = group
        self.epoch = 0
        self.members: list[str] = []
        self.seq = 0

    def join(self, world_size: int) -> None:
        """Every rank joins at once, as new process incarnations; a new epoch forms."""
        suffix = uuid.uuid4().hex[:6]

        def join(rank: int) -> pb.JoinGroupResponse:
            response: pb.JoinGroupResponse = self.stub.JoinGroup(
                pb.JoinGroupRequest(
                    job=self.job,
                    group=self.group,
                    rank=rank,
                    world_size=world_size,
                    member_id=f"r{rank}-{suffix}",
                    member_secret=_member_secret(f"r{rank}-{suffix}"),
                    timeout_ms=30_000,
                    include_members=True,
                ),
                timeout=40,
                metadata=self.metadata,
            )
            return response

        with ThreadPoolExecutor(world_size) as pool:
            replies = list(pool.map(join, range(world_size)))
        self.epoch = replies[0].epoch
        self.members = list(replies[0].members)
        self.seq = 0

    def reserve(self, rank: int, size: int = 4096) -> None:
        self.stub.Reserve(
            pb.ReserveRequest(
                job=self.job,
                group=self.group,
                epoch=self.epoch,
                seq=self.seq,
                size=size,
                fingerprint=b"ops",
                rank=rank,
                member_id=self.members[rank],
                member_secret=_member_secret(self.members[rank]),
            ),
            timeout=10,
            metadata=self.metadata,
        )

    def grant(self, leases: int, pause_s: float = 0.0) -> None:
        """`leases` leases, each asked for by every rank (the first grants, the rest hit)."""
        for _ in range(leases):
            for rank in range(len(self.members)):
                self.reserve(rank)
            self.seq += 1
            time.sleep(pause_s)

    def leave(self) -> None:
        """Every rank leaves, as at the end of a run."""
        for rank, member_id in enumerate(self.members):
            self.stub.LeaveGroup(
                pb.LeaveGroupRequest(
                    job=self.job, group=self.group, epoch=self.epoch, rank=rank,
                    member_id=member_id, member_secret=_member_secret(member_id),
                ),
                timeout=10,
                metadata=self.metadata,
            )  # fmt: skip

    def restore(self, cursor: int) -> None:
        """Every member votes to restore the next seq to `cursor`."""

        def vote(rank: int) -> None:
            self.stub.Restore(
                pb.RestoreRequest(
                    job=self.job,
                    group=self.group,
                    epoch=self.epoch,
                    seq=self.seq,
                    cursor=cursor,
                    rank=rank,
                    member_id=self.members[rank],
                    member_secret=_member_secret(self.members[rank]),
                    timeout_ms=10_000,
                ),
                timeout=20,
                metadata=self.metadata,
            )

        with ThreadPoolExecutor(len(self.members)) as pool:
            list(pool.map(vote, range(len(self.members))))


def play(address: str, token: str) -> threading.Thread:
    """Play the job; return the thread that keeps group "tp" granting for a while."""
    channel = grpc.insecure_channel(address)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    finished = Ranks(stub, token, "dp", job="bert-finetune")
    finished.join(2)
    finished.grant(6, pause_s=0.02)
    finished.leave()
    elastic = Ranks(stub, token, "elastic")
    elastic.join(2)
    elastic.grant(12, pause_s=0.05)
    dp = Ranks(stub, token, "dp")
    dp.join(2)
    dp.grant(5, pause_s=0.05)
    dp.reserve(0)
    try:
        dp.reserve(1, size=8192)  # rank 1 ran one more random op than rank 0
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
    elastic.join(2)  # a rank crashed; the job re-formed in a new epoch
    elastic.restore(8 * 4096)  # ... and resumed from the checkpoint of step 8
    elastic.grant(10, pause_s=0.05)
    tp = Ranks(stub, token, "tp")
    tp.join(4)
    keep_going = threading.Thread(target=tp.grant, args=(120, 0.04), daemon=True)
    keep_going.start()
    return keep_going


def chromium(height: int) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={WIDTH},{height}")
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def screenshot_page(http: str, token: str, out: Path) -> None:
    from selenium.webdriver.common.by import By

    driver = chromium(2350)  # tall enough for the audit tail
    try:
        driver.get(f"http://{http}/")
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "sign-in").click()
        deadline = time.monotonic() + 30
        while not driver.execute_script("return document.querySelectorAll('.group').length === 4"):
            if time.monotonic() > deadline:
                raise RuntimeError("the page never showed the 4 groups")
            time.sleep(0.2)
        time.sleep(2.5)  # a few live refreshes: the lease count of "tp" moves
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def screenshot_report(report: Path, out: Path) -> None:
    driver = chromium(1900)
    try:
        driver.get(report.as_uri())
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs"
    out_dir.mkdir(parents=True, exist_ok=True)
    rngcoord = [sys.executable, "-m", "rngcoord.server.cli"]
    with tempfile.TemporaryDirectory(prefix="rngcoord-screenshots-") as tmp:
        work = Path(tmp)
        db = f"sqlite:///{work / 'rngcoord.db'}"
        member, auditor = secrets.token_hex(16), secrets.token_hex(16)
        tokens = work / "tokens"
        tokens.write_text(f"trainer member * {member}\nalice auditor * {auditor}\n")
        ready = work / "ready"
        log = (work / "server.log").open("wb")
        server = subprocess.Popen(
            [*rngcoord, "serve", "--init", "--db", db, "--listen", "127.0.0.1:0",
             "--metrics", "127.0.0.1:0", "--workers", "1", "--peer-rate", "0",
             "--tokens", str(tokens), "--audit-key", str(work / "audit.key"),
             "--ready-file", str(ready)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((work / "server.log").read_text())
                time.sleep(0.05)
            address = ready.read_text()
            http = next(
                json.loads(line)["fields"]["metrics"]
                for line in (work / "server.log").read_text().splitlines()
                if '"event":"serving"' in line
            )
            granting = play(address, member)
            screenshot_page(http, auditor, out_dir / "status-page.png")
            granting.join()
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(30)
            log.close()
        report = work / "report.html"
        subprocess.run(
            [*rngcoord, "report", "--db", db, "--job", JOB, "-o", str(report)], check=True
        )
        screenshot_report(report, out_dir / "report.png")
    print(f"wrote {out_dir / 'status-page.png'} and {out_dir / 'report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
