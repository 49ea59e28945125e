"""Who may talk to the aggregator: nodes and operators present the run's token."""

from __future__ import annotations

import hmac

import grpc

from fedgpu.transport import TOKEN_HEADER


class TokenAuth:
    def __init__(self, token: str | None) -> None:
        # None only in --insecure mode, which the server logs loudly at start.
        self._token = token.encode() if token else None

    async def check(self, context: grpc.aio.ServicerContext) -> None:
        if self._token is None:
            return
        presented = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER, "")
        if isinstance(presented, bytes):
            presented = presented.decode(errors="replace")
        if not presented:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "no token presented: start the node with --token (or FEDGPU_TOKEN) set to the "
                "aggregator's token",
            )
        if not hmac.compare_digest(presented.encode(), self._token):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong token: use the token the aggregator was started with (--token / "
                "FEDGPU_TOKEN)",
            )
