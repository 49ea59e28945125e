"""The aggregator's web dashboard (`--ui-port`): one read-only page and the JSON it reads.

`/api/status`, `/api/nodes`, `/api/rounds` and `/api/jobs` return the documents that
`fedgpu status|nodes|rounds|job list --json` print, from the same producers; with parameters,
`/api/nodes` and `/api/rounds` return the bounded views of server/views/dashboard_pages.py. Every
path but the login form and the page's static assets needs the operator credential.

HTTP is aiohttp's, not hand-written like server/views/metrics.py: this server parses what browsers
send (a login form, cookies, query strings), and aiohttp's parser, size limits (request line,
headers, body, form fields) and idle-connection close are long-tested where a hand-written
parser would not be. It runs on the aggregator's event loop, so a document is read between two
steps of the round engine, never half-way through one (as metrics.py argues), and it adds no
thread. The assets are read once from the package into memory and served by exact name, so no
request path ever reaches the file system.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from fedgpu.core.errors import FedgpuError
from fedgpu.core.people import Person
from fedgpu.server import permissions
from fedgpu.server.views.dashboard_auth import (
    COOKIE,
    SESSION_TTL_S,
    FailureThrottle,
    Sessions,
    bearer,
    legacy_person,
)
from fedgpu.server.views.dashboard_pages import (
    NodesQuery,
    QueryError,
    RoundsQuery,
    nodes_page,
    rounds_summary,
)

log = logging.getLogger("fedgpu.server.views.dashboard")

Doc = Callable[[], Any]
ASSETS = {"app.js": "text/javascript", "charts.js": "text/javascript",
          "cross_site.js": "text/javascript",
          "style.css": "text/css", "index.html": "text/html", "login.html": "text/html"}
# The login form is the only body this server reads.
MAX_BODY = 8 << 10
MAX_FORM_FIELDS = 8
# (session, path) pairs remembered as recorded (see _seen); past it every call is recorded.
MAX_SEEN = 4096
BODY_TIMEOUT_S = 10.0
# A connection that sends no complete request for this long is closed (aiohttp's keep-alive
# timer runs from the connection's start), so slow or idle clients cannot pile up.
IDLE_TIMEOUT_S = 15.0
SECURITY_HEADERS = {
    # Only our own scripts, styles and fetches: nothing inline, nothing from elsewhere.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
FORBIDDEN = "forbidden: {why}"
UNAUTHORISED = ("unauthorised: send 'Authorization: Bearer TOKEN' with the operator token, or "
                "log in at /login")


class NoDocument(Exception):
    """The aggregator does not produce this document (yet): 404."""


@dataclass(frozen=True)
class DashboardSources:
    """Where the documents come from. Each callable returns one document, as the matching
    Admin RPC would; `jobs` is None on an aggregator without jobs (then /api/jobs is 404)."""

    status: Doc
    nodes: Doc
    rounds: Doc
    is_operator: Callable[[str], bool]
    jobs: Doc | None = None
    # The person a token belongs to (people's own tokens, the operator token as an implicit
    # admin); None: `is_operator` alone, every holder an admin.
    person: Callable[[str], Person | None] | None = None
    # Where logins and API calls are recorded (Auth.audit); None: not recorded.
    audit: Callable[..., None] | None = None
    # The study of a job by id (for researchers, who see their studies' jobs only).
    job_study: Callable[[str], str | None] | None = None

    def person_of(self, token: str) -> Person | None:
        if self.person is not None:
            return self.person(token)
        return legacy_person() if self.is_operator(token) else None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def to_json(doc: Any) -> str:
    """JSON a browser can parse: a diverged loss (NaN, inf) becomes null. The CLI prints the
    same document with Python's NaN, which JSON.parse refuses."""
    try:
        return json.dumps(doc, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(doc), allow_nan=False)


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=to_json(doc), status=status, content_type="application/json",
                        headers=headers)


class DashboardServer:
    def __init__(self, sources: DashboardSources, *, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 session_ttl_s: float = SESSION_TTL_S) -> None:
        self.sources = sources
        self.idle_timeout_s = idle_timeout_s
        self.sessions = Sessions(session_ttl_s)
        # Wrong tokens per address, slowed down (a login form is a guessing oracle).
        self.throttle = FailureThrottle()
        # (session, path) pairs already on the audit record: a page polling every few
        # seconds is recorded once per session and path, not thousands of times a day.
        self._seen: set[tuple[str, str]] = set()
        root = importlib.resources.files("fedgpu.server.views.ui")
        self.assets = {name: root.joinpath(name).read_bytes() for name in ASSETS}
        self.runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, client_max_fields=MAX_FORM_FIELDS)
        app.on_response_prepare.append(self._headers)
        r = app.router
        r.add_get("/", self._index)
        r.add_get("/login", self._login_form)
        r.add_post("/login", self._login)
        r.add_post("/logout", self._logout)
        r.add_get("/static/{name}", self._asset)
        r.add_get("/api/status", self._status)
        r.add_get("/api/nodes", self._nodes)
        r.add_get("/api/rounds", self._rounds)
        r.add_get("/api/jobs", self._jobs)
        r.add_get("/api/me", self._me)
        return app

    async def start(self, host: str, port: int) -> None:
        self.runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=2.0,
                                    keepalive_timeout=self.idle_timeout_s)
        await self.runner.setup()
        try:
            await web.TCPSite(self.runner, host, port).start()
        except OSError as exc:
            await self.runner.cleanup()
            raise FedgpuError(f"cannot serve the dashboard on {host}:{port}: {exc.strerror}; is "
                              "the port in use? pick another --ui-port") from None
        bound_host, bound_port = self.runner.addresses[0][:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}/"
        log.info("dashboard on %s (operator token required)", self.url)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ---- access ----------------------------------------------------------------------

    def _check_token(self, request: web.Request, token: str) -> Person | None:
        """The person `token` belongs to; HTTP 429 without checking it while its address is
        locked out for earlier wrong ones."""
        address = request.remote or "?"
        wait = self.throttle.wait_s(address)
        if wait > 0:
            raise web.HTTPTooManyRequests(
                text=f"too many wrong tokens from this address: try again in "
                f"{math.ceil(wait)}s", headers={"Retry-After": str(math.ceil(wait))})
        person = self.sources.person_of(token)
        if person is not None:
            self.throttle.succeeded(address)
            return person
        self.throttle.failed(address)
        return None

    def _who(self, request: web.Request) -> tuple[Person | None, str]:
        """The person behind the request (None: nobody) and its session id ("" for Bearer)."""
        token = bearer(request.headers.get("Authorization", ""))
        if token is None:
            sid = request.cookies.get(COOKIE, "")
            token = self.sessions.token(sid) if sid else None
            if token is None:
                return None, sid
            # Checked again on every request: a revoked person or a changed operator
            # credential ends the session at once.
            person = self.sources.person_of(token)
            if person is None:
                self.sessions.drop(sid)
            return person, sid
        person = self._check_token(request, token)
        if person is None:
            log.warning("dashboard: refused %s %s from %s: wrong token", request.method,
                        request.path, request.remote)
            self._audit(f"unidentified {request.remote}", f"dashboard {request.path}",
                        "UNAUTHENTICATED")
        return person, ""

    def _allowed(self, request: web.Request) -> bool:
        return self._who(request)[0] is not None

    def _audit(self, actor: str, action: str, outcome: str = "OK", target: str = "",
               detail: str | None = None) -> None:
        if self.sources.audit is not None:
            self.sources.audit(actor, action, target, outcome, detail)

    @staticmethod
    async def _headers(request: web.Request, response: web.StreamResponse) -> None:
        for key, value in SECURITY_HEADERS.items():
            response.headers.setdefault(key, value)

    def _page(self, name: str, status: int = 200, message: str = "") -> web.Response:
        body = self.assets[name]
        if message:
            # Only fixed texts of ours go in; nothing from the request is echoed.
            body = body.replace(b"<!--MESSAGE-->", message.encode())
        return web.Response(body=body, status=status, content_type="text/html",
                            charset="utf-8")

    async def _index(self, request: web.Request) -> web.StreamResponse:
        if not self._allowed(request):
            raise web.HTTPSeeOther("/login")
        return self._page("index.html")

    async def _login_form(self, request: web.Request) -> web.StreamResponse:
        if self._allowed(request):
            raise web.HTTPSeeOther("/")
        return self._page("login.html")

    async def _login(self, request: web.Request) -> web.StreamResponse:
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                form = await request.post()
        except TimeoutError:
            raise web.HTTPRequestTimeout(text="the login form took too long to arrive") from None
        token = form.get("token")
        person = self._check_token(request, token) if isinstance(token, str) and token \
            else None
        if person is None:
            log.warning("dashboard: refused a login from %s: wrong token", request.remote)
            self._audit(f"unidentified {request.remote}", "dashboard login",
                        "UNAUTHENTICATED")
            return self._page("login.html", 401, "Wrong token: use your own token or the "
                              "operator token.")
        assert isinstance(token, str)
        self._audit(person.name, "dashboard login", detail=f"from {request.remote}")
        response = web.HTTPSeeOther("/")
        # HttpOnly: page scripts never see it; SameSite=Strict: no other site's page can send
        # it. Not Secure: the dashboard is plain HTTP on loopback (or an SSH tunnel to it).
        response.set_cookie(COOKIE, self.sessions.create(token), httponly=True,
                            samesite="Strict", path="/", max_age=int(self.sessions.ttl_s))
        raise response

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        person, sid = self._who(request)
        if person is not None:
            self._audit(person.name, "dashboard logout")
        self._seen = {seen for seen in self._seen if seen[0] != sid}
        self.sessions.drop(request.cookies.get(COOKIE, ""))
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        raise response

    async def _asset(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in ASSETS or name.endswith(".html"):
            raise web.HTTPNotFound(text="no such asset")
        return web.Response(body=self.assets[name], content_type=ASSETS[name], charset="utf-8")

    # ---- data ------------------------------------------------------------------------

    def _api(self, request: web.Request, produce: Callable[[dict[str, str]], Any]
             ) -> web.Response:
        person, sid = self._who(request)
        if person is None:
            return _json({"error": UNAUTHORISED}, 401,
                         {"WWW-Authenticate": 'Bearer realm="fedgpu dashboard"'})
        try:
            doc = self._visible(person, produce(dict(request.query)))
        except QueryError as exc:
            return _json({"error": str(exc)}, 400)
        except NoDocument as exc:
            return _json({"error": str(exc)}, 404)
        except PermissionError as exc:
            self._audit(person.name, f"dashboard {request.path}", "PERMISSION_DENIED",
                        detail=str(exc))
            return _json({"error": FORBIDDEN.format(why=exc)}, 403)
        if not sid or (sid, request.path) not in self._seen:
            if sid and len(self._seen) < MAX_SEEN:
                self._seen.add((sid, request.path))
            self._audit(person.name, f"dashboard {request.path}")
        return _json(doc)

    def _visible(self, person: Person, doc: Any) -> Any:
        """`doc` as `person` may see it: a researcher sees their own studies' jobs only (the
        rule of server/permissions.py, as the Admin calls apply it)."""
        if person.role != "researcher" or self.sources.job_study is None:
            return doc
        study = self.sources.job_study

        def readable(job_id: Any) -> bool:
            return not job_id or permissions.may_read_job(person, study(str(job_id)))

        if isinstance(doc, list):
            return [j for j in doc if not isinstance(j, dict) or readable(j.get("job_id"))]
        if isinstance(doc, dict) and not readable(doc.get("job_id")):
            raise PermissionError(permissions.refusal(person, "GetStatus",
                                                      study(str(doc["job_id"]))))
        return doc

    async def _me(self, request: web.Request) -> web.Response:
        """Who is logged in and what their role lets them do (the page shows it)."""
        def produce(_: dict[str, str]) -> Any:
            person, _sid = self._who(request)
            assert person is not None
            return {"name": person.name, "role": str(person.role),
                    "studies": list(person.studies), "implicit": person.implicit,
                    "may": {call: permissions.refusal(person, call, has_job=False) is None
                            for call in sorted(permissions.CALLS)}}

        return self._api(request, produce)

    async def _status(self, request: web.Request) -> web.Response:
        return self._api(request, lambda _: self.sources.status())

    async def _nodes(self, request: web.Request) -> web.Response:
        def produce(params: dict[str, str]) -> Any:
            query = NodesQuery.parse(params)
            doc = self.sources.nodes()
            if query is None:
                return doc
            return nodes_page(doc, self.sources.rounds().get("rounds") or [], query)

        return self._api(request, produce)

    async def _rounds(self, request: web.Request) -> web.Response:
        def produce(params: dict[str, str]) -> Any:
            query = RoundsQuery.parse(params)
            doc = self.sources.rounds()
            return doc if query is None else rounds_summary(doc, query)

        return self._api(request, produce)

    async def _jobs(self, request: web.Request) -> web.Response:
        def produce(_: dict[str, str]) -> Any:
            if self.sources.jobs is None:
                raise NoDocument("this aggregator has no jobs")
            return self.sources.jobs()

        return self._api(request, produce)
