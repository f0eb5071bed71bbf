"""The coordinator's HTTP side: a live status page, its JSON API, and Prometheus /metrics.

`StatusServer` runs an aiohttp application on the event loop of the server it belongs to
(`rngcoord serve` opens it on the `--metrics` address). Routes:

- `GET /`: the status page (Jinja2, server-side rendered): every job and its groups; for each
  group its current epoch, members by rank (member id, peer, join time, whether it left),
  leases granted, the high-water mark as a share of the usable offset space, restores, and a
  banner naming the ranks of a divergence; then the audit tail, the store id and the anchored
  head of the audit chain. The page refreshes its parts without reloading: each second it
  fetches `/partials/groups` (the same template's fragment) and `/api/audit?after=ID`.
- `GET /partials/groups`: the groups fragment of the page.
- `GET /api/status`: the store id, the audit head and every group, as JSON.
- `GET /api/audit?after=ID&limit=N`: the newest N (default 50, at most 500) audit records
  after record ID, oldest first, as JSON.
- `GET /metrics`: Prometheus text format from the server's registry; never needs a token
  (a scraper holds none, as before this page existed).
- `GET /login`, `POST /login`, `POST /logout`: a form that keeps a token in a cookie.

Access: the page, its fragment and /api need a token of the auditor or admin role (from the
server's token file, reloaded with it on SIGHUP), sent as `Authorization: Bearer TOKEN` or
through the login form, which stores it in an HttpOnly, SameSite=Strict cookie (the token
itself: every worker process and every reload checks it afresh, so no session can outlive
its token). No token: 401 with the login form. A member token: 403. An auditor whose job
patterns are not `*` sees only the groups of its jobs, and audit records of its jobs among
the newest `limit * 10`. The page is open to anyone when the server runs without a token file
(as its gRPC side then is; logged as a warning) or with `open_access` (`--status-open`).

With `--workers N` the supervisor serves this HTTP side (the workers have none): a
`StatusThread` runs it on an event loop of its own, reading the store through a `StoreSource`
and /metrics from the workers' multiprocess registry.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import jinja2
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rngcoord.server.addresses import join_host_port
from rngcoord.server.audit import Chain, fetch_page
from rngcoord.server.auth import Identity, TokenTable
from rngcoord.server.logs import event, get_logger
from rngcoord.server.queries import audit_head
from rngcoord.server.store import Store, Tx
from rngcoord.server.views import GroupView, group_views
from rngcoord.v1.types import AuditRecord

__all__ = ["COOKIE", "Source", "StatusServer", "StatusThread", "StoreSource"]

T = TypeVar("T")
_log = get_logger("status")

COOKIE = "rngcoord_token"
"""The cookie the login form sets."""

VIEW_ROLES = frozenset({"auditor", "admin"})
"""The roles that may see the page and /api."""

_TEMPLATES = Path(__file__).resolve().parent / "templates"
_AUDIT_TAIL = 50
_MAX_AUDIT_TAIL = 500
_MEMBER_LIMIT = 64
_REFRESH_MS = 1000
_IDENTITY = "rngcoord.identity"


class Source(Protocol):
    """What the status page reads: the store, and the audit head as an anchor. A
    `Coordinator` is one."""

    @property
    def store(self) -> Store: ...

    def head_anchor(self) -> str:
        """The chain's head: "STORE_ID:RECORD_ID:HASH:MAC" (MAC empty when unkeyed)."""
        ...


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

    `start(host, port)` binds and serves on the running loop; `stop()` closes.
    """

    def __init__(
        self,
        source: Source,
        registry: CollectorRegistry,
        tokens: TokenTable | None,
        *,
        open_access: bool = False,
        refresh_ms: int = _REFRESH_MS,
    ) -> None:
        self._source = source
        self._registry = registry
        self._tokens = tokens
        self._open_access = open_access
        self._refresh_ms = refresh_ms
        self._env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(_TEMPLATES),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self._env.filters["utc"] = _utc
        self._env.filters["percent"] = _percent
        self._runner: web.AppRunner | None = None
        self.address = ""

    @property
    def is_open(self) -> bool:
        """Whether the page is served without a token."""
        return self._open_access or self._tokens is None

    def reload(self, tokens: TokenTable) -> None:
        """Check tokens against `tokens` from now on (the server's SIGHUP reload)."""
        self._tokens = tokens

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page)
        app.router.add_get("/partials/groups", self._groups_partial)
        app.router.add_get("/api/status", self._api_status)
        app.router.add_get("/api/audit", self._api_audit)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/login", self._login_form)
        app.router.add_post("/login", self._login)
        app.router.add_post("/logout", self._logout)
        return app

    async def start(self, host: str, port: int) -> str:
        """Bind host:port (0 picks a port) and serve on the running loop; return the bound
        "HOST:PORT".

        Raises:
            OSError: the address cannot be bound.
        """
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
        await web.SockSite(self._runner, sock, shutdown_timeout=2.0).start()
        self.address = join_host_port(host, int(sock.getsockname()[1]))
        return self.address

    async def stop(self) -> None:
        """Stop serving and close every connection."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --------------------------------------------------------------------- access

    def _identify(self, request: web.Request) -> Identity | None:
        """Who sent `request` (None on an open page).

        Raises:
            _Denied: 401 without a valid token, 403 for a role that may not look.
        """
        if self.is_open:
            return None
        tokens = self._tokens
        assert tokens is not None
        header = request.headers.get("Authorization", "")
        scheme, _, credential = header.partition(" ")
        if header and scheme.lower() != "bearer":
            raise _Denied(401, "the Authorization header must be 'Bearer TOKEN'")
        token = credential.strip() if header else request.cookies.get(COOKIE, "")
        if not token:
            raise _Denied(401, "this page needs an auditor or admin token")
        who = tokens.identify(token.encode("utf-8"))
        if who is None:
            raise _Denied(401, "the token is not in the server's token file")
        if who.role not in VIEW_ROLES:
            raise _Denied(403, f"{who.name!r} is a {who.role}: this page needs auditor or admin")
        return who

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if request.path in ("/metrics", "/login", "/logout"):
            response: web.StreamResponse = await handler(request)
            return response
        try:
            request[_IDENTITY] = self._identify(request)
        except _Denied as denied:
            if request.path.startswith(("/api/", "/partials/")):
                return web.json_response({"error": denied.why}, status=denied.status)
            return self._render(
                "login.html",
                status=denied.status,
                error=denied.why,
                forbidden=denied.status == 403,
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
        return {
            "store_id": self._source.store.store_id,
            "anchor": anchor,
            "head_id": int(record_id),
            "head_hash": record_hash,
            "head_mac": mac,
        }

    async def _page(self, request: web.Request) -> web.StreamResponse:
        who = request[_IDENTITY]
        groups = await self._groups(who)
        records = await self._audit(who, 0, _AUDIT_TAIL)
        return self._render(
            "page.html",
            who=who,
            is_open=self.is_open,
            jobs=_by_job(groups),
            records=[_record_json(r) for r in records],
            last_id=records[-1].id if records else 0,
            refresh_ms=self._refresh_ms,
            now=_utc(_now_us()),
            **self._head(),
        )

    async def _groups_partial(self, request: web.Request) -> web.StreamResponse:
        groups = await self._groups(request[_IDENTITY])
        return self._render(
            "groups.html", jobs=_by_job(groups), now=_utc(_now_us()), **self._head()
        )

    async def _api_status(self, request: web.Request) -> web.StreamResponse:
        groups = await self._groups(request[_IDENTITY])
        return web.json_response(
            {**self._head(), "groups": [g.to_json() for g in groups], "now_us": _now_us()}
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
                "records": [_record_json(r) for r in records],
                "last_id": records[-1].id if records else after_id,
            }
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _login_form(self, request: web.Request) -> web.StreamResponse:
        return self._render("login.html", error="", forbidden=False)

    async def _login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        token = str(form.get("token", "")).strip()
        if self.is_open:
            raise web.HTTPSeeOther("/")
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
            return self._render("login.html", status=status, error=why, forbidden=status == 403)
        event(_log, logging.INFO, "status_login", identity=who.name, peer=request.remote)
        response = web.HTTPSeeOther("/")
        response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")
        raise response

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        raise response

    def _render(self, name: str, *, status: int = 200, **context: Any) -> web.Response:
        html = self._env.get_template(name).render(**context)
        return web.Response(text=html, status=status, content_type="text/html")


def _by_job(groups: list[GroupView]) -> list[tuple[str, list[GroupView]]]:
    jobs: dict[str, list[GroupView]] = {}
    for g in groups:
        jobs.setdefault(g.job, []).append(g)
    return list(jobs.items())


def _record_json(r: AuditRecord) -> dict[str, Any]:
    return {
        "id": r.id,
        "time": _utc(r.ts_us),
        "job": r.job,
        "group": r.group,
        "kind": r.kind,
        "actor": r.actor,
        "detail": " ".join(f"{k}={v}" for k, v in sorted(r.detail.items())),
    }


def _now_us() -> int:
    return int(datetime.now(UTC).timestamp() * 1_000_000)


def _utc(ts_us: int | None) -> str:
    if not ts_us:
        return "-"
    return datetime.fromtimestamp(ts_us / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _percent(share: float) -> str:
    if share == 0:
        return "0%"
    # A training job uses a sliver of 2^64: three significant digits show that it moves.
    return f"{share * 100:.3g}%"


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
