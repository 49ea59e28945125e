"""Every Admin call ends with a named gRPC status and a bounded message, never UNKNOWN.

An exception a handler did not expect used to reach the operator as gRPC UNKNOWN with
whatever text it carried (a MemoryError from a 10**9-node job, a RecursionError from a file
nested 20,000 deep). `guarded` maps what the aggregator raises on purpose to the status it
means, and anything else to INTERNAL with its type only (the traceback goes to the log): the
operator learns the call failed and where to look, and the aggregator goes on serving.

It is also the one door every Admin call passes: `guarded` asks the service to `admit` the
caller (who they are, and whether their role may make this call) before the handler runs, and
to `audit` the call with its outcome after it ends, so no handler can forget either.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from grpc.aio import AbortError

from fedgpu.core.errors import FedgpuError
from fedgpu.server.jobs.intake import QueueFull
from fedgpu.server.jobs.queue import JobError

log = logging.getLogger("fedgpu.server.admin")

# Longest message an Admin error carries: enough for any refusal we write, and input echoed
# in one (a job id, a key) is cut well before this.
MAX_DETAIL = 2000

F = TypeVar("F", bound=Callable[..., Any])


def bounded(text: str, limit: int = MAX_DETAIL) -> str:
    return text if len(text) <= limit else text[:limit] + f"... (+{len(text) - limit} chars)"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message an exception from a handler answers with."""
    if isinstance(exc, JobError):
        return grpc.StatusCode.NOT_FOUND, bounded(str(exc))
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, bounded(str(exc))
    if isinstance(exc, FedgpuError):
        return grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc))
    if isinstance(exc, RecursionError):
        return grpc.StatusCode.INVALID_ARGUMENT, "the request is nested too deep to read"
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, ("the aggregator ran out of memory "
                                                    "handling this request")
    return grpc.StatusCode.INTERNAL, (f"internal error on the aggregator "
                                      f"({type(exc).__name__}); its log has the details")


def outcome_of(context: grpc.aio.ServicerContext) -> tuple[str, str | None]:
    """The status name a call ended with ("OK" when no error was set) and its message."""
    code = context.code()
    if code is None or code == grpc.StatusCode.OK or code == 0:
        return ("CANCELLED", None) if context.cancelled() else ("OK", None)
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    return name, context.details() or None


async def _answer(context: grpc.aio.ServicerContext, name: str, exc: Exception) -> None:
    code, message = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("Admin.%s failed unexpectedly", name, exc_info=exc)
    await context.abort(code, message)


def guarded(method: F) -> F:
    """Wrap an Admin handler (a coroutine or an async generator) with `status_of`."""
    name = method.__name__

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self: Any, request: Any,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                await self.admit(name, request, context)
                async for item in method(self, request, context):
                    yield item
            except AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - answered with a named status
                await _answer(context, name, exc)
            finally:
                await self.audit(name, request, context)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await self.admit(name, request, context)
            return await method(self, request, context)
        except AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - answered with a named status
            await _answer(context, name, exc)
            raise
        finally:
            await self.audit(name, request, context)

    return unary  # type: ignore[return-value]
