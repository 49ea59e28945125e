"""Who may talk to the aggregator, and as what: a node or an operator.

Nodes register, pull tasks and push updates; operators submit, stop and read jobs and the
federation. The two hold different credentials: a token each (--token for nodes,
--operator-token for operators) and, under mutual TLS, certificates whose role the CA signed
into their subject (fedgpu.core.certs.Role). A certificate's role decides, never its name:
a node called "operator" is a node. With mutual TLS a configured token is a second factor for
its role. What is left for the services is binding a node certificate's name to the node
identity it claims, so one site cannot act as another.

Operators are people (server/people.py): each holds a token of their own, or a certificate
whose CN names them (the aggregator's table decides their role, never the certificate). The
single operator credential of before (--operator-token, an operator certificate whose CN is
not in the table) still works and acts as an admin. A revoked person is refused at once.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from fedgpu.core import certs
from fedgpu.core.audit import AuditError
from fedgpu.core.people import Person, PersonRole
from fedgpu.core.transport import TOKEN_HEADER

if TYPE_CHECKING:
    from fedgpu.core.audit import AuditLog
    from fedgpu.server.people import People

log = logging.getLogger("fedgpu.server.auth")


class Role(StrEnum):
    NODE = "node"
    OPERATOR = "operator"


@dataclass(frozen=True)
class Caller:
    role: Role
    # Names the client certificate vouches for (CN and SANs); None without mutual TLS.
    names: frozenset[str] | None = None
    # The person behind an operator credential (None for nodes).
    person: Person | None = None

    @property
    def actor(self) -> str:
        """Who this is, for the audit log and the job's "submitted by"."""
        if self.person is not None:
            return self.person.name
        return "node " + ", ".join(sorted(self.names or ())) if self.names else str(self.role)


@functools.lru_cache(maxsize=1024)
def _cert_role(pem: bytes) -> certs.Role | None:
    try:
        return certs.role(pem)
    except ValueError:
        return None


@functools.lru_cache(maxsize=1024)
def cert_fingerprint(pem: bytes) -> str:
    """sha256 of the certificate's DER encoding: what `fedgpu users add` pins."""
    cert = x509.load_pem_x509_certificate(pem)
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()


def _legacy(name: str) -> Person:
    return Person(name, PersonRole.ADMIN, implicit=True)


class Auth:
    def __init__(self, token: str | None, operator_token: str | None = None,
                 client_certs: bool = False, insecure: bool = False,
                 people: People | None = None, audit_log: AuditLog | None = None) -> None:
        # No token at all only in --insecure mode or with mTLS alone; the server says which.
        self._tokens = {Role.NODE: token.encode() if token else None,
                        Role.OPERATOR: operator_token.encode() if operator_token else None}
        self.client_certs = client_certs
        self.insecure = insecure
        self.people = people
        # The aggregator's audit log (fedgpu.core.audit), for the services that hold this
        # Auth: the Admin guard, the dashboard, node registration and removal.
        self.audit_log = audit_log

    def audit(self, actor: str, action: str, target: str = "", outcome: str = "OK",
              detail: str | None = None) -> None:
        """One audit record (nothing without a log); a log that cannot be written is said in
        the aggregator's log, never the caller's failure."""
        if self.audit_log is None:
            return
        try:
            self.audit_log.record(actor, action, target, outcome, detail)
        except (OSError, AuditError) as exc:
            log.error("audit log %s: cannot write %s: %s", self.audit_log.path, action, exc)

    def audit_soon(self, actor: str, action: str, target: str = "", outcome: str = "OK",
                   detail: str | None = None) -> None:
        """`audit` in a worker thread, not waited for: for the event loop's hot paths (a
        thousand nodes registering must not wait on a thousand fsyncs)."""
        if self.audit_log is not None:
            asyncio.get_running_loop().run_in_executor(None, self.audit, actor, action, target,
                                                       outcome, detail)

    @property
    def has_operator(self) -> bool:
        return self.insecure or self.client_certs or self._tokens[Role.OPERATOR] is not None \
            or (self.people is not None and self.people.any())

    def person_of_token(self, presented: str) -> Person | None:
        """The person a bearer token belongs to (the dashboard's check): the operator token is
        the implicit admin; a revoked person's token is nobody's."""
        expected = self._tokens[Role.OPERATOR]
        if expected is not None and self._matches(presented, expected):
            return _legacy("operator")
        person = self.people.by_token(presented) if self.people is not None else None
        return None if person is None or person.revoked else person

    # ---- the two kinds of caller -----------------------------------------------------

    async def node(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of a Federation call: it must be a node."""
        caller = await self._identify(context, Role.NODE)
        if caller.role is not Role.NODE:
            log.warning("refused %s: an operator credential used as a node", context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "an operator credential cannot act as a node: start nodes "
                                "with the node token or a node certificate")
        return caller

    async def operator(self, context: grpc.aio.ServicerContext,
                       nodes_may_ask: bool = False) -> Caller:
        """The caller of an Admin call: an operator (or, where `nodes_may_ask`, a node with
        a certificate, which may then learn about itself only)."""
        if not self.has_operator:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "this aggregator was started without an operator credential: start it with "
                "--operator-token (or FEDGPU_OPERATOR_TOKEN), or use mutual TLS with a "
                "certificate from 'fedgpu certs operator'")
        caller = await self._identify(context, Role.OPERATOR)
        if caller.role is Role.OPERATOR or (nodes_may_ask and caller.names is not None):
            return caller
        log.warning("refused %s: a node credential on an operator call", context.peer())
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            "this call needs the operator credential (--token with the aggregator's "
            "--operator-token, or an operator certificate); a node's credential may not "
            "submit, stop or read jobs and the federation")
        raise AssertionError("unreachable")  # abort raises

    # ---- identification ------------------------------------------------------------------

    async def _identify(self, context: grpc.aio.ServicerContext, wanted: Role) -> Caller:
        presented = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER, "")
        if isinstance(presented, bytes):
            presented = presented.decode(errors="replace")
        if self.client_certs:
            role, names = self._certificate(context)
            if role is None:
                log.warning("refused %s: certificate has no node or operator role",
                            context.peer())
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    "this certificate is neither a node's nor an operator's "
                                    "(the aggregator's own certificate cannot call in)")
            assert role is not None
            person = None
            if role is Role.OPERATOR:
                person = await self._certified_person(context)
                if not person.implicit:
                    # A person's pinned certificate stands alone; the shared operator token
                    # stays a second factor for the implicit operator only.
                    return Caller(role, names, person)
            expected = self._tokens[role]
            if expected is not None and not self._matches(presented, expected):
                await self._refuse_token(context, presented, role)
            return Caller(role, names, person)
        # The shared tokens first: a constant-time compare, while a person's token costs a
        # table lookup, and nodes (the many, polling callers) hold the shared one.
        for role in (Role.OPERATOR, Role.NODE):
            expected = self._tokens[role]
            if expected is not None and self._matches(presented, expected):
                return Caller(role, None, _legacy("operator") if role is Role.OPERATOR
                              else None)
        person = await self._token_person(context, presented)
        if person is not None:
            return Caller(Role.OPERATOR, None, person)
        if self.insecure:
            return Caller(wanted, None, _legacy("anonymous") if wanted is Role.OPERATOR
                          else None)
        await self._refuse_token(context, presented, wanted)
        raise AssertionError("unreachable")

    async def _token_person(self, context: grpc.aio.ServicerContext,
                            presented: str) -> Person | None:
        if self.people is None or not presented:
            return None
        person = self.people.by_token(presented)
        if person is not None and person.revoked:
            log.warning("refused %s: the token of revoked user %s", context.peer(), person.name)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"the credential of user {person.name!r} was revoked")
        return person

    async def _certified_person(self, context: grpc.aio.ServicerContext) -> Person:
        """The person an operator certificate names (its CN), as the table has them; the
        implicit admin for a CN the table does not know."""
        auth = context.auth_context() or {}
        cn = b"".join(auth.get("x509_common_name", ())).decode(errors="replace")
        person = self.people.get(cn) if self.people is not None and cn else None
        if person is None:
            return _legacy(cn or "operator")
        pinned = self.people.cert_sha256(cn) if self.people is not None else None
        pem = b"".join(auth.get("x509_pem_cert", ()))
        if person.revoked or (pinned is not None and cert_fingerprint(pem) != pinned):
            why = "was revoked" if person.revoked else "is not the certificate issued to them"
            log.warning("refused %s: certificate of user %s %s", context.peer(), cn, why)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"the certificate of user {cn!r} {why}")
        return person

    @staticmethod
    def _matches(presented: str, expected: bytes) -> bool:
        return bool(presented) and hmac.compare_digest(presented.encode(), expected)

    async def _refuse_token(self, context: grpc.aio.ServicerContext, presented: str,
                            role: Role) -> None:
        flag = "--token (or FEDGPU_TOKEN)" if role is Role.NODE else \
            "--token (or FEDGPU_OPERATOR_TOKEN) set to the aggregator's --operator-token"
        what = "no token presented" if not presented else "wrong token"
        log.warning("refused %s: %s", context.peer(), what)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"{what}: use {flag}")

    def _certificate(self, context: grpc.aio.ServicerContext
                     ) -> tuple[Role | None, frozenset[str]]:
        auth = context.auth_context() or {}
        names: set[str] = set()
        for key in ("x509_common_name", "x509_subject_alternative_name"):
            names.update(v.decode(errors="replace") for v in auth.get(key, ()))
        pem = b"".join(auth.get("x509_pem_cert", ()))
        cert_role = _cert_role(pem) if pem else None
        role = {certs.Role.OPERATOR: Role.OPERATOR, certs.Role.NODE: Role.NODE,
                None: Role.NODE}.get(cert_role)
        return role, frozenset(names)

    def names(self, context: grpc.aio.ServicerContext) -> set[str] | None:
        """Names the peer's certificate vouches for (CN and SANs); None without mTLS."""
        if not self.client_certs:
            return None
        return set(self._certificate(context)[1])

    async def bind(self, context: grpc.aio.ServicerContext, node_name: str, what: str) -> None:
        """Abort unless the client certificate names `node_name` (a no-op without mTLS)."""
        names = self.names(context)
        if names is None or node_name in names:
            return
        shown = ", ".join(sorted(names)) or "no name"
        log.warning("refused %s from %s: certificate is for %s, not %r", what, context.peer(),
                    shown, node_name)
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{what} as node {node_name!r} refused: this client certificate is for {shown}; a "
            "node may only act under its own certificate's name (--name must match it)",
        )
