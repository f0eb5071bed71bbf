"""The coordinator's HTTP side: a live status page, its JSON API, and Prometheus /metrics.

`StatusServer` runs an aiohttp application on the event loop of the server it belongs to
(`rngcoord serve` opens it on the `--metrics` address; with `--tls-cert` and `--tls-key` it is
served over TLS with the same certificate as the gRPC side). Routes:

- `GET /`: the status page (Jinja2, server-side rendered): the jobs, grouped by state (active,
  idle, finished; see `rngcoord.server.web.views.group_state`), newest activity first, with a
  filter box; for each group its current epoch, members by rank (member id, peer, join time,
  whether it left), leases granted, the high-water mark as a share of the usable offset space,
  restores, and a banner naming the ranks of a divergence; then the audit tail (newest first),
  the store id and the anchored head of the audit chain. The page refreshes its parts without
  reloading: each second its script (/static/status.js) fetches `/partials/groups` (the same
  template's fragment) and `/api/audit?after=ID`.
- `GET /partials/groups`: the groups fragment of the page.
- `GET /api/status`: the store id, the audit head and every group, as JSON.
- `GET /api/audit?after=ID&limit=N`: the newest N (default 50, at most 500) audit records
  after record ID, oldest first, as JSON.
- `GET /metrics`: Prometheus text format from the server's registry; never needs a token
  (a scraper holds none, as before this page existed).
- `GET /login`, `POST /login`, `POST /logout`: the sign-in form and its session.
- `GET /static/status.js`, `/static/status.css`: the page's script and style sheet (files, so
  that the Content-Security-Policy can forbid every inline script and style).

Access: the page, its fragment and /api need a token of the auditor or admin role (from the
server's token file), sent as `Authorization: Bearer TOKEN` or through the sign-in form. No
token: 401 with the form. A member token: 403. An auditor whose job patterns are not `*` sees
only the groups of its jobs, and audit records of its jobs among the newest `limit * 10`. The
page is open to anyone when the server runs without a token file (as its gRPC side then is;
logged as a warning) or with `open_access` (`--status-open`).

Sessions: signing in creates a server-side session, and the cookie holds only its id (256
random bits); the session table is keyed by the id's SHA-256 and maps it to the identity, and
never holds a token. A session ends at a fixed time after sign-in (12 h by default,
`RNGCOORD_STATUS_SESSION_S`; absolute, not sliding: the page polls each second, so a sliding
expiry would never end an open tab), on sign-out, and on every reload of the token file
(SIGHUP): the server keeps no token, so it cannot tell which sessions a new file still
covers, and ends them all. The cookie is HttpOnly, SameSite=Strict, and under TLS Secure with
the `__Host-` prefix. The process keeps at most `MAX_SESSIONS`, dropping the oldest.

CSRF: POST /login and /logout must come from this origin (the Origin header, or the Referer
when there is no Origin, must be this server's scheme://host:port: a form post without
either is refused) and carry a form token: for sign-in, an HMAC under a per-process key of a
random pre-session cookie set with the form; for sign-out, the session's own random token.
Both are compared in constant time.

Every response carries a Content-Security-Policy (scripts, styles and fetches from this
origin only; no frames, no inline code), X-Frame-Options: DENY, X-Content-Type-Options:
nosniff and Referrer-Policy: same-origin (no-referrer would make browsers send `Origin: null`
on the page's own form posts), and every response but the static files Cache-Control:
no-store.

With `--workers N` the supervisor serves this HTTP side (the workers have none): a
`StatusThread` runs it on an event loop of its own, reading the store through a `StoreSource`
and /metrics from the workers' multiprocess registry.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import jinja2
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rngcoord.server.addresses import join_host_port
from rngcoord.server.audit.chain import Chain, fetch_page
from rngcoord.server.auth import Identity, TokenTable
from rngcoord.server.logs import event, get_logger
from rngcoord.server.storage.queries import audit_head
from rngcoord.server.storage.store import Store, Tx
from rngcoord.server.web.present import IDLE_AFTER_S, ago, by_state, percent, record_json, utc
from rngcoord.server.web.sessions import (
    COOKIE,
    LOGIN_COOKIE,
    LOGIN_COOKIE_S,
    MAX_SESSIONS,
    Session,
    session_digest,
    session_s_from_env,
)
from rngcoord.server.web.views import GroupView, group_state, group_views
from rngcoord.v1.types import AuditRecord

__all__ = [
    "Source",
    "StatusServer",
    "StatusThread",
    "StoreSource",
    "TLSFiles",
]

T = TypeVar("T")
_log = get_logger("status")


VIEW_ROLES = frozenset({"auditor", "admin"})
"""The roles that may see the page and /api."""

_TEMPLATES = Path(__file__).resolve().parent / "templates"
_STATIC = {
    "status.js": "text/javascript",
    "status.css": "text/css",
}
_AUDIT_TAIL = 50
_MAX_AUDIT_TAIL = 500
_MEMBER_LIMIT = 64
_REFRESH_MS = 1000
_IDENTITY = "rngcoord.identity"
_SESSION = "rngcoord.session"
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_SECURITY_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


class Source(Protocol):
    """What the status page reads: the store, and the audit head as an anchor. A
    `Coordinator` is one."""

    @property
    def store(self) -> Store: ...

    def head_anchor(self) -> str:
        """The chain's head: "STORE_ID:RECORD_ID:HASH:MAC" (MAC empty when unkeyed)."""
        ...


class TLSFiles(Protocol):
    """The server's certificate chain and key (`rngcoord.server.options.TLSConfig` is one)."""

    @property
    def cert(self) -> Path: ...

    @property
    def key(self) -> Path: ...


class _Denied(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


class StatusServer:
    """The status page, its API and /metrics of one server process.

    Args:
        source: where the page's data comes from (the process's Coordinator).
        registry: the Prometheus registry /metrics exposes.
        tokens: the token table; None when the server runs without one (the page is then
            open to anyone).
        open_access: serve the page and /api without a token even when there is a token
            file (`--status-open`). Default False.
        refresh_ms: how often the page refreshes its parts. Default 1000.
        tls: serve over TLS with this certificate and key. Default None: plain HTTP.
        session_s: how long a session lasts from sign-in. Default: `RNGCOORD_STATUS_SESSION_S`
            from the environment, else 12 h.

    `start(host, port)` binds and serves on the running loop; `stop()` closes.

    Raises:
        ValueError: `RNGCOORD_STATUS_SESSION_S` is not a positive number.
    """

    def __init__(
        self,
        source: Source,
        registry: CollectorRegistry,
        tokens: TokenTable | None,
        *,
        open_access: bool = False,
        refresh_ms: int = _REFRESH_MS,
        tls: TLSFiles | None = None,
        session_s: float | None = None,
    ) -> None:
        self._source = source
        self._registry = registry
        self._tokens = tokens
        self._open_access = open_access
        self._refresh_ms = refresh_ms
        self._tls = tls
        self._session_s = session_s if session_s is not None else session_s_from_env()
        # Keyed by the SHA-256 of the cookie's id: what the table holds cannot be replayed.
        self._sessions: dict[bytes, Session] = {}
        # Signs the sign-in form's token; a fresh key per process is enough, as a form
        # outlives neither its process nor its pre-session cookie.
        self._form_key = secrets.token_bytes(32)
        prefix = "__Host-" if tls is not None else ""
        self._cookie = prefix + COOKIE
        self._login_cookie = prefix + LOGIN_COOKIE
        self._env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(_TEMPLATES),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self._env.filters["utc"] = utc
        self._env.filters["percent"] = percent
        self._env.filters["ago"] = ago
        self._static = {
            name: (f"{kind}; charset=utf-8", (_TEMPLATES / "static" / name).read_bytes())
            for name, kind in _STATIC.items()
        }
        self._runner: web.AppRunner | None = None
        self.address = ""

    @property
    def is_open(self) -> bool:
        """Whether the page is served without a token."""
        return self._open_access or self._tokens is None

    @property
    def cookie_name(self) -> str:
        """The session cookie's name."""
        return self._cookie

    def reload(self, tokens: TokenTable) -> None:
        """Check tokens against `tokens` from now on (the server's SIGHUP reload), and end
        every session: the server keeps no token, so it cannot tell which sessions the new
        file still covers."""
        self._tokens = tokens
        ended = len(self._sessions)
        self._sessions.clear()
        if ended:
            event(_log, logging.INFO, "status_sessions_ended", sessions=ended, reason="reload")

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(middlewares=[self._guard])
        app.on_response_prepare.append(self._security_headers)
        app.router.add_get("/", self._page)
        app.router.add_get("/partials/groups", self._groups_partial)
        app.router.add_get("/api/status", self._api_status)
        app.router.add_get("/api/audit", self._api_audit)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/login", self._login_form)
        app.router.add_post("/login", self._login)
        app.router.add_post("/logout", self._logout)
        app.router.add_get("/static/{name}", self._static_file)
        return app

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context the HTTP side serves with (None: plain HTTP).

        Raises:
            OSError: the certificate or key cannot be read.
        """
        if self._tls is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self._tls.cert, self._tls.key)
        except ssl.SSLError as exc:
            # The reason, never the key file's text.
            raise OSError(
                f"cannot use {self._tls.cert} and {self._tls.key} for the HTTP side: "
                f"{exc.reason or exc.__class__.__name__}"
            ) from None
        return context

    async def start(self, host: str, port: int) -> str:
        """Bind host:port (0 picks a port) and serve on the running loop; return the bound
        "HOST:PORT".

        Raises:
            OSError: the address cannot be bound, or the TLS files cannot be read.
        """
        context = self.ssl_context()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on {join_host_port(host, port)}: {exc}") from exc
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        # Requests are short reads: a drain need not wait for them long.
        await web.SockSite(self._runner, sock, shutdown_timeout=2.0, ssl_context=context).start()
        self.address = join_host_port(host, int(sock.getsockname()[1]))
        return self.address

    async def stop(self) -> None:
        """Stop serving and close every connection."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --------------------------------------------------------------------- access

    def _session(self, request: web.Request) -> tuple[bytes, Session] | None:
        """The live session `request`'s cookie names, or None (an expired one is ended)."""
        sid = request.cookies.get(self._cookie, "")
        if not sid:
            return None
        key = session_digest(sid)
        session = self._sessions.get(key)
        if session is None:
            return None
        if time.monotonic() >= session.expires:
            del self._sessions[key]
            return None
        return key, session

    def _identify(self, request: web.Request) -> Identity | None:
        """Who sent `request` (None on an open page).

        Raises:
            _Denied: 401 without a valid token or session, 403 for a role that may not look.
        """
        if self.is_open:
            return None
        tokens = self._tokens
        assert tokens is not None
        header = request.headers.get("Authorization", "")
        if header:
            scheme, _, credential = header.partition(" ")
            if scheme.lower() != "bearer" or not credential.strip():
                raise _Denied(401, "the Authorization header must be 'Bearer TOKEN'")
            who = tokens.identify(credential.strip().encode("utf-8"))
            if who is None:
                raise _Denied(401, "the token is not in the server's token file")
        else:
            found = self._session(request)
            if found is None:
                raise _Denied(401, "this page needs an auditor or admin token")
            request[_SESSION] = found[1]
            who = found[1].who
        if who.role not in VIEW_ROLES:
            raise _Denied(403, f"{who.name!r} is a {who.role}: this page needs auditor or admin")
        return who

    def _same_origin(self, request: web.Request) -> bool:
        """Whether a form post comes from a page of this server. The Host header is the
        browser's, so an attacker's page cannot make it match its own Origin."""
        expected = f"{request.scheme}://{request.host}".lower()
        origin = request.headers.get("Origin")
        if origin is not None:
            return origin.lower() == expected
        referer = request.headers.get("Referer")
        if not referer:
            return False
        parts = urlsplit(referer)
        return f"{parts.scheme}://{parts.netloc}".lower() == expected

    def _form_token(self, login_id: str) -> str:
        return hmac.new(self._form_key, login_id.encode("utf-8"), hashlib.sha256).hexdigest()

    async def _security_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(_SECURITY_HEADERS)
        if not request.path.startswith("/static/"):
            # Pages, fragments and JSON describe live state and may be an auditor's view:
            # neither the browser nor a proxy keeps them.
            response.headers["Cache-Control"] = "no-store"

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if request.path in ("/metrics", "/login", "/logout") or request.path.startswith("/static/"):
            response: web.StreamResponse = await handler(request)
            return response
        try:
            request[_IDENTITY] = self._identify(request)
        except _Denied as denied:
            if request.path.startswith(("/api/", "/partials/")):
                return web.json_response({"error": denied.why}, status=denied.status)
            return self._login_page(
                request, status=denied.status, error=denied.why, forbidden=denied.status == 403
            )
        try:
            response = await handler(request)
        except Exception as exc:
            if not self._source.store.is_unavailable(exc):
                raise
            # The database is down or unreachable: say so, as the gRPC side does.
            why = f"the store is unavailable: {exc}"
            event(_log, logging.WARNING, "status_store_unavailable", error=str(exc))
            if request.path.startswith(("/api/", "/partials/")):
                return web.json_response({"error": why}, status=503)
            return web.Response(text=why, status=503)
        return response

    # ------------------------------------------------------------------- handlers

    async def _read(self, fn: Callable[[Tx], T]) -> T:
        # Reads run off the loop: on PostgreSQL each is a round trip, and the gRPC side
        # shares this loop.
        store = self._source.store
        return await asyncio.get_running_loop().run_in_executor(None, store.read, fn)

    async def _groups(self, who: Identity | None) -> list[GroupView]:
        views = await self._read(lambda tx: group_views(tx, member_limit=_MEMBER_LIMIT))
        return [g for g in views if who is None or who.allows_job(g.job)]

    async def _audit(self, who: Identity | None, after_id: int, limit: int) -> list[AuditRecord]:
        if who is None or who.allows_job(""):
            return await self._read(
                lambda tx: fetch_page(tx, after_id=after_id, limit=limit, newest=True)
            )
        window = await self._read(
            lambda tx: fetch_page(tx, after_id=after_id, limit=limit * 10, newest=True)
        )
        return [r for r in window if r.job and who.allows_job(r.job)][-limit:]

    def _head(self) -> dict[str, Any]:
        anchor = self._source.head_anchor()
        _, record_id, record_hash, mac = anchor.split(":")
        replication = self._source.store.replication
        return {
            "store_id": self._source.store.store_id,
            "replication": None if replication is None else replication.describe(),
            "replication_synchronous": None if replication is None else replication.synchronous,
            "anchor": anchor,
            "head_id": int(record_id),
            "head_hash": record_hash,
            "head_mac": mac,
        }

    def _groups_context(self, groups: list[GroupView]) -> dict[str, Any]:
        now_us = _now_us()
        return {
            "sections": by_state(groups, now_us),
            "has_groups": bool(groups),
            "now": utc(now_us),
            "now_us": now_us,
            **self._head(),
        }

    async def _page(self, request: web.Request) -> web.StreamResponse:
        who = request[_IDENTITY]
        groups = await self._groups(who)
        records = await self._audit(who, 0, _AUDIT_TAIL)
        session: Session | None = request.get(_SESSION)
        return self._render(
            "page.html",
            who=who,
            logout_token=session.csrf if session is not None else None,
            is_open=self.is_open,
            records=[record_json(r) for r in reversed(records)],
            last_id=records[-1].id if records else 0,
            refresh_ms=self._refresh_ms,
            **self._groups_context(groups),
        )

    async def _groups_partial(self, request: web.Request) -> web.StreamResponse:
        groups = await self._groups(request[_IDENTITY])
        return self._render("groups.html", **self._groups_context(groups))

    async def _api_status(self, request: web.Request) -> web.StreamResponse:
        groups = await self._groups(request[_IDENTITY])
        now_us = _now_us()
        return web.json_response(
            {
                **self._head(),
                "groups": [
                    {**g.to_json(), "state": group_state(g, now_us, IDLE_AFTER_S)} for g in groups
                ],
                "now_us": now_us,
            }
        )

    async def _api_audit(self, request: web.Request) -> web.StreamResponse:
        try:
            after_id = int(request.query.get("after", "0"))
            limit = int(request.query.get("limit", str(_AUDIT_TAIL)))
        except ValueError:
            return web.json_response({"error": "after and limit must be whole numbers"}, status=400)
        if after_id < 0 or not 1 <= limit <= _MAX_AUDIT_TAIL:
            return web.json_response(
                {"error": f"after must be 0 or more and limit in [1, {_MAX_AUDIT_TAIL}]"},
                status=400,
            )
        records = await self._audit(request[_IDENTITY], after_id, limit)
        return web.json_response(
            {
                "records": [record_json(r) for r in records],
                "last_id": records[-1].id if records else after_id,
            }
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _static_file(self, request: web.Request) -> web.StreamResponse:
        found = self._static.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        content_type, body = found
        # Revalidated on each load, so a new server's script is never mixed with an old page.
        return web.Response(
            body=body, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )

    async def _login_form(self, request: web.Request) -> web.StreamResponse:
        if self.is_open:
            raise web.HTTPSeeOther("/")
        return self._login_page(request, status=200, error="", forbidden=False)

    def _login_page(
        self, request: web.Request, *, status: int, error: str, forbidden: bool
    ) -> web.Response:
        """The sign-in form, with its form token bound to a pre-session cookie (set here
        unless the browser already holds one)."""
        login_id = request.cookies.get(self._login_cookie, "")
        fresh = len(login_id) < 32
        if fresh:
            login_id = secrets.token_urlsafe(32)
        response = self._render(
            "login.html",
            status=status,
            error=error,
            forbidden=forbidden,
            form_token=self._form_token(login_id),
        )
        if fresh:
            self._set_cookie(response, self._login_cookie, login_id, LOGIN_COOKIE_S)
        return response

    def _set_cookie(
        self, response: web.StreamResponse, name: str, value: str, max_age: int
    ) -> None:
        response.set_cookie(
            name,
            value,
            max_age=max_age,
            path="/",
            httponly=True,
            samesite="Strict",
            secure=self._tls is not None,
        )

    def _refuse_cross_site(self, request: web.Request, what: str, why: str) -> web.Response:
        event(_log, logging.WARNING, "status_csrf_refused", peer=request.remote, form=what, why=why)
        return web.Response(text=f"{what} refused: {why}", status=403)

    async def _login(self, request: web.Request) -> web.StreamResponse:
        if self.is_open:
            raise web.HTTPSeeOther("/")
        if not self._same_origin(request):
            return self._refuse_cross_site(request, "sign-in", "it did not come from this site")
        form = await request.post()
        login_id = request.cookies.get(self._login_cookie, "")
        sent = str(form.get("form_token", ""))
        if not login_id or not hmac.compare_digest(sent, self._form_token(login_id)):
            return self._refuse_cross_site(
                request, "sign-in", "the form token is missing or wrong; load the form again"
            )
        token = str(form.get("token", "")).strip()
        assert self._tokens is not None
        who = self._tokens.identify(token.encode("utf-8")) if token else None
        if who is None or who.role not in VIEW_ROLES:
            status = 401 if who is None else 403
            why = (
                "the token is not in the server's token file"
                if who is None
                else f"{who.name!r} is a {who.role}: this page needs auditor or admin"
            )
            event(_log, logging.INFO, "status_login_refused", peer=request.remote, status=status)
            return self._login_page(request, status=status, error=why, forbidden=status == 403)
        sid = self._open_session(who)
        event(_log, logging.INFO, "status_login", identity=who.name, peer=request.remote)
        response = web.HTTPSeeOther("/")
        self._set_cookie(response, self._cookie, sid, int(self._session_s))
        # The pre-session cookie has served: a new form gets a new one.
        response.del_cookie(self._login_cookie, path="/")
        raise response

    def _open_session(self, who: Identity) -> str:
        now = time.monotonic()
        for key in [k for k, s in self._sessions.items() if now >= s.expires]:
            del self._sessions[key]
        while len(self._sessions) >= MAX_SESSIONS:
            # Dicts keep insertion order: the first is the oldest.
            del self._sessions[next(iter(self._sessions))]
        sid = secrets.token_urlsafe(32)
        self._sessions[session_digest(sid)] = Session(
            who, now + self._session_s, secrets.token_urlsafe(32)
        )
        return sid

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        if not self._same_origin(request):
            return self._refuse_cross_site(request, "sign-out", "it did not come from this site")
        found = self._session(request)
        if found is not None:
            key, session = found
            form = await request.post()
            if not hmac.compare_digest(str(form.get("form_token", "")), session.csrf):
                return self._refuse_cross_site(
                    request, "sign-out", "the form token is missing or wrong"
                )
            del self._sessions[key]
            event(_log, logging.INFO, "status_logout", identity=session.who.name)
        response = web.HTTPSeeOther("/login")
        response.del_cookie(self._cookie, path="/")
        raise response

    def _render(self, name: str, *, status: int = 200, **context: Any) -> web.Response:
        html = self._env.get_template(name).render(**context)
        return web.Response(text=html, status=status, content_type="text/html")


def _now_us() -> int:
    return int(datetime.now(UTC).timestamp() * 1_000_000)


class StoreSource:
    """A `Source` without a Coordinator, for the supervisor of `rngcoord serve --workers N`:
    it reads the audit head from the store at each call and signs it as the workers do.

    Args:
        store: the open store.
        chain: the store's chain (its key signs the anchors).
    """

    def __init__(self, store: Store, chain: Chain) -> None:
        self._store = store
        self._chain = chain

    @property
    def store(self) -> Store:
        return self._store

    def head_anchor(self) -> str:
        record_id, record_hash = self._store.read(audit_head)
        mac = self._chain.anchor_mac(record_id, record_hash)
        return f"{self._chain.store_id}:{record_id}:{record_hash}:{mac}"


class StatusThread:
    """A `StatusServer` on an event loop of its own, in a background thread: the HTTP side of
    a process that has no event loop (the supervisor of several workers).

    Args:
        server: the status server to run.
        host: the address to bind.
        port: the port to bind; 0 picks one.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, server: StatusServer, host: str, port: int) -> None:
        self._server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rngcoord-status", daemon=True
        )
        self._thread.start()
        try:
            self.address = asyncio.run_coroutine_threadsafe(
                server.start(host, port), self._loop
            ).result()
        except BaseException:
            self.stop()
            raise

    def reload(self, tokens: TokenTable) -> None:
        """Check tokens against `tokens` from now on."""
        self._loop.call_soon_threadsafe(self._server.reload, tokens)

    def stop(self) -> None:
        """Stop serving and end the thread."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()
