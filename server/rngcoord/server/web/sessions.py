"""The status page's sign-in sessions: the cookies' names, how long a session lasts and how many
one process keeps, and the digest under which a session id is kept (never the id itself).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from rngcoord.server.auth import Identity

__all__ = [
    "COOKIE",
    "LOGIN_COOKIE",
    "LOGIN_COOKIE_S",
    "MAX_SESSIONS",
    "SESSION_ENV",
    "SESSION_S",
    "Session",
    "session_digest",
    "session_s_from_env",
]


COOKIE = "rngcoord_session"
"""The session cookie's name over plain HTTP; under TLS it is `__Host-` + this."""


SESSION_S = 12 * 3600.0
"""How long a session lasts from sign-in, by default."""


SESSION_ENV = "RNGCOORD_STATUS_SESSION_S"
"""The environment variable that sets the session lifetime in seconds."""


MAX_SESSIONS = 1024
"""Most sessions one process keeps; signing in past it ends the oldest."""


LOGIN_COOKIE = "rngcoord_login"


LOGIN_COOKIE_S = 3600


@dataclass(frozen=True, slots=True)
class Session:
    """A signed-in session: who, until when, and its form token."""

    who: Identity
    expires: float
    """time.monotonic() at which it ends."""
    csrf: str
    """The form token sign-out must carry."""


def session_s_from_env() -> float:
    """The session lifetime SESSION_ENV sets, else SESSION_S."""
    text = os.environ.get(SESSION_ENV, "")
    if not text:
        return SESSION_S
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{SESSION_ENV} must be a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{SESSION_ENV} must be more than 0 seconds")
    return seconds


def session_digest(text: str) -> bytes:
    """What a session id is kept under: a leaked table of sessions signs no one in."""
    return hashlib.sha256(text.encode("utf-8")).digest()
