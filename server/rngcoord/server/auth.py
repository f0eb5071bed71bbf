"""Who may call what: the token file, the identities it names, and their permissions.

Token file format (RNGCOORD_TOKENS / `rngcoord serve --tokens`), one token per line, fields
separated by whitespace; blank lines and lines starting with `#` are ignored:

    # NAME     ROLE     JOBS              TOKEN
    trainer    member   llama-*,bert      3f9c...
    alice      auditor  *                 81ab...
    ops        admin    *                 c70e...

- NAME names the identity in audit records and logs (never the token).
- ROLE is one of:
  - `member`: JoinGroup, JoinGroups, Reserve, Attest, LeaveGroup, Restore (not forced),
    RecordResize, RecordQuorum, GetGroup and ListAudit (and each of these as a Session message);
  - `auditor`: GetGroup and ListAudit only;
  - `admin`: everything, including a forced Restore.
- JOBS is a comma-separated list of job patterns (`fnmatch`: `*`, `?`, `[...]`); a request is
  allowed only for a job one of them matches. A ListAudit without a job filter reads every
  job, so it needs the pattern `*`.

The older two-field form `JOB TOKEN` still loads: `JOB` becomes a member of that job (named
after it), and `* TOKEN` an admin of every job named "admin".

Errors name the file and line, never a token. Tokens are looked up by their SHA-256, so a
lookup takes the same time whatever prefix a guess shares with a real token.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rngcoord.v1.rules import RuleViolation, check_name

__all__ = ["ROLES", "Identity", "TokenTable", "load_tokens"]

ROLES = ("member", "auditor", "admin")

WRITES = frozenset(
    {
        "JoinGroup",
        "JoinGroups",
        "Reserve",
        "Attest",
        "LeaveGroup",
        "Restore",
        "RecordResize",
        "RecordQuorum",
    }
)
"""The methods that change state: members and admins only."""

_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-*?\[\]!]{1,128}$")


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a token belongs to.

    Args:
        name: the identity's name, for audit records and logs.
        role: "member", "auditor" or "admin".
        jobs: the job patterns it may act on.
    """

    name: str
    role: str
    jobs: tuple[str, ...]

    def allows_job(self, job: str) -> bool:
        """Whether a request about `job` ("" meaning every job) is within this identity's jobs."""
        if not job:
            return "*" in self.jobs
        return any(fnmatch.fnmatchcase(job, pattern) for pattern in self.jobs)

    def refusal(self, method: str, job: str, *, force: bool = False) -> str | None:
        """Why this identity may not call `method` on `job`, or None when it may."""
        if self.role == "auditor" and method in WRITES:
            return f"{method} needs the member or admin role; {self.name!r} is an auditor"
        if force and self.role != "admin":
            return f"a forced Restore needs the admin role; {self.name!r} is a {self.role}"
        if not self.allows_job(job):
            what = f"job {job[:128]!r}" if job else "every job (a ListAudit without --job)"
            return f"{self.name!r} may act on jobs {','.join(self.jobs)}, not on {what}"
        return None


class TokenTable:
    """The identities of a token file, looked up by token.

    Args:
        entries: (token, identity) pairs; a token may appear once.
    """

    def __init__(self, entries: Iterable[tuple[bytes, Identity]]) -> None:
        self._by_digest = {hashlib.sha256(token).digest(): who for token, who in entries}

    def __len__(self) -> int:
        return len(self._by_digest)

    def identify(self, token: bytes) -> Identity | None:
        """The identity holding `token`, or None."""
        return self._by_digest.get(hashlib.sha256(token).digest())


def load_tokens(path: str | Path) -> TokenTable:
    """Parse a token file (format in the module docstring).

    Raises:
        OSError: the file cannot be read.
        ValueError: naming the file, line and field of the first malformed entry, never any
            field's text (a line in the wrong order may hold its token anywhere), or when
            the file lists no token (every request would be refused).
    """
    entries: list[tuple[bytes, Identity]] = []
    seen: dict[bytes, int] = {}
    text = Path(path).read_text(encoding="utf-8")
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        parts = line.split()
        if len(parts) == 2:
            job, token = parts
            if job == "*":
                who = Identity("admin", "admin", ("*",))
            else:
                _check_job(job, where)
                who = Identity(job, "member", (job,))
        elif len(parts) == 4:
            name, role, jobs, token = parts
            if role not in ROLES:
                raise ValueError(f"{where}: field 2 (ROLE) is not one of {', '.join(ROLES)}")
            try:
                check_name("identity name", name)
            except RuleViolation:
                raise ValueError(
                    f"{where}: field 1 (NAME) must be 1-128 of [A-Za-z0-9_.:-]"
                ) from None
            patterns = tuple(p for p in jobs.split(",") if p)
            for pattern in patterns:
                if not _PATTERN.fullmatch(pattern):
                    raise ValueError(
                        f"{where}: field 3 (JOBS) holds a pattern that is not 1-128 of "
                        "[A-Za-z0-9_.:-] and the wildcards * ? [ ] !"
                    )
            if not patterns:
                raise ValueError(f"{where}: no job patterns")
            who = Identity(name, role, patterns)
        else:
            # The line holds a token: say how many fields, never what they are.
            raise ValueError(
                f"{where}: expected 'NAME ROLE JOBS TOKEN' (or the older 'JOB TOKEN'), "
                f"got {len(parts)} fields"
            )
        secret = token.encode("utf-8")
        if secret in seen:
            raise ValueError(f"{where}: the same token as line {seen[secret]}")
        seen[secret] = lineno
        entries.append((secret, who))
    if not entries:
        raise ValueError(f"token file {path} lists no tokens; every request would be refused")
    return TokenTable(entries)


def _check_job(job: str, where: str) -> None:
    try:
        check_name("job", job)
    except RuleViolation:
        raise ValueError(
            f"{where}: field 1 (JOB) must be a job name (1-128 of [A-Za-z0-9_.:-]) or '*'"
        ) from None
