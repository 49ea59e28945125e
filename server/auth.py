"""Who may talk to the aggregator: a shared token, a client certificate, or both.

With mutual TLS the handshake has already proven that the peer holds a key our CA certified;
what is left here is binding that certificate's name to the node identity it claims, so one
node's certificate cannot register or act as another node.
"""

from __future__ import annotations

import hmac
import logging

import grpc

from fedgpu.core.transport import TOKEN_HEADER

log = logging.getLogger("fedgpu.server.auth")


class TokenAuth:
    def __init__(self, token: str | None, client_certs: bool = False) -> None:
        # None only in --insecure mode or with mTLS alone; the server logs which at start.
        self._token = token.encode() if token else None
        self.client_certs = client_certs

    async def check(self, context: grpc.aio.ServicerContext) -> None:
        if self._token is None:
            return
        presented = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER, "")
        if isinstance(presented, bytes):
            presented = presented.decode(errors="replace")
        if not presented:
            log.warning("refused %s: no token presented", context.peer())
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "no token presented: start the node with --token (or FEDGPU_TOKEN) set to the "
                "aggregator's token",
            )
        if not hmac.compare_digest(presented.encode(), self._token):
            log.warning("refused %s: wrong token", context.peer())
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong token: use the token the aggregator was started with (--token / "
                "FEDGPU_TOKEN)",
            )

    def names(self, context: grpc.aio.ServicerContext) -> set[str] | None:
        """Names the peer's certificate vouches for (CN and SANs); None without mTLS."""
        if not self.client_certs:
            return None
        auth = context.auth_context() or {}
        found: set[str] = set()
        for key in ("x509_common_name", "x509_subject_alternative_name"):
            found.update(v.decode(errors="replace") for v in auth.get(key, ()))
        return found

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
