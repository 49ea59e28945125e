"""A node's side of secure aggregation, on the node's one wire client (node/wire_client.py).

A TRAIN task whose header carries `secagg_setup` is trained as usual; then, instead of its
weights, the node sends the protocol's messages (fedgpu/core/secagg/site.py decides what they
say), each as an update of the stage's kind whose payload is the message's bytes, and pulls
the aggregator's relay of the next stage as a task of that kind for the same task id. What it
masks is its change to the model (trained - received), weighted by its example count, which
never leaves the node in the clear.

Written once, asynchronously: the agent runs it through its blocking client (`answer`),
`fedgpu sim` awaits `take_part` on its own loop. The cryptography and the masking run in a
thread, so other clients sharing the loop go on meanwhile. It stops when the protocol is done,
when the site refuses a step (the failure is reported), when the aggregator abandons the task
(the round closed) or when the node stops. A task of another round that arrives meanwhile is
left pending on the aggregator, which serves it again on the next pull.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from fedgpu.core import bulk, codec, digests, local_params, segment_hasher
from fedgpu.core.errors import FedgpuError
from fedgpu.core.secagg import layout
from fedgpu.core.secagg.errors import SecAggError, Stage
from fedgpu.core.secagg.identity import SiteIdentity
from fedgpu.core.secagg.messages import (
    KeyRelay,
    Setup,
    ShareRelay,
    SurvivorView,
    UnmaskRequest,
)
from fedgpu.core.secagg.noise_share import NoiseShare, ShareReport, Spans, private_spans
from fedgpu.core.secagg.site import SiteSession
from fedgpu.core.tls import TlsFiles
from fedgpu.node import clear_fields, messages
from fedgpu.node.client import AggregatorClient
from fedgpu.node.policy import Decision
from fedgpu.node.pulled import PayloadError
from fedgpu.node.rounds import local_state
from fedgpu.node.rounds.process import RoundOutcome
from fedgpu.node.unmask_ledger import UnmaskLedger
from fedgpu.node.wire_client import WireClient
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node.secagg")

KIND_OF = {
    Stage.ADVERTISE_KEYS: pb.TASK_KIND_SECAGG_ADVERTISE_KEYS,
    Stage.SHARE_KEYS: pb.TASK_KIND_SECAGG_SHARE_KEYS,
    Stage.MASKED_INPUT: pb.TASK_KIND_SECAGG_MASKED_INPUT,
    Stage.CONSISTENCY: pb.TASK_KIND_SECAGG_CONSISTENCY,
    Stage.UNMASK: pb.TASK_KIND_SECAGG_UNMASK,
}


class Interrupted(Exception):
    """The protocol cannot go on for this node (abandoned, stopped, another task came)."""


@dataclass
class Link:
    """What the protocol needs of its node."""

    wire: WireClient
    node_id: str
    poll_s: int
    max_bytes: int
    # True once the aggregator abandoned the task (heartbeats) or the node stops.
    cancelled: Callable[[], bool]
    # The global models this site answered an unmask request for (node/unmask_ledger.py);
    # None: one in memory for this call only (a simulated node).
    ledger: UnmaskLedger | None = None
    # The site's own floor on the threshold (`fedgpu node start --secagg-min-threshold`), on
    # top of the strict majority every site demands (fedgpu/core/secagg/params.py).
    min_threshold: int = 0
    # The site's TLS identity (mutual TLS): it signs its keys and survivor set and demands
    # its neighbours' signatures (fedgpu/core/secagg/identity.py). None: tokens only, the
    # honest-but-curious model.
    identity: SiteIdentity | None = None


async def take_part(link: Link, task: pb.TaskHeader, update: pb.UpdateHeader,
                    change: np.ndarray, weight: float,
                    private: Spans | None = None,
                    metrics: dict[str, float] | None = None) -> str | None:
    """Run the protocol for `task`: `change` is the round's change to the model (flat, in
    the layout of fedgpu/core/secagg/layout.py), `update` the header a plain answer would
    have had (its metrics go masked inside the input, when the round has room). With
    distributed DP (the task's privacy_distributed) the site clips `change` over the
    `private` spans (its floating-point values; all when None) and adds its noise share
    before masking. `metrics`: the round's numbers before the allow-list
    (messages.masked_values; None: those `update` carries). None when done, else why it stopped."""
    started = time.monotonic()
    stage = Stage.SETUP
    # Only the allow-list leaves in the clear (node/clear_fields.py), whoever built `update`;
    # the training numbers go masked inside the vector when the round has room for them.
    if metrics is None:
        metrics = messages.masked_values({
            "train_metrics": dict(update.train_metrics),
            "eval_metrics": dict(update.eval_metrics),
            "num_eval_examples": update.num_eval_examples})
    clear_fields.log_kept(task.round, metrics, clear_fields.restrict(task, update))
    ledger = link.ledger if link.ledger is not None else UnmaskLedger(None)
    model = model_digest(task)
    job = task.job_terms.job_id[:128] if task.HasField("job_terms") else ""
    try:
        noise = noise_share_of(task)
        # Refused up front when this model's sum was unmasked with this site in it already.
        why = ledger.problem(model, job, task.round)
        if why is not None:
            raise SecAggError(why)
        site = SiteSession(Setup.decode(bytes(task.secagg_setup)),
                           min_threshold=link.min_threshold, identity=link.identity)
        stage = Stage.ADVERTISE_KEYS
        await _send(link, task, stage, site.advertise().encode())
        stage = Stage.SHARE_KEYS
        relay = KeyRelay.decode(await _wait(link, task, stage))
        await _send(link, task, stage, (await asyncio.to_thread(site.share_keys, relay)).encode())
        stage = Stage.MASKED_INPUT
        shares = ShareRelay.decode(await _wait(link, task, stage))
        if noise is None and weight > site.params.max_weight:
            # The round's bound comes from the sizes sites stated at registration; above it
            # the weight is capped (a plain round would refuse the update instead).
            log.warning("round %d: %d examples count as the round's max_weight %d",
                        task.round, int(weight), site.params.max_weight)
        masked = await asyncio.to_thread(site.masked_input, shares, change, weight, noise,
                                         private, metrics)
        del change
        if site.noise_report is not None:
            _note_share(task, update, site.noise_report)
        data = await asyncio.to_thread(masked.encode)
        del masked
        await _send(link, task, stage, data, update)
        del data
        if link.identity is not None:
            # Signed round: sign the survivor set shown, before any share is revealed.
            stage = Stage.CONSISTENCY
            view = SurvivorView.decode(await _wait(link, task, stage))
            await _send(link, task, stage, site.consistency(view).encode())
        stage = Stage.UNMASK
        request = UnmaskRequest.decode(await _wait(link, task, stage))
        reply = site.unmask(request)
        why = ledger.problem(model, job, task.round)
        if why is not None:
            raise SecAggError(why)
        try:
            # Remembered before the reply leaves: a crash after sending must not forget it.
            ledger.record(model, task.round, job)
        except OSError as exc:
            raise SecAggError(f"cannot remember the answer in the state directory "
                              f"({exc}); not answering") from None
        await _send(link, task, stage, reply.encode())
    except SecAggError as exc:
        # This site refused a step or could not read a message: it says so, and it is out.
        why = f"secure aggregation stopped at {stage}: {exc}"
        log.warning("round %d: %s", task.round, why)
        failed = pb.UpdateHeader(node_id=link.node_id, task_id=task.task_id, round=task.round,
                                 kind=KIND_OF.get(stage, pb.TASK_KIND_SECAGG_ADVERTISE_KEYS),
                                 failed=True, error=why)
        try:
            await link.wire.push(failed, None)
        except grpc.RpcError:
            pass  # refused or unreachable: the round drops this site either way
        return why
    except Interrupted as exc:
        why = f"secure aggregation ended at {stage}: {exc}"
        log.warning("round %d: %s", task.round, why)
        return why
    except (grpc.RpcError, PayloadError, bulk.RefusedError, bulk.BulkProtocolError,
            OSError) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        why = f"secure aggregation ended at {stage}: {detail}"
        log.warning("round %d: %s", task.round, why)
        return why
    log.info("round %d: secure aggregation done in %.1fs", task.round,
             time.monotonic() - started)
    return None


def noise_share_of(task: pb.TaskHeader) -> NoiseShare | None:
    """Distributed DP's settings from the task; None when the job has none. SecAggError when
    they are out of range (the site refuses rather than mask an unprotected update)."""
    if not task.HasField("privacy_distributed"):
        return None
    dp = task.privacy_distributed
    return NoiseShare(dp.clip_norm, dp.noise_multiplier)


def secagg_identity(files: TlsFiles | None) -> SiteIdentity | None:
    """The site's signing identity under mutual TLS (its client certificate and key, and the
    CA that checks its neighbours'); None with tokens only. A key that cannot sign stops the
    node at start, not in the middle of a round."""
    if files is None or not files.mutual or files.key is None or files.cert is None:
        return None
    assert files.ca is not None
    try:
        return SiteIdentity.from_files(files.cert, files.key, files.ca)
    except (SecAggError, ValueError, OSError) as exc:
        raise FedgpuError(f"secure aggregation cannot sign with the node's TLS key: {exc}"
                          ) from None


def model_digest(task: pb.TaskHeader) -> str:
    """The digest of the global model the TRAIN task carried (the wire client checked the
    payload against it); the key of the site's one unmasking per model."""
    if task.payload_digest:
        return f"{task.payload_digest_algorithm}:{task.payload_digest}"
    return f"sha256:{task.payload_sha256}" if task.payload_sha256 else ""


def _note_share(task: pb.TaskHeader, update: pb.UpdateHeader, report: ShareReport) -> None:
    """The share's noise std goes with the masked input (the aggregator checks it is there);
    the update's norm, whether it was clipped and how many values the range cut stay in this
    node's log: under secure aggregation they are facts about one site that the aggregator
    must not learn."""
    update.train_metrics["ddp_noise_std"] = report.std
    log.info("round %d: distributed DP: update norm %.4g%s, noise share std %.4g, %d values "
             "cut by the range", task.round, report.norm,
             " (clipped)" if report.clipped else "", report.std, report.cut)


def _digest(data: bytes | bytearray) -> tuple[str, bytes]:
    """(digest, segment digests) of a stage message: codec.WIRE_DIGEST, in one pass."""
    return segment_hasher.of_views([memoryview(data)])


async def _send(link: Link, task: pb.TaskHeader, stage: Stage, data: bytes | bytearray,
                like: pb.UpdateHeader | None = None) -> None:
    header = pb.UpdateHeader()
    if like is not None:
        # The masked input carries the round's metrics and resources like a plain update;
        # its example count (the weight) travels masked inside the payload only.
        header.CopyFrom(like)
    header.node_id, header.task_id, header.round = link.node_id, task.task_id, task.round
    header.kind, header.num_examples = KIND_OF[stage], 0
    digest, segs = await asyncio.to_thread(_digest, data)
    digests.stamp(header, codec.WIRE_DIGEST, digest)
    source = codec.Encoded((memoryview(data),), len(data), digest, codec.WIRE_DIGEST, segs)
    for attempt in range(3):
        try:
            # A refusal (grpc.RpcError) ends this node's part: the caller stops.
            await link.wire.push(header, source)
            return
        except grpc.RpcError as exc:
            if attempt and exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                return  # the try that broke off had arrived
            raise
        except (OSError, bulk.BulkProtocolError):
            # The bulk connection broke off (a busy port resets some): send again. Had the
            # first try arrived after all, the aggregator refuses the repeat and keeps it.
            if attempt == 2:
                raise
            await asyncio.sleep(0.2 + random.random() * 0.3)


async def _wait(link: Link, task: pb.TaskHeader, stage: Stage) -> bytes:
    """The payload of the aggregator's relay for `stage`, for this task."""
    kind = KIND_OF[stage]
    while True:
        if link.cancelled():
            raise Interrupted("the aggregator closed the round (or the node stops)")
        try:
            # Only this round's next stage: a site with --slots may have other jobs' tasks
            # waiting, which its other slots take.
            pulled = await link.wire.pull(link.node_id, link.poll_s, link.max_bytes,
                                          only=task.task_id)
        except PayloadError as exc:
            if exc.header is not None:
                raise
            # The stream or the bulk download broke off before the relay was whole (a busy
            # bulk port resets connections): the aggregator serves the same relay again.
            await asyncio.sleep(0.2 + random.random() * 0.3)
            continue
        try:
            header = pulled.header
            if header.kind == pb.TASK_KIND_NONE:
                continue
            if header.task_id != task.task_id:
                raise Interrupted(f"a task of round {header.round} arrived")
            if stage == Stage.CONSISTENCY and header.kind == KIND_OF[Stage.UNMASK]:
                # A signed round's unmask request without the consistency check first.
                raise SecAggError("aborted: the aggregator asked for shares without the "
                                  "consistency check (this site signs its rounds)")
            if header.kind != kind:
                # An earlier task of this round served again before the aggregator saw our
                # answer: wait a moment for the relay we need.
                await asyncio.sleep(0.2)
                continue
            return bytes(pulled.payload or b"")
        finally:
            if isinstance(pulled.receiver, codec.Assembler):
                pulled.receiver.release()


def answer(client: AggregatorClient, node_id: str, poll_s: int, max_bytes: int,
           decision: Decision | None, task: pb.TaskHeader, outcome: RoundOutcome,
           received: bytes | bytearray | memoryview, cancelled: Callable[[], bool],
           ledger: UnmaskLedger | None = None, min_threshold: int = 0,
           identity: SiteIdentity | None = None) -> None:
    """The agent's way in: a trained round answered with the protocol (blocking)."""
    assert outcome.weights is not None
    update = messages.update_header(task, node_id, decision, outcome.resources,
                                    outcome.result, "")
    try:
        # Local tensors (local_params) stay at the site: the vector covers the rest only.
        base = local_params.shared(codec.decode(received)[0],
                                   local_state.patterns_in(task.hyperparameters_json))
        change = layout.delta(codec.read_file(outcome.weights), base)
        private = private_spans(base)
        del base
    except (SecAggError, codec.CodecError) as exc:
        failed = messages.update_header(task, node_id, decision, outcome.resources, None,
                                        f"secure aggregation: {exc}")
        try:
            client.push(failed, None)
        except grpc.RpcError as err:
            log.warning("round %d: could not report %s: %s", task.round, exc, err.details())
        return
    link = lambda wire: Link(wire, node_id, poll_s, max_bytes, cancelled,  # noqa: E731
                             ledger, min_threshold, identity)
    # update_header kept the training and evaluation numbers on the site; they go masked.
    metrics = messages.masked_values(outcome.result)
    client.run(lambda wire: take_part(link(wire), task, update, change,
                                      float(update.num_examples), private, metrics))
