"""Who may talk to the aggregator, and as what: a node or an operator.

Nodes register, pull tasks and push updates; operators submit, stop and read jobs and the
federation. The two hold different credentials: a token each (--token for nodes,
--operator-token for operators) and, under mutual TLS, certificates whose role the CA signed
into their subject (fedgpu.core.certs.Role). A certificate's role decides, never its name:
a node called "operator" is a node. With mutual TLS a configured token is a second factor for
its role. What is left for the services is binding a node certificate's name to the node
identity it claims, so one site cannot act as another.
"""

from __future__ import annotations

import functools
import hmac
import logging
from dataclasses import dataclass
from enum import StrEnum

import grpc

from fedgpu.core import certs
from fedgpu.core.transport import TOKEN_HEADER

log = logging.getLogger("fedgpu.server.auth")


class Role(StrEnum):
    NODE = "node"
    OPERATOR = "operator"


@dataclass(frozen=True)
class Caller:
    role: Role
    # Names the client certificate vouches for (CN and SANs); None without mutual TLS.
    names: frozenset[str] | None = None


@functools.lru_cache(maxsize=1024)
def _cert_role(pem: bytes) -> certs.Role | None:
    try:
        return certs.role(pem)
    except ValueError:
        return None


class Auth:
    def __init__(self, token: str | None, operator_token: str | None = None,
                 client_certs: bool = False, insecure: bool = False) -> None:
        # No token at all only in --insecure mode or with mTLS alone; the server says which.
        self._tokens = {Role.NODE: token.encode() if token else None,
                        Role.OPERATOR: operator_token.encode() if operator_token else None}
        self.client_certs = client_certs
        self.insecure = insecure

    @property
    def has_operator(self) -> bool:
        return self.insecure or self.client_certs or self._tokens[Role.OPERATOR] is not None

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
            expected = self._tokens[role]
            if expected is not None and not self._matches(presented, expected):
                await self._refuse_token(context, presented, role)
            return Caller(role, names)
        if self.insecure:
            return Caller(wanted)
        for role in (Role.OPERATOR, Role.NODE):
            expected = self._tokens[role]
            if expected is not None and self._matches(presented, expected):
                return Caller(role)
        await self._refuse_token(context, presented, wanted)
        raise AssertionError("unreachable")

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
