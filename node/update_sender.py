"""Sending a task's answer to the aggregator, with the agent's retry rule (an unreachable
aggregator is retried until the report deadline or the agent stops), and the site's audit
record of every task it ran or refused."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from fedgpu.core.audit import AuditError, AuditLog
from fedgpu.node.client import AggregatorClient, is_unreachable
from fedgpu.node.retry import GaveUp, RetryPolicy, Stopped, retry
from fedgpu.node.rounds.process import RoundOutcome
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node")


class UpdateSender:
    """`push` an update (whether the aggregator acknowledged it); `audit_task` its record."""

    def __init__(self, client: AggregatorClient, policy: Callable[[], RetryPolicy],
                 stop: threading.Event, audit: AuditLog, aggregator: str) -> None:
        self._client, self._policy, self._stop = client, policy, stop
        self._audit, self._actor = audit, f"aggregator {aggregator}"

    def push(self, task: pb.TaskHeader, update: pb.UpdateHeader, weights: Path | None) -> bool:
        def waiting(exc: BaseException, delay: float) -> None:
            code = exc.code().name if isinstance(exc, grpc.RpcError) else str(exc)
            log.warning("could not send the update (%s); retrying in %.1fs", code, delay)

        try:
            reply = retry(lambda: self._client.push(update, weights), what="report",
                          policy=self._policy(), retryable=is_unreachable, stop=self._stop,
                          on_retry=waiting)
        except grpc.RpcError as exc:
            log.warning("update for round %d not accepted: %s", task.round, exc.details())
        except GaveUp as exc:
            log.error("giving up on the update for round %d: %s", task.round, exc)
        except Stopped:
            log.warning("stopping: the update for round %d was not sent", task.round)
        else:
            log.info("aggregator: %s", reply.message)
            return True
        return False

    def audit_task(self, header: pb.TaskHeader, kind: str, outcome: RoundOutcome | None,
                   error: str) -> None:
        """The site's record of what it ran for the aggregator, or refused and why."""
        ran = "OK" if outcome is not None and outcome.ok else "FAILED" if outcome is not None \
            else "REFUSED"
        try:
            self._audit.record(self._actor, f"task.{kind}",
                               f"{header.task_name} round {header.round} ({header.task_id})",
                               ran, error or None)
        except (OSError, AuditError) as exc:
            log.error("site audit log %s: %s", self._audit.path, exc)
